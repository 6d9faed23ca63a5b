"""The all-gather exchange of one MoE layer on 2 gloo processes (tests/distributed/exchange_checks.py):
the same rows as the single-device experts over all experts, and how few ops a graph step's layer launches.

Each case: every rank routes its own random tokens through the expert-parallel layer, in a graph step's
static form (the bucket's rows, padding rows past a per-rank count) and eagerly (uneven per-rank counts,
a rank with none), and compares its rows with ops.reference.moe_experts_reference. bf16 with top-2 must be
bit-identical (fp32 too up to the last bit of the CPU matmul, which depends on how many rows share an
expert); replicas, the physical-id fallback and a rank without slots as well.

Launching ops per layer in a graph step (tests/distributed/op_count.py, profiled on the CPU): before the
fused path (commit d110ba1) 43-45 aten ops plus the two collectives and the expert op; now: the hidden and
weights copies, the routing codes, the per-step code offsets (once per forward, counted here because one
layer is profiled), the table gather, amax, >=, two wheres and the cast back.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.helpers import run_worker

SCENARIOS = [
    dict(name="bf16", kind="exchange", num_experts=5, seed=1, dtype="bfloat16", buckets=[1, 4]),
    dict(name="fp32", kind="exchange", num_experts=5, seed=1, buckets=[1, 4]),
    # 5 experts + 2 replicas on 2 ranks (4 + 3 slots): codes carry the replica pick (M = 2)
    dict(name="replicas", kind="exchange", num_experts=5, seed=3, dtype="bfloat16", redundant=2, buckets=[1, 4]),
    # the same with codes that carry physical ids (the fallback for large tables)
    dict(name="replicas_physical", kind="exchange", num_experts=5, seed=3, dtype="bfloat16", redundant=2,
         max_pick_table=0, buckets=[4]),
    dict(name="top3", kind="exchange", num_experts=6, top_k=3, seed=2, dtype="bfloat16", buckets=[1, 4]),
    # one expert on 2 ranks: rank 1 holds no slot and owes only zeros
    dict(name="no_slots", kind="exchange", num_experts=1, top_k=1, seed=4, dtype="bfloat16", buckets=[2]),
]
# the fused graph-step path: every op that may launch per MoE layer (plus the 2 collectives and 1 expert op)
ALLOWED_OPS = {"aten::copy_", "aten::add", "aten::index", "aten::amax", "aten::ge", "aten::where", "aten::to",
               "aten::_to_copy"}
MAX_KERNELS = 10          # copy x2, add (codes), add (offsets, once per forward), index, amax, ge, where x2, to


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(2, SCENARIOS, tmp_path_factory.mktemp("exchange"))


def cases(result):
    return [(stats["rank"], name, case) for stats in result["per_rank"] for name, case in stats["cases"].items()]


@pytest.mark.parametrize("name", ["bf16", "replicas", "replicas_physical", "top3", "no_slots"])
def test_rows_match_one_device_bit_for_bit(results, name):
    result = results[name]
    for rank, case_name, case in cases(result):
        assert case["max_abs_diff"] == 0.0, (name, rank, case_name, case)
    assert {name for _, name, _ in cases(result)} >= {"eager_3_1", "eager_0_2"}


def test_fp32_rows_match_up_to_the_matmul_last_bit(results):
    for rank, case_name, case in cases(results["fp32"]):
        assert case["max_abs_diff"] <= 1e-9, (rank, case_name, case)      # outputs ~1e-2: an ulp is ~1e-9


def test_routing_tables(results):
    for stats in results["replicas"]["per_rank"]:
        assert stats["table"] == {"scale": 2, "span": 10, "entries": 21}      # 1 + 2 * E * M
    for stats in results["replicas_physical"]["per_rank"]:
        assert stats["table"] == {"scale": 0, "span": 7, "entries": 15}       # 1 + 2 * S
    assert [s["local_slots"] for s in results["no_slots"]["per_rank"]] == [1, 0]


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_graph_step_layer_launches_few_ops(results, name):
    # the physical-id fallback computes physical_ids on the sender: 4 more ops (replica count, +, %, table)
    extra = {"aten::remainder", "aten::index"} if name == "replicas_physical" else set()
    bound = MAX_KERNELS + (4 if name == "replicas_physical" else 0)
    for rank, case_name, case in cases(results[name]):
        if not case_name.startswith("static"):
            continue
        assert case["layers"] == 1 and case["collectives"] == 2, case
        assert case["expert_calls"] == (0 if results[name]["per_rank"][rank]["local_slots"] == 0 else 1), case
        assert set(case["ops"]) <= ALLOWED_OPS | extra, (rank, case_name, case["ops"])
        assert case["kernels"] <= bound, (rank, case_name, case["ops"])


@pytest.mark.parametrize("tokens", [2, 40])          # 2: the decode kernels; 40: the grouped path
def test_rank_shares_sum_to_one_device_with_the_triton_kernels(tokens):
    """What each rank's fused call returns (ops.dispatch.moe_experts with out_dtype=float32 on its own slots,
    choices owned elsewhere on a reused slot with weight 0, hidden rows strided as in the gathered buffer),
    summed in fp32, is the single-device kernel's fp32 sum bit for bit, and cast, its output (Triton on
    CUDA, else under the interpreter tests/conftest.py enables, whose in-kernel fp32 -> bf16 cast truncates
    where torch and the GPU round to nearest even: there only the fp32 sums are compared)."""
    pytest.importorskip("triton")
    import torch

    from moekv.ops import dispatch
    from moekv.ops.reference.layers import route_topk

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(tokens)
    experts, hidden_size, inter, dtype = 6, 32, 16, torch.bfloat16
    w_gate_up = (0.2 * torch.randn(experts, 2 * inter, hidden_size, generator=generator)).to(dtype).to(device)
    w_down = (0.2 * torch.randn(experts, hidden_size, inter, generator=generator)).to(dtype).to(device)
    rows = torch.randn(tokens, hidden_size + 8, generator=generator).to(dtype).to(device)[:, :hidden_size]
    weights, ids = route_topk(torch.randn(tokens, experts, generator=generator).to(device), 2, True)
    with dispatch.override(backend="triton"):
        want = dispatch.moe_experts(rows.contiguous(), w_gate_up, w_down, ids, weights)          # [T, H] bf16
        want_fp32 = dispatch.moe_experts(rows.contiguous(), w_gate_up, w_down, ids, weights, out_dtype=torch.float32)
        total = torch.zeros(tokens, hidden_size, dtype=torch.float32, device=device)
        for owned in ([0, 2, 3], [1, 4, 5]):
            table = torch.full((experts,), -1, dtype=torch.int64, device=device)
            table[owned] = torch.arange(len(owned), device=device)
            local = table[ids]                                                                     # [T, 2]
            mine = local >= 0
            share = dispatch.moe_experts(rows, w_gate_up[owned], w_down[owned],
                                         torch.where(mine, local, local.amax().clamp_min(0)),
                                         torch.where(mine, weights, 0.0), out_dtype=torch.float32)
            assert share.dtype == torch.float32
            total += share
    assert torch.equal(total, want_fp32)
    if device == "cuda":
        assert torch.equal(total.to(dtype), want)


def test_grown_constants_stay_alive_for_captured_graphs():
    """A graph captured with a small bucket reads the constant tensor it saw; growing the cache for a
    larger bucket must not free it (CUDA graphs do not keep their inputs alive)."""
    from moekv.distributed.exchange import AllGatherExchange

    exchange = AllGatherExchange()
    small = exchange._constant(("k",), 8, torch.device("cpu"), lambda t: t * 2)
    first = small.untyped_storage().data_ptr()
    big = exchange._constant(("k",), 200, torch.device("cpu"), lambda t: t * 2)
    assert big.shape[0] == 200 and torch.equal(big[:8], small)
    assert any(t.untyped_storage().data_ptr() == first for t in exchange._retired)
