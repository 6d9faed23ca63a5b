"""The engine of one rank under expert parallelism: data-parallel attention, lockstep steps.

Each rank runs its own scheduler and KV pages for its share of the sequences (attention is
local), while every MoE layer is a collective over all ranks. So all ranks step together:

1. schedule locally, then one control collective (`runtime.begin_step`) tells every rank every
   rank's token count for this step;
2. a rank with tokens runs its forward; a rank without joins each MoE layer's collectives with
   0 tokens (`runtime.join_remaining_layers`); when no rank has tokens nobody runs anything;
3. `has_unfinished()` is itself collective (any rank with work), so every rank's loop
   `while engine.has_unfinished(): engine.step()` stops at the same iteration.

Decode steps run through the model runner's CUDA-graph buckets when every rank agrees (the same
control collective carries each rank's `ModelRunner.graph_batch`; see
distributed.expert_parallel.agree_graph_bucket): every rank runs the agreed bucket, a rank without
sequences with padding rows only (`ModelRunner.execute_idle`), so the collectives captured in the
graphs match. A rebalance rewrites the placement tables the graphs read, so it drops them on every
rank at the same point (recaptured on next use).

`generate` runs the offline API's batch: every rank validates every prompt (a bad prompt raises on all
ranks alike), rank r keeps prompts r, r + N, r + 2N, ..., the ranks step in lockstep until no rank has
work, and the outputs are all-gathered so every rank returns the full list in prompt order. Built by
engine.factory.build_engine; for serving, rank 0's engine is driven by a LeaderEngine (engine/leader.py).

A forward that stops early on one rank (non-finite KV detected after the last attention layer)
first catches up on the remaining MoE collectives, then recovers as the base engine does. Any other
exception inside a step cannot be caught up on (the others may be inside any collective of it): it
is reported to every rank (distributed.failure), which stop at once, and this engine refuses
further collective calls with ExpertParallelError.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from moekv.config import EngineConfig
from moekv.distributed import groups
from moekv.distributed.failure import collective_section
from moekv.distributed.expert_parallel import ExpertParallelRuntime
from moekv.distributed.placement import ExpertPlacement
from moekv.distributed.sharding import LayerRebalance, rebalance
from moekv.engine.batch import GenerationOutput, add_all_or_none, collect_outputs
from moekv.engine.engine import Engine
from moekv.scheduler.scheduler import Scheduler
from moekv.scheduler.output import SchedulerOutput

logger = logging.getLogger("moekv.distributed")


class LockstepScheduler(Scheduler):
    """The local scheduler; after each decision, every rank learns every rank's token count."""

    def __init__(self, config, kv_manager, runtime: ExpertParallelRuntime, runner=None):
        super().__init__(config, kv_manager)
        self.runtime = runtime
        self.runner = runner                  # its graph_batch goes with the count (graph steps agreed)
        self.last_token_counts: list[int] | None = None

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        graph_batch = self.runner.graph_batch(out) if self.runner is not None else None
        self.last_token_counts = self.runtime.begin_step(out.num_tokens, graph_batch)
        return out


class LockstepEngine(Engine):
    """An Engine whose steps run in lockstep with the other ranks' (see the module docstring)."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, tokenizer, runtime: ExpertParallelRuntime):
        super().__init__(config, model=model, tokenizer=tokenizer)
        self.runtime = runtime
        if self.runner.coordinator not in (None, runtime):
            raise ValueError("the model's experts do not belong to this expert-parallel runtime")
        self.scheduler = LockstepScheduler(config.scheduler, self.kv_manager, runtime, self.runner)
        groups.before_shutdown(self.runner.reset_graphs)    # captured NCCL work must go before its communicator
        self.rebalance_interval = config.parallel.rebalance_interval
        self.global_steps = 0
        self.last_rebalance: list[LayerRebalance] = []

    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    def has_unfinished(self) -> bool:
        """Collective: True on every rank while any rank has a waiting or running request."""
        with collective_section("has_unfinished"):
            return self.runtime.any_rank(self.scheduler.has_work())

    def has_local_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self):
        with collective_section(f"lockstep step {self.global_steps}"):
            try:
                outputs = super().step()
                counts = self.scheduler.last_token_counts
                if counts is not None and counts[self.rank] == 0 and any(counts):
                    if self.runtime.graph_bucket is not None:
                        self.runner.execute_idle()              # idle in a graph step: the bucket, padding only
                    else:
                        self.runtime.join_remaining_layers()    # idle this step: 0 tokens to every MoE layer
            finally:
                self.runtime.end_step()
                self.scheduler.last_token_counts = None
        self.global_steps += 1
        if self.rebalance_interval and self.global_steps % self.rebalance_interval == 0:
            self.rebalance()
        return outputs

    def _recover_from_corruption(self, sched, exc):
        self.runtime.join_remaining_layers()                # the forward stopped early: catch up first
        return super()._recover_from_corruption(sched, exc)

    # -- batches ----------------------------------------------------------------------------
    def generate(self, prompts: list, sampling_params: list) -> list[GenerationOutput]:
        """The offline batch under expert parallelism (see the module docstring); every rank gets every output."""
        request_ids = add_all_or_none(self, prompts, sampling_params)
        mine = list(range(self.rank, len(prompts), self.world_size))
        for index, group in enumerate(request_ids):          # each prompt's sequences (n, best_of)
            if index % self.world_size != self.rank:
                for request_id in group:
                    self.abort(request_id)
                    self.release(request_id)
        while self.has_unfinished():                  # collective: all ranks leave the loop together
            self.step()
        gathered: list = [None] * self.world_size
        with collective_section("gathering the outputs"):
            local = collect_outputs(self, [prompts[i] for i in mine], [request_ids[i] for i in mine])
            dist.all_gather_object(gathered, list(zip(mine, local)), group=self.runtime.group.cpu_group)
        ordered = sorted((pair for part in gathered for pair in part), key=lambda pair: pair[0])
        return [output for _, output in ordered]

    # -- load balancing -----------------------------------------------------------------------
    def rebalance(self, min_gain: float = 0.0) -> list[LayerRebalance]:
        """Collective: re-place experts from the recorded load and move their weights (between steps)."""
        before = self.placements()
        with collective_section("rebalance"):
            self.last_rebalance = rebalance(self.model, self.runtime, min_gain=min_gain)
        moved = sum(r.experts_moved for r in self.last_rebalance)
        if self.placements() != before:       # the same on every rank (the placements are)
            self.runner.reset_graphs()        # captured graphs read the old placement tables by address
        if self.rank == 0 and self.last_rebalance:
            worst_before = max(r.imbalance_before for r in self.last_rebalance)
            worst_after = max(r.imbalance_after for r in self.last_rebalance)
            logger.info("expert rebalance: %d expert copies moved; worst layer imbalance %.2f -> %.2f",
                        moved, worst_before, worst_after)
        return self.last_rebalance

    def placements(self) -> dict[int, ExpertPlacement]:
        """The current placement of every MoE layer."""
        return {experts.layer_idx: experts.placement for experts in self.runtime.layers}
