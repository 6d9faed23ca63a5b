"""Turns a scheduler decision into one forward pass: flat inputs, attention metadata, logits.

This is the only place that builds model inputs; the model itself is single-device and knows
nothing of requests. Eager steps run here (`prepare` + `execute`); decode-only steps go through the
CUDA-graph buckets of engine/cuda_graphs.py (`CudaGraphSteps`: set-up and capture) and engine/graph_replay.py
(`GraphReplay`: a step's launch and read-back), both mixed in, when graphs are enabled.
"""

from __future__ import annotations

import torch

from moekv.core.attention_metadata import AttentionMetadata
from moekv.engine.cuda_graphs import CudaGraphSteps, step_coordinator
from moekv.engine.graph_buckets import GraphBucket
from moekv.engine.graph_replay import GraphReplay
from moekv.engine.step_result import StepResult
from moekv.kvcache.base import KVCache
from moekv.kvcache.manager import KVCacheManager
from moekv.scheduler.output import SchedulerOutput


class ModelRunner(CudaGraphSteps, GraphReplay):
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, kv_manager: KVCacheManager,
                 device: torch.device, max_num_seqs: int = 1, max_model_len: int | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.graph_mode: str | None = None     # None (eager), "cuda" (capture + replay), "static" (eager on buffers)
        self.graph_fallback_reason: str | None = None
        self.scratch_page: int | None = None
        self.buckets: list[int] = []
        self._buckets: dict[int, GraphBucket] = {}
        self._pool = None
        self.graph_steps = 0                   # decode steps that ran through the graph path
        self.graph_replays = 0                 # ... of which replayed a captured graph
        self.idle_steps = 0                    # ... of which had padding rows only (collective steps)
        self.captures = 0
        self.coordinator = step_coordinator(model)
        self.step_hooks = None                 # the engine's RoutingRuntime: its per-step hook split around graphs
        self.token_feed: torch.Tensor | None = None   # overlapped decode (enable_token_feed)
        self._status_host: list[torch.Tensor] = []
        self._status_views: dict[tuple[int, int], torch.Tensor] = {}   # (buffer, bucket size) -> [3, Bb] view
        self._in_flight: list = []             # launched graph steps not read back yet (GraphStep)

    # -- the step -----------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        token_ids: list[int] = []
        positions: list[int] = []
        for chunk in sched.chunks:
            token_ids.extend(chunk.request.token_ids(chunk.start, chunk.end))
            positions.extend(range(chunk.start, chunk.end))
        meta = AttentionMetadata.build(
            query_lens=[c.num_new_tokens for c in sched.chunks],
            context_lens=[c.start for c in sched.chunks],
            block_tables=[self.kv_manager.block_table(c.request.request_id) for c in sched.chunks],
            page_size=self.kv_manager.page_size,
            device=self.device,
            request_ids=[c.request.request_id for c in sched.chunks],
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)   # [T]
        position_ids = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)  # [T]
        return input_ids, position_ids, meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        if self._graphable(sched):
            return self._execute_graph(sched)
        input_ids, positions, meta = self.prepare(sched)
        last_rows, sample_chunks = [], []
        end = 0
        for index, chunk in enumerate(sched.chunks):
            end += chunk.num_new_tokens
            if chunk.sample:
                last_rows.append(end - 1)
                sample_chunks.append(index)
        # Copied like the inputs (torch.tensor(..., device=cuda) would wait for the stream).
        rows = torch.tensor(last_rows, dtype=torch.long).to(self.device, non_blocking=True)   # [S]
        self.kv_cache.begin_step(meta)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)          # [T, H]
        logits = self.model.compute_logits(hidden.index_select(0, rows))        # [S, V] float32
        self.kv_cache.end_step(meta)
        return StepResult(logits=logits, sample_chunks=sample_chunks)
