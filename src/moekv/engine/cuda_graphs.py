"""CUDA-graph decode steps of the model runner: eligibility, capture (alone or collectively), the captured forward.

Decode-only steps (every chunk one new token, every chunk samples) can run as a replayed CUDA graph:
one graph per batch-size bucket (1, 2, 4, ..., max_num_seqs; static buffers in engine/graph_buckets.py),
captured lazily on the bucket's first use after an eager warm-up run, all graphs sharing one memory pool.
A step fills the bucket's host buffer (the cache's begin_step adds its own step rows there), copies it to
the device in one transfer and replays. Padding rows'
keys/values land in a scratch page the runner holds for its lifetime. The captured forward also writes a
small status buffer [3, Bb] (each row's logits usable, its argmax, the cache's non-finite KV flag from
`KVCache.step_flags`), which the step reads back in its one host read: the engine then needs no check of
its own and, for greedy requests without logprobs, no sampling op. Sampling otherwise stays eager on the
real rows. The captured forward starts with the device half of the routing runtime's per-step hook (the
expert-load window's fold); only its host half (a step count) runs before the replay. With overlapped decode
(`enable_token_feed`) it also reads its tokens from, and writes its argmax to, a device feed.
See docs/architecture.md, "CUDA-graph decode step".

Collective steps (expert parallelism): when the model's experts name a `step_coordinator`
(distributed.expert_parallel.ExpertParallelRuntime), every rank must run the same bucket in the same
step, because every MoE layer is a collective. The ranks agree before the forward (the coordinator's
`graph_bucket`, from each rank's `graph_batch`); a rank without sequences replays the agreed bucket
with padding rows only (`execute_idle`), and a capture that fails on any rank makes every rank fall
back to eager at the same step (`coordinator.any_rank`, outside any graph). See docs/expert-parallel.md.

`CudaGraphSteps` is the graph half of `engine.model_runner.ModelRunner` (which sets the attributes it
uses: model, kv_cache, kv_manager, device, max_num_seqs, max_model_len and the graph state); a step's launch,
replay and read-back (synchronous or overlapped) are `engine.graph_replay.GraphReplay`, mixed in beside it.
"""

from __future__ import annotations

import logging
import traceback
from contextlib import nullcontext
from typing import ContextManager, Protocol

import torch

from moekv import envs
from moekv.core.attention_metadata import AttentionMetadata
from moekv.engine.graph_buckets import GraphBucket, graph_buckets
from moekv.engine.step_result import usable_rows

logger = logging.getLogger("moekv.engine")


class StepCoordinator(Protocol):
    """What a runner needs when its decode steps are collectives across ranks (expert parallelism).

    The experts expose it as `step_coordinator`; the runner finds it in the model. Every rank's runner must
    have the same buckets (same max_num_seqs)."""

    graph_bucket: int | None        # this step's bucket, agreed by all ranks before the forward (None: eager)

    def graph_ineligibility(self) -> str | None: ...                       # why no step can be a graph step
    def configure_graphs(self, buckets: list[int], capture: bool) -> None: ...   # [] when graphs are off
    def static_forward(self, meta: AttentionMetadata) -> ContextManager: ...     # around every static forward
    def any_rank(self, flag: bool) -> bool: ...                            # collective, on the host


def step_coordinator(model: torch.nn.Module) -> StepCoordinator | None:
    """The coordinator the model's experts name (None: the steps are this process's alone)."""
    found = None
    for module in model.modules():
        coordinator = getattr(module, "step_coordinator", None)
        if coordinator is not None:
            if found is not None and coordinator is not found:
                raise ValueError("the model's experts name more than one step coordinator")
            found = coordinator
    return found


def _first_cause(exc: BaseException) -> str:
    """The innermost exception a capture error chains to (torch's capture_end error hides the first one)."""
    def parent(e: BaseException):
        return e.__cause__ or (None if e.__suppress_context__ else e.__context__)

    seen, cause = set(), exc
    while parent(cause) is not None and id(cause) not in seen:
        seen.add(id(cause))
        cause = parent(cause)
    if cause is exc:
        return ""
    frames = traceback.extract_tb(cause.__traceback__)[-6:]
    where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.line}" for f in reversed(frames))
    return f"; first error: {type(cause).__name__}: {str(cause)[:300]} at {where}"


class CudaGraphSteps:
    """Decode steps through per-bucket static buffers: replayed CUDA graphs, or (tests, any device) the same
    static-buffer code run eagerly. Mixed into ModelRunner."""

    # -- CUDA-graph set-up --------------------------------------------------------------------
    def graph_ineligibility(self, hooks_safe: bool = True) -> str | None:
        """Why decode steps of this model and cache cannot be captured (None: they can)."""
        from moekv.layers.experts import Experts, LocalExperts

        if not getattr(type(self.kv_cache), "supports_graph_decode", False):
            return f"the {type(self.kv_cache).__name__} KV cache does not support graph decode"
        if not hasattr(self.model, "compute_logits") or not hasattr(self.model, "layers"):
            return "the model is not a moekv decoder"
        for module in self.model.modules():
            if isinstance(module, Experts) and type(module) is not LocalExperts \
                    and not getattr(module, "graph_capturable", False):     # device-staged offload: capturable
                if self.coordinator is not None and getattr(module, "step_coordinator", None) is self.coordinator:
                    continue            # expert parallelism: collectives inside the graph, steps agreed
                return f"experts are {type(module).__name__} (offloaded), not LocalExperts"
        if self.coordinator is not None:
            reason = self.coordinator.graph_ineligibility()
            if reason is not None:
                return reason
        if not hooks_safe:
            return "routing hooks (expert prefetch) synchronise or use side streams"
        if self.model._forward_hooks or self.model._forward_pre_hooks_with_kwargs or \
                getattr(self.model, "_forward_hooks_with_kwargs", None):
            return "the model has forward hooks on its top module"
        if self.max_model_len is None:
            return "no max_model_len"
        return None

    def enable_graphs(self, capture: bool = True, hooks_safe: bool = True) -> bool:
        """Run decode-only steps through per-bucket static buffers: replayed CUDA graphs (capture=True,
        CUDA only), or the same static-buffer code run eagerly (capture=False: tests, any device).
        Reserves the scratch page. Returns False (and stays eager) when the model or cache cannot."""
        mode = "cuda" if capture else "static"
        if self.scratch_page is not None and self.graph_mode == mode:
            return True                 # already enabled: keep the scratch page, buffers and graphs
        reason = self.graph_ineligibility(hooks_safe)
        if reason is None and capture and self.device.type != "cuda":
            reason = "CUDA graphs need a CUDA device"
        if reason is not None:
            self.graph_fallback_reason = reason
            logger.info("decode steps run eagerly: %s", reason)
            return False
        page_size = self.kv_manager.page_size
        if self.kv_manager.pool.num_pages * page_size >= 2 ** 31:
            self.graph_fallback_reason = "the KV pool has more than 2**31 slots"
            return False
        if self.scratch_page is None:
            self.scratch_page = self.kv_manager.pool.allocate(1)[0]      # held for the runner's lifetime
        self.buckets = graph_buckets(self.max_num_seqs)
        self._buckets = {}              # another mode (static <-> cuda): buckets are rebuilt on first use
        self.graph_mode = mode
        self.graph_fallback_reason = None
        self.kv_cache.reserve_graph_decode(self.buckets[-1])
        if capture and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self.coordinator is not None:
            self.coordinator.configure_graphs(self.buckets, capture)
        return True

    def reset_graphs(self) -> None:
        """Forget every bucket (static buffers and captured graphs): rebuilt, and captured again, on first
        use. After something a graph captured by address was replaced (an expert rebalance rewrites the
        placement tables). With a coordinator, every rank must call it at the same point."""
        self._buckets = {}

    @property
    def reserved_pages(self) -> int:
        return 0 if self.scratch_page is None else 1

    def _num_splits(self, size: int) -> int | None:
        """The bucket's fixed split-K count, as the cache format plans it for its decode kernels."""
        return self.kv_cache.graph_decode_splits(size, self.max_model_len)

    def _bucket(self, batch: int) -> GraphBucket:
        size = next(b for b in self.buckets if b >= batch)
        bucket = self._buckets.get(size)
        if bucket is None:
            max_pages = -(-self.max_model_len // self.kv_manager.page_size)
            bucket = GraphBucket(size, max_pages, self.scratch_page, self.kv_manager.page_size,
                                 self._num_splits(size), self.device, self.kv_cache.graph_step_bytes(size),
                                 feed_base=self.buckets[-1])
            if bucket.step_buffers is not None:      # the cache's step rows ride in the bucket's one copy
                self.kv_cache.bind_graph_step(bucket.meta, *bucket.step_buffers)
            bucket.fill([])
            if self.graph_mode == "cuda":
                if self.coordinator is not None:
                    self._capture_collectively(bucket)
                else:
                    try:
                        with self._on_device():
                            self._capture(bucket)
                    except Exception as exc:  # noqa: BLE001 - a capture that fails must not fail every later step
                        self._give_up_graphs(bucket, f"CUDA graph capture failed ({type(exc).__name__}: {exc})"
                                                     f"{_first_cause(exc)}")
            self._buckets[size] = bucket
        return bucket

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def _give_up_graphs(self, bucket: GraphBucket, why: str) -> None:
        """Eager from now on (this bucket's step runs its static forward eagerly)."""
        bucket.graph, bucket.logits = None, None
        self.graph_mode = None
        self.graph_fallback_reason = f"{why}; eager from now on"
        logger.warning("moekv: %s", self.graph_fallback_reason)
        if self.coordinator is not None:
            self.coordinator.configure_graphs([], False)

    def _capture(self, bucket: GraphBucket) -> None:
        """Warm up eagerly on a side stream (Triton compiles, cuBLAS picks its kernels), then capture."""
        self._warm_up(bucket)
        bucket.graph, bucket.logits = self._record(bucket)
        self.captures += 1

    def _capture_collectively(self, bucket: GraphBucket) -> None:
        """A collective step's capture: every rank is here in the same step (the bucket was agreed). The
        warm-up runs the step's collectives eagerly, which also initialises the communicator before the
        capture; an error there is a failed step like any eager one (distributed.failure stops every rank).
        The capture itself launches nothing, so a rank whose capture fails cannot leave the others inside a
        collective: afterwards all ranks agree (on the host, outside any graph) and, if any failed, all fall
        back to eager together, this step included."""
        with self._on_device():
            self._warm_up(bucket)
        error = None
        try:
            with self._on_device():
                graph, logits = self._record(bucket)
        except Exception as exc:  # noqa: BLE001 - agreed below
            error = f"CUDA graph capture failed ({type(exc).__name__}: {exc}){_first_cause(exc)}"
            logger.warning("moekv: rank capture failure:\n%s", "".join(traceback.format_exception(exc)))
        if self.coordinator.any_rank(error is not None):
            self._give_up_graphs(bucket, error or "CUDA graph capture failed on another rank")
            return
        bucket.graph, bucket.logits = graph, logits
        self.captures += 1

    def _warm_up(self, bucket: GraphBucket) -> None:
        """Two eager padding-only forwards over the bucket's buffers (on a side stream on CUDA)."""
        meta = bucket.meta
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with (torch.cuda.stream(stream) if cuda else nullcontext()), torch.inference_mode():
            for _ in range(2):
                bucket.fill([])                      # waits for the previous copy out of the host buffer
                self.kv_cache.begin_step(meta)       # may write the cache's rows into the bucket's host buffer
                bucket.upload()
                self._static_forward(bucket, step_hooks=False)   # a padding-only run is no step of the model's
                self.kv_cache.end_step(meta)
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def _record(self, bucket: GraphBucket):
        """Capture the bucket's static forward -> (graph, its logits tensor)."""
        meta = bucket.meta
        graph = torch.cuda.CUDAGraph()
        self.kv_cache.begin_step(meta)
        # thread_local: the server's /metrics thread may read device tensors while a bucket is captured (and
        # NCCL's watchdog thread queries its events)
        mode = envs.capture_error_mode() or "thread_local"          # MOEKV_CAPTURE_ERROR_MODE overrides
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode=mode):
            logits = self._static_forward(bucket)
        self.kv_cache.end_step(meta)
        torch.cuda.synchronize(self.device)
        logger.info("captured the decode CUDA graph for batch bucket %d (%s split-K splits)", bucket.size,
                    meta.fixed_num_splits)
        return graph, logits

    def _static_forward(self, bucket: GraphBucket, step_hooks: bool = True) -> torch.Tensor:
        """The decode forward over a bucket's static buffers -> logits [Bb, V] float32. Device work
        only: no host reads, no host-dependent branches (this is what a graph captures). With `step_hooks`
        it starts with the device half of the routing runtime's per-step hook (the expert-load window's fold,
        `RoutingRuntime.graph_step_device`), so no launch of it is left outside the graph."""
        views, meta = bucket.views, bucket.meta
        feed = self.token_feed
        if feed is None:
            bucket.input_ids.copy_(views["input_ids"])                              # int32 -> int64 [Bb]
        else:       # overlapped decode: a row whose token the previous step drew reads it from the feed
            base = feed.shape[0] // 2
            feed[base:base + bucket.size].copy_(views["input_ids"])                  # the uploaded tokens
            torch.index_select(feed, 0, views["feed_index"], out=bucket.input_ids)  # [Bb]
        bucket.positions.copy_(views["positions"])
        meta.slot_mapping.copy_(views["slot_mapping"])
        meta.token_valid.copy_(views["token_valid"])
        hooks = self._graph_hooks() if step_hooks else None
        if hooks is not None:       # an idle rank's padding-only collective step leaves the load window as it is
            hooks.graph_step_device(meta.token_valid[:1] if self.coordinator is not None else None)
        # collective steps: the experts exchange all Bb rows, padding rows masked by token_valid
        with self.coordinator.static_forward(meta) if self.coordinator is not None else nullcontext():
            hidden = self.model.forward(bucket.input_ids, bucket.positions, self.kv_cache, meta)   # [Bb, H]
        logits = self.model.compute_logits(hidden)                                   # [Bb, V]
        bucket.status[0].copy_(usable_rows(logits))
        bucket.status[1].copy_(logits.argmax(dim=-1))
        if feed is not None:
            feed[:bucket.size].copy_(bucket.status[1])       # the next step's tokens, without the host
        flags = self.kv_cache.step_flags(meta)                                       # [Bb] bool or None
        bucket.kv_flags = flags is not None
        if flags is not None:
            bucket.status[2].copy_(flags)
        return logits

    def _graph_hooks(self):
        """The step hooks (engine: the RoutingRuntime) whose pre-hook is on the model now, else None."""
        hooks = self.step_hooks
        if hooks is None:
            return None
        pre_hook = hooks.graph_pre_hook
        return hooks if any(h == pre_hook for h in self.model._forward_pre_hooks.values()) else None

    def enable_token_feed(self) -> bool:
        """Overlapped decode (DeviceConfig.overlap_decode, engine/overlap.py): every graph step also writes its
        argmax to a device feed [2 * last bucket] int64 that the next step's graph reads its tokens from
        (`GraphBucket.fill(rows, feed)`: the previous step's row of each sequence), and a launched step's status
        row is copied to one of two pinned host buffers to be read a step later. Buckets captured before are
        dropped (captured again with the feed). False when graph steps are off."""
        if self.graph_mode is None:
            return False
        if self.token_feed is None:
            size, pin = self.buckets[-1], self.device.type == "cuda"
            self.token_feed = torch.zeros(2 * size, dtype=torch.int64, device=self.device)
            self._status_host = [torch.zeros(3 * size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
            self._buckets = {}
        return True
