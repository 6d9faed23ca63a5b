"""tools/attention_trace.py: the trace build's folder and the summary of the per-CTA stamps (CPU)."""

import importlib.util
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("attention_trace", ROOT / "tools/attention_trace.py")
trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace)


def test_build_makes_a_traced_variant(tmp_path):
    trace.build(tmp_path / "T")
    text = (tmp_path / "T" / "lowbit_decode.py").read_text()
    assert '"-DMOEKV_TRACE"' in text and "moekv_trace_T_sm" in text and "last_trace = (lse" in text
    assert (tmp_path / "T" / "csrc" / "lowbit_decode_kernel.cuh").read_text().count("MOEKV_TRACE_CTA(") >= 7


def test_summary_of_known_stamps():
    # 2 CTAs (one sequence-head, 2 splits), 4 warps: globaltimer in ns, clock64 in cycles
    stamps = torch.zeros(2, 32, dtype=torch.int64)
    for cta, (pages_end, exit_at) in enumerate([(10_000, 14_000), (12_000, 20_000)]):
        g = {0: 1_000, 1: 2_000, 2: 3_000, 12: pages_end, 13: pages_end + 1_000, 14: pages_end + 2_000, 15: exit_at}
        for slot, t in g.items():
            stamps[cta, slot] = t
        for w in range(4):
            stamps[cta, 4 + w] = pages_end - 500 * w
        stamps[cta, 18], stamps[cta, 28] = 100, 100 + 7_000 * (cta + 1)
    s = trace.summarise(stamps, splits=2, warps=4)
    assert s["total_us"] == 19.0                                   # last exit - first entry
    assert s["phase_us_max"]["tables->pages"] == 9.0                # 12000 - 3000 ns
    assert s["last_split"]["exit"] == 19.0 and s["first_split"]["pages"] == 9.0
    assert s["warp_spread_us_median"] == 1.5
    assert s["slowest_cta"]["staged"] == 12.0
    assert s["pages_cycles_median"] == 7_000.0                     # torch: the lower of two middle values
