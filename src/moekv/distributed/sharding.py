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

import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekv.config import ArchConfig
from moekv.core.fp8 import Fp8Weight
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
    for block in moe_blocks(model):
        placement = placements[block.layer_idx]
        full = block.experts
        act_dtype = model.embed_tokens.weight.dtype
        experts = ExpertParallelExperts(runtime, placement, block.layer_idx, arch.hidden_size,
                                        arch.expert_intermediate_size, arch.top_k, act_dtype, device)
        mine = torch.tensor(placement.rank_experts[runtime.rank], dtype=torch.long, device=full.w_gate_up.device)
        with torch.no_grad():
            if getattr(full, "quantized", False):    # FP8 experts: this rank's slots of the codes and block scales
                gate_up, down = full.weights()
                experts.to_fp8(*(Fp8Weight(w.codes.index_select(0, mine), w.scale.index_select(0, mine), w.block)
                                 for w in (gate_up, down)))
            else:
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
    """Rearrange one layer's slots on every rank to `new` (collective); returns experts broadcast.

    A slot is every tensor of `experts.slot_tensors()` (the weights, and the block scales of FP8 experts), sent
    as one byte buffer per expert."""
    old = experts.placement
    runtime = experts.runtime
    rank = runtime.rank
    gained = sorted({e for r in range(new.num_ranks) for e in new.rank_experts[r] if e not in old.rank_experts[r]})
    mine_old, mine_new = old.rank_experts[rank], new.rank_experts[rank]
    tensors = experts.slot_tensors()
    sizes = [math.prod(t.shape[1:]) * t.element_size() for t in tensors]     # bytes of one slot of each tensor
    device = tensors[0].device
    received: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        for expert in gained:
            owner = old.ranks_of(expert)[0]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            if rank == owner:
                slot = mine_old.index(expert)
                flat.copy_(torch.cat([t[slot].reshape(-1).view(torch.uint8) for t in tensors]))
            dist.broadcast(flat, src=owner, group=runtime.group.device_group)   # the EP group is the world
            if expert in mine_new and expert not in mine_old:
                parts = flat.split(sizes)
                received[expert] = [part.clone().view(t.dtype).view(t.shape[1:]) for part, t in zip(parts, tensors)]
        if mine_new:
            for index, tensor in enumerate(tensors):
                tensor.copy_(torch.stack([tensor[mine_old.index(e)] if e in mine_old else received[e][index]
                                          for e in mine_new]))                   # [S_local, ...]
    experts.set_placement(new)
    return len(gained)


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
