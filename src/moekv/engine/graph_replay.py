"""Running one CUDA-graph decode step (the per-step half of the model runner's graph path): which steps go
through a bucket, and a step's launch and read-back.

A synchronous graph step (`_execute_graph`) fills the bucket's host buffer, lets the cache write its step rows
(`begin_step`), copies it all to the device in one transfer, runs the host half of the routing hooks, replays
the graph and reads the status row back: the step's one host read. An overlapped step (`launch_graph`, then
`collect_graph` one engine step later: engine/overlap.py) does the same launch, draws non-greedy tokens
eagerly on the device, copies the status row to a pinned host buffer (`CudaGraphSteps.enable_token_feed`)
and returns without waiting; its read-back waits on that copy's event, by then normally long done, while the
next step runs. Set-up and capture are in engine/cuda_graphs.py.

`GraphReplay` is mixed into `engine.model_runner.ModelRunner` together with `CudaGraphSteps`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moekv.engine.graph_buckets import GraphBucket
from moekv.engine.step_result import StepResult
from moekv.scheduler.output import SchedulerOutput


@dataclass
class GraphStep:
    """A launched graph decode step, until its read-back (`collect_graph`)."""

    bucket: GraphBucket
    count: int                              # real rows (the rest of the bucket is padding)
    logits: torch.Tensor                    # [Bb, V] the bucket's output (valid until its next step)
    host_status: torch.Tensor | None = None   # [3, Bb] overlapped steps: the status row's host copy
    copied: object | None = None            # ... and the CUDA event of that copy (None on the CPU)
    slot: int = -1                          # which of the runner's two host buffers it holds


class GraphReplay:
    """The step half of the graph path (see the module docstring); uses CudaGraphSteps' buckets."""

    def graph_batch(self, sched: SchedulerOutput) -> int | None:
        """The rows this step would run through a bucket: its batch for a decode-only step, 0 for an empty
        one; None when it must run eagerly (graphs off, a prefill chunk, more sequences than the last bucket).
        A collective step's ranks exchange this to agree on `coordinator.graph_bucket`."""
        if self.graph_mode is None:
            return None
        if not sched.chunks:
            return 0
        if len(sched.chunks) > self.buckets[-1] or not all(c.num_new_tokens == 1 and c.sample for c in sched.chunks):
            return None
        return len(sched.chunks)

    def _graphable(self, sched: SchedulerOutput) -> bool:
        if self.coordinator is not None:                 # collective steps: only the agreed decision counts
            return self.graph_mode is not None and bool(sched.chunks) and self.coordinator.graph_bucket is not None
        return bool(self.graph_batch(sched))

    def has_bucket(self, batch: int) -> bool:
        """Whether a step of `batch` rows finds its bucket built (and captured) already: capturing one runs
        padding-only forwards, which an overlapped step must not have run between it and its predecessor."""
        size = next((b for b in self.buckets if b >= batch), None)
        return size is not None and size in self._buckets

    @torch.inference_mode()
    def execute_idle(self) -> None:
        """A collective graph step on a rank without sequences: the agreed bucket with padding rows only,
        so this rank's collectives (inside the replayed graph) match the other ranks'."""
        self._execute_graph(SchedulerOutput())

    def _run_pre_hooks(self, bucket: GraphBucket) -> None:
        """The model's own forward pre-hooks, eagerly, before the replay. The routing runtime's (the expert-load
        window) runs only its host half here: its device half is captured in the graph (`_static_forward`)."""
        hooks = self._graph_hooks()
        skip = hooks.graph_pre_hook if hooks is not None else None
        if self.model._forward_pre_hooks:
            args = (bucket.input_ids, bucket.positions, self.kv_cache, bucket.meta)
            for hook in list(self.model._forward_pre_hooks.values()):
                if skip is None or hook != skip:
                    hook(self.model, args)
        if hooks is not None:
            hooks.begin_graph_step()

    def _execute_graph(self, sched: SchedulerOutput) -> StepResult:
        rows = []
        for chunk in sched.chunks:
            request, position = chunk.request, chunk.start
            rows.append((request.token_ids(position, position + 1)[0], position,
                         self.kv_manager.block_table(request.request_id), request.request_id))
        return self.collect_graph(self._launch(rows))

    def _launch(self, rows: list, feed: list[int] | None = None) -> GraphStep:
        agreed = self.coordinator.graph_bucket if self.coordinator is not None else None
        bucket = self._bucket(max(len(rows), agreed or 0))
        bucket.fill(rows, feed)
        if self._in_flight:      # the step before is not read yet: its plan stays pending in the cache
            self.kv_cache.begin_step(bucket.meta, overlapped=True)
        else:
            self.kv_cache.begin_step(bucket.meta)       # the cache's rows into the bucket's host buffer
        bucket.upload()                                  # the step's one host->device copy
        if rows:
            self._run_pre_hooks(bucket)
        else:
            self.idle_steps += 1
        if bucket.graph is not None:
            bucket.graph.replay()
            logits = bucket.logits
            self.graph_replays += 1
        else:
            logits = self._static_forward(bucket)
        self.graph_steps += 1
        return GraphStep(bucket, len(rows), logits)

    @torch.inference_mode()
    def launch_graph(self, rows: list, feed: list[int] | None = None,
                     sample: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> GraphStep:
        """Launch a graph decode step without waiting for it (overlapped decode, after enable_token_feed).

        rows: (token id, position, block table, request id) per sequence, as GraphBucket.fill takes them;
        feed: per row, the previous graph step's row whose drawn token is this row's input (-1: the row's
        token id); sample: the real rows' logits [S, V] -> their drawn tokens [S] on the device, or None when
        the argmax stands (greedy rows; None for `sample` itself: no draw). At most two steps are launched and
        unread at a time."""
        if self.token_feed is None:
            raise RuntimeError("launch_graph needs the token feed (enable_token_feed)")
        if len(self._in_flight) >= 2:
            raise RuntimeError("two graph steps are launched and unread already")
        step = self._launch(rows, feed)
        bucket, count = step.bucket, step.count
        tokens = sample(step.logits[:count]) if sample is not None and count else None
        if tokens is not None:              # drawn rows replace the argmax: in the feed and in what is read back
            bucket.status[1, :count].copy_(tokens)
            self.token_feed[:count].copy_(tokens)
        step.slot = 1 if self._in_flight and self._in_flight[0].slot == 0 else 0
        views = self._status_views
        key = (step.slot, bucket.size)
        if key not in views:
            views[key] = self._status_host[step.slot][:3 * bucket.size].view(3, bucket.size)
        step.host_status = views[key]
        step.host_status.copy_(bucket.status, non_blocking=True)
        step.copied = self._new_event()
        if step.copied is not None:
            step.copied.record(torch.cuda.current_stream(self.device))
        self._in_flight.append(step)
        return step

    def drop_launched(self) -> None:
        """Forget every launched step not read back (after an error: the next step is planned afresh)."""
        self._in_flight.clear()

    def _new_event(self):
        return torch.cuda.Event() if self.device.type == "cuda" else None

    @torch.inference_mode()
    def collect_graph(self, step: GraphStep) -> StepResult:
        """Read a graph step back and end it in the cache (may raise KVCacheCorruptionError): the synchronous
        step's one host read, or, for a launched step, the wait on its status copy. The result's logits are
        the bucket's: a launched step's may hold a later step's by now (overlapped steps sample at launch)."""
        bucket, count = step.bucket, step.count
        if step.host_status is None:
            finite, greedy, kv_flags = bucket.status.tolist()  # the step's one host read (waits for the forward)
        else:
            if step in self._in_flight:
                self._in_flight.remove(step)
            if step.copied is not None:
                step.copied.synchronize()                      # the step's one wait: its status copy is done
            finite, greedy, kv_flags = step.host_status.tolist()     # host memory
        if bucket.kv_flags:
            self.kv_cache.end_step(bucket.meta, [bool(f) for f in kv_flags])     # no host read of its own
        else:
            self.kv_cache.end_step(bucket.meta)
        return StepResult(logits=step.logits[:count], sample_chunks=list(range(count)),
                          finite=[bool(f) for f in finite[:count]], greedy_tokens=greedy[:count])
