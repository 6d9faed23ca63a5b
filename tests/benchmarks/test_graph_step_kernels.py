"""tools/graph_step_kernels.py: ncu's CSV read back into per-step kernel tables (a hand-made CSV with known times)."""

from __future__ import annotations

import pytest

from tools import graph_step_kernels as gsk

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')


def _row(i: int, name: str, ns: str, unit: str = "nsecond") -> str:
    return (f'"{i}","1","python3","h","{name}","1","7","(128, 1, 1)","(16, 8, 1)","0","9.0","Command line profiler '
            f'metrics","gpu__time_duration.sum","{unit}","{ns}"\n')


def test_parse_and_summarise():
    text = "==PROF== Connected to process 1\n" + HEADER
    names = ["void moekv_v7::decode_kernel<3, 128>(Params)", "_rms_norm_kernel", "nvjet_sm90_tst_64x8"]
    i = 0
    for _ in range(2):                          # 2 steps of 2 layers: per layer attention, norm, GEMM
        for _layer in range(2):
            for name, ns in zip(names, ("30000", "2,000", "100000")):
                text += _row(i, name, ns)
                i += 1
    text += _row(i, "argmax_kernel", "1.5", unit="usecond")
    kernels = gsk.parse_ncu_csv(text)
    assert len(kernels) == 13 and kernels[1]["us"] == pytest.approx(2.0)
    s = gsk.summarise(kernels, steps=2, layers=2)
    assert s["us_per_step"] == pytest.approx((30 + 2 + 100) * 2 + 0.75)
    assert s["us_per_step_by_class"] == pytest.approx({"GEMM": 200.0, "attention": 60.0, "small": 4.75})
    first = s["kernels"][0]
    assert first["name"] == "nvjet_sm90_tst_64x8" and first["launches_per_step"] == 2
    assert first["us_per_launch"] == pytest.approx(100.0)
    md = gsk.markdown({"model": "m", "num_layers": 2, "batch": 1, "context": 16, "gpu": "g", "date": "d",
                       "commit": "c", "command": "x", "runs": {"int3": s, "bf16": {"error": "boom"}}})
    assert "264.8 us of kernels per step" in md and "## bf16: failed" in md


def test_no_rows():
    assert gsk.parse_ncu_csv("==PROF== nothing profiled\n") == []
