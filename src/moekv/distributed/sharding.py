"""Putting expert weights where a placement says, after the model is built (gpt-fast's tp.py habit).

- `shard_experts(model, ...)`: a built model (all experts, e.g. loaded on the CPU) keeps only this
  rank's slots; every other weight stays replicated. The model then moves to the rank's device.
- `build_random_model(arch, ...)`: a random-weight model (benchmarks) that never allocates the
  other ranks' experts: built on the meta device, local experts materialised on the real one.
- `rebalance(model, runtime)`: new placements from the load all ranks recorded, then
  `move_expert_weights(layer, new)` per layer: each expert a rank gains is broadcast from the
  lowest rank that held it (every rank takes part in every broadcast: plain collectives, no
  point-to-point bookkeeping; a rebalance is rare and between steps).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekv.config import FP8_EXPERT_PARALLEL_ERROR, ArchConfig
from moekv.errors import ConfigError
from moekv.distributed.expert_parallel import ExpertParallelExperts, ExpertParallelRuntime
from moekv.distributed.balancer import balance
from moekv.distributed.placement import ExpertPlacement
from moekv.layers.moe import MoEBlock
from moekv.layers.norm import RMSNorm
from moekv.layers.rotary import RotaryEmbedding

_KNOWN_BUFFERS = {"rotary.inv_freq", "expert_load"}
_INIT_STD = 0.02          # as models.loader.build_random_model


def moe_blocks(model: torch.nn.Module) -> list[MoEBlock]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]


def shard_experts(model: torch.nn.Module, runtime: ExpertParallelRuntime,
                  placements: dict[int, ExpertPlacement], device: torch.device) -> torch.nn.Module:
    """Swap every MoE block's experts for this rank's ExpertParallelExperts; move the model to `device`."""
    arch = model.arch
    if any(getattr(block.experts, "quantized", False) for block in moe_blocks(model)):
        raise ConfigError(FP8_EXPERT_PARALLEL_ERROR)
    for block in moe_blocks(model):
        placement = placements[block.layer_idx]
        full = block.experts
        experts = ExpertParallelExperts(runtime, placement, block.layer_idx, arch.hidden_size,
                                        arch.expert_intermediate_size, arch.top_k, full.w_gate_up.dtype, device)
        mine = torch.tensor(placement.rank_experts[runtime.rank], dtype=torch.long, device=full.w_gate_up.device)
        with torch.no_grad():
            experts.w_gate_up.copy_(full.w_gate_up.index_select(0, mine))   # [S_local, 2I, H]
            experts.w_down.copy_(full.w_down.index_select(0, mine))         # [S_local, H, I]
        block.experts = experts
        runtime.register(experts)
    return model.to(device)


def _seed(seed: int, *parts) -> int:
    return (seed * 1_000_003 + zlib.crc32(repr(parts).encode())) % (2 ** 62)


def build_random_model(arch: ArchConfig, runtime: ExpertParallelRuntime, placements: dict[int, ExpertPlacement],
                       dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A random-weight model holding only this rank's experts.

    Weights ~ N(0, 0.02) (norms 1, biases 0), each parameter from its own seeded generator, so
    replicated weights are identical on every rank and an expert's replicas are identical copies.
    """
    from moekv.models.registry import model_class

    model = model_class(arch.architecture)(arch, dtype=dtype, device="meta")
    for block in moe_blocks(model):
        block.experts = ExpertParallelExperts(runtime, placements[block.layer_idx], block.layer_idx,
                                              arch.hidden_size, arch.expert_intermediate_size, arch.top_k,
                                              dtype, "meta")
    unknown = {name for name, _ in model.named_buffers() if not name.endswith(
        ("replica_table", "replica_count", "slot_rank", "slot_local", "route_counters"))} - _KNOWN_BUFFERS
    if unknown:   # a buffer computed at construction would be lost by to_empty below
        raise RuntimeError(f"build_random_model does not know how to rebuild buffers {sorted(unknown)}")
    model = model.to_empty(device=device)
    model.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, device)
    model.expert_load.zero_()
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    expert_weights = set()
    with torch.no_grad():
        for block in moe_blocks(model):
            block.route_counters.zero_()                              # the fused routing's counters start at 0
            experts = block.experts
            experts.set_placement(placements[block.layer_idx])        # buffers were emptied by to_empty
            expert_weights.update((id(experts.w_gate_up), id(experts.w_down)))
            for slot, expert in enumerate(experts.local_experts):
                generator = torch.Generator(device=device).manual_seed(_seed(seed, block.layer_idx, expert))
                experts.w_gate_up[slot].normal_(0.0, _INIT_STD, generator=generator)
                experts.w_down[slot].normal_(0.0, _INIT_STD, generator=generator)
            runtime.register(experts)
        for name, param in model.named_parameters():
            if id(param) in expert_weights:
                continue
            if id(param) in norm_weights:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, _INIT_STD, generator=torch.Generator(device=device).manual_seed(_seed(seed, name)))
    return model.eval()


def move_expert_weights(experts: ExpertParallelExperts, new: ExpertPlacement) -> int:
    """Rearrange one layer's slots on every rank to `new` (collective); returns experts broadcast."""
    old = experts.placement
    runtime = experts.runtime
    rank = runtime.rank
    gained = sorted({e for r in range(new.num_ranks) for e in new.rank_experts[r] if e not in old.rank_experts[r]})
    mine_old, mine_new = old.rank_experts[rank], new.rank_experts[rank]
    w_gate_up, w_down = experts.w_gate_up, experts.w_down
    received: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for expert in gained:
            owner = old.ranks_of(expert)[0]
            flat = torch.empty(_expert_numel(experts), dtype=w_gate_up.dtype, device=w_gate_up.device)
            if rank == owner:
                slot = mine_old.index(expert)
                flat.copy_(torch.cat([w_gate_up[slot].reshape(-1), w_down[slot].reshape(-1)]))
            dist.broadcast(flat, src=owner, group=runtime.group.device_group)   # the EP group is the world
            if expert in mine_new and expert not in mine_old:
                gate_up_numel = w_gate_up.shape[1] * w_gate_up.shape[2]
                received[expert] = (flat[:gate_up_numel].view(w_gate_up.shape[1:]),
                                    flat[gate_up_numel:].view(w_down.shape[1:]))
        if mine_new:
            new_gate_up = torch.stack([w_gate_up[mine_old.index(e)] if e in mine_old else received[e][0]
                                       for e in mine_new])                              # [S_local, 2I, H]
            new_down = torch.stack([w_down[mine_old.index(e)] if e in mine_old else received[e][1]
                                    for e in mine_new])                                 # [S_local, H, I]
            w_gate_up.copy_(new_gate_up)
            w_down.copy_(new_down)
    experts.set_placement(new)
    return len(gained)


def _expert_numel(experts: ExpertParallelExperts) -> int:
    """Elements of one expert's weights, for a rank that holds no slot (shapes from the parameters)."""
    _, two_inter, hidden = experts.w_gate_up.shape
    return two_inter * hidden + hidden * (two_inter // 2)


@dataclass(frozen=True)
class LayerRebalance:
    """What a rebalance did to one MoE layer (imbalance = max / mean per-rank load over the recorded load)."""

    layer: int
    imbalance_before: float
    imbalance_after: float
    experts_moved: int
    placement: ExpertPlacement


def rebalance(model: torch.nn.Module, runtime: ExpertParallelRuntime, min_gain: float = 0.0,
              reset_load: bool = True) -> list[LayerRebalance]:
    """Recompute every MoE layer's placement from the load recorded on all ranks; move the weights.

    A collective: every rank calls it at the same point (between steps). The per-expert load
    `model.expert_load [L, E]` is summed over ranks; a layer is re-placed only if its imbalance
    drops by more than `min_gain`. The load counters restart afterwards (reset_load).
    """
    load = model.expert_load.clone()                                          # [L, E] this rank's routing
    dist.all_reduce(load, group=runtime.group.device_group)                   # summed over ranks
    load = load.cpu().tolist()
    reports = []
    for experts in runtime.layers:
        layer_load = load[experts.layer_idx]
        current = experts.placement
        proposed = balance(layer_load, runtime.world_size, runtime.num_redundant, current)
        before, after = current.imbalance(layer_load), proposed.imbalance(layer_load)
        moved = 0
        if proposed != current and after < before - min_gain:
            moved = move_expert_weights(experts, proposed)
        else:
            after = before
        reports.append(LayerRebalance(experts.layer_idx, before, after, moved, experts.placement))
    if reset_load:
        model.reset_expert_load()
    return reports
