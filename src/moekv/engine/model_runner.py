"""Turns a scheduler decision into one forward pass: flat inputs, attention metadata, logits.

This is the only place that builds model inputs; the model itself is single-device and knows
nothing of requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.kvcache.base import AttentionMetadata, KVCache
from moekv.kvcache.manager import KVCacheManager
from moekv.scheduler.output import SchedulerOutput


@dataclass
class StepResult:
    logits: torch.Tensor          # [S, V] float32: one row per chunk that samples, in chunk order
    sample_chunks: list[int]      # indices into SchedulerOutput.chunks of those rows


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, kv_manager: KVCacheManager,
                 device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        self.device = device

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
        hidden = self.model(input_ids, positions, self.kv_cache, meta)          # [T, H]
        logits = self.model.compute_logits(hidden.index_select(0, rows))        # [S, V] float32
        return StepResult(logits=logits, sample_chunks=sample_chunks)
