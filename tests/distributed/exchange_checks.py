"""One MoE layer's all-gather exchange against the single-device experts, run by ep_worker.py ("exchange").

Every rank builds the same tiny random model (all experts), keeps a copy of layer 0's full expert weights,
then shards it. For each case, every rank routes its own random tokens, calls the expert-parallel layer
(static = a graph step's path through `runtime.static_forward`, with padding rows; eager = uneven
per-rank counts) and compares its rows with ops.reference.moe_experts_reference over all experts on the
same rows: bit for bit (`max_abs_diff` 0), or the largest difference. The static path's launching ops per
layer are counted with tests/distributed/op_count.py.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from moekv.distributed.groups import init_expert_parallel
from moekv.ops.reference.layers import route_topk
from moekv.ops.reference.moe import moe_experts_reference
from tests.distributed.helpers import engine_config, tiny_arch
from tests.distributed.op_count import layer_op_counts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _inputs(arch, dtype, seed: int, rank: int, rows: int):
    generator = torch.Generator().manual_seed(seed * 1000 + rank * 100 + rows)
    hidden = torch.randn(rows, arch.hidden_size, generator=generator).to(dtype)             # [T, H]
    logits = torch.randn(rows, arch.num_experts, generator=generator)                       # [T, E]
    weights, ids = route_topk(logits, arch.top_k, True)                                      # [T, k] fp32, int64
    return hidden, ids, weights


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if torch.equal(got, want):
        return 0.0
    return float((got.float() - want.float()).abs().max())


def run_exchange(spec: dict, world: int) -> dict:
    from moekv.distributed import expert_parallel

    saved = expert_parallel.MAX_PICK_TABLE
    if "max_pick_table" in spec:             # 0: codes carry physical ids (the large-table fallback)
        expert_parallel.MAX_PICK_TABLE = spec["max_pick_table"]
    try:
        return _run_exchange(spec, world)
    finally:
        expert_parallel.MAX_PICK_TABLE = saved


def _run_exchange(spec: dict, world: int) -> dict:
    from moekv.distributed.sharding import moe_blocks, shard_experts
    from moekv.engine.factory import initial_placements, make_runtime
    from moekv.models.loader import build_random_model

    arch = replace(tiny_arch(spec["num_experts"], spec.get("top_k", 2)), **spec.get("arch", {}))
    dtype = DTYPES[spec.get("dtype", "float32")]
    group = init_expert_parallel(world, "cpu")
    rank = group.rank
    config = engine_config(world, num_redundant_experts=spec.get("redundant", 0), expert_dispatch="allgather")
    runtime = make_runtime(config.parallel, group)
    model = build_random_model(arch, dtype=dtype, seed=spec["seed"])
    full = moe_blocks(model)[0].experts
    w_gate_up, w_down = full.w_gate_up.detach().clone(), full.w_down.detach().clone()
    shard_experts(model, runtime, initial_placements(arch, world, config.parallel.num_redundant_experts),
                  group.device)
    layer = runtime.layers[0]
    exchange = runtime.exchanges["allgather"]
    cases = {}
    with torch.inference_mode():
        for bucket in spec.get("buckets", [1, 4]):
            # rank r has bucket - r real rows (at least 0): padding rows at the end, as in a graph bucket
            valid_rows = max(0, bucket - rank)
            hidden, ids, weights = _inputs(arch, dtype, spec["seed"], rank, bucket)
            valid = torch.tensor([1] * valid_rows + [0] * (bucket - valid_rows), dtype=torch.int64)
            meta = SimpleNamespace(token_valid=valid)

            def static_call():
                with runtime.static_forward(meta):
                    return layer.forward(hidden, ids, weights)

            counts = layer_op_counts(static_call)
            got = counts.pop("result")[:valid_rows]
            want = moe_experts_reference(hidden, w_gate_up, w_down, ids, weights)[:valid_rows]
            cases[f"static_{bucket}"] = dict(counts, max_abs_diff=_diff(got, want), rows=valid_rows)
        for token_counts in spec.get("eager_counts", [[3, 1], [0, 2]]):
            token_counts = (token_counts + [0] * world)[:world]
            rows = token_counts[rank]
            hidden, ids, weights = _inputs(arch, dtype, spec["seed"], rank, rows)
            got = exchange(layer, hidden, ids, weights, token_counts)
            want = moe_experts_reference(hidden, w_gate_up, w_down, ids, weights) if rows else hidden[:0]
            name = "eager_" + "_".join(map(str, token_counts))
            cases[name] = dict(max_abs_diff=_diff(got, want), rows=rows)
    table, scale, span = layer.routing_table()
    # rank_stats: ep_worker gathers every rank's into "per_rank"
    return {"tokens": [], "rank_stats": {"rank": rank, "cases": cases, "local_slots": layer.w_gate_up.shape[0],
                                         "table": {"scale": scale, "span": span, "entries": table.numel()}}}
