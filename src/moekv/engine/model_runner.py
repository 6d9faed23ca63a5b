"""Turns a scheduler decision into one forward pass: flat inputs, attention metadata, logits.

This is the only place that builds model inputs; the model itself is single-device and knows
nothing of requests.

Decode-only steps (every chunk one new token, every chunk samples) can run as a replayed CUDA
graph: one graph per batch-size bucket (1, 2, 4, ..., max_num_seqs), captured lazily on the
bucket's first use after an eager warm-up run, all graphs sharing one memory pool. A bucket owns
static buffers (one packed int32 device buffer holding the token ids, positions, context and
sequence lengths, slot mapping, a token-valid mask and the block tables [Bb, max_pages]; a static
AttentionMetadata whose device tensors are views of it, with `fixed_num_splits` set so the decode
kernels size their split-K work on the device; the output logits [Bb, V]). A step fills one host
buffer, copies it to the device in one transfer and replays. Rows past the step's batch are dummy
sequences (one token at position 0, context 0, block table [scratch page], request id "") whose
keys/values land in a page the runner holds for its lifetime. The captured forward also writes a small
status buffer [3, Bb] (each row's logits usable, its argmax, the cache's non-finite KV flag from
`KVCache.step_flags`), which the step reads back in its one host read: the engine then needs no check of
its own and, for greedy requests without logprobs, no sampling op. Sampling otherwise stays eager on the
real rows. See docs/architecture.md, "CUDA-graph decode step".

Collective steps (expert parallelism): when the model's experts name a `step_coordinator`
(distributed.expert_parallel.ExpertParallelRuntime), every rank must run the same bucket in the same
step, because every MoE layer is a collective. The ranks agree before the forward (the coordinator's
`graph_bucket`, from each rank's `graph_batch`); a rank without sequences replays the agreed bucket
with padding rows only (`execute_idle`), and a capture that fails on any rank makes every rank fall
back to eager at the same step (`coordinator.any_rank`, outside any graph). See docs/expert-parallel.md.
"""

from __future__ import annotations

import logging
import os
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager, Protocol

import torch

from moekv.core.attention_metadata import AttentionMetadata
from moekv.kvcache.base import KVCache
from moekv.kvcache.manager import KVCacheManager
from moekv.scheduler.output import SchedulerOutput

logger = logging.getLogger("moekv.engine")

# Packed int32 fields of a bucket's input buffer, in order; each is [Bb], then block tables [Bb * W].
_FIELDS = ("input_ids", "positions", "context_lens", "seq_lens", "slot_mapping", "token_valid")


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


@dataclass
class StepResult:
    logits: torch.Tensor          # [S, V] float32: one row per chunk that samples, in chunk order
    sample_chunks: list[int]      # indices into SchedulerOutput.chunks of those rows
    # Graph decode steps only (None otherwise), read back with the step's one host read:
    finite: list[bool] | None = None         # [S] the row has no NaN / +inf and a finite value (engine rule)
    greedy_tokens: list[int] | None = None   # [S] argmax of each row (the greedy token)


def usable_rows(logits: torch.Tensor) -> torch.Tensor:
    """[S, V] -> [S] bool: the row holds no NaN and no +inf and something finite (-inf alone is a legal
    mask). Its max says it all: NaN propagates, +inf wins, and it is -inf only when nothing is finite."""
    return torch.isfinite(logits.amax(dim=-1))


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


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a CUDA graph: powers of two below max_num_seqs, then max_num_seqs."""
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return buckets + [max(max_num_seqs, 1)]


def graph_pool_bytes(arch, max_num_seqs: int, dtype: torch.dtype, max_model_len: int = 0,
                     lowbit: bool = False) -> int:
    """A generous estimate of the device memory the shared graph pool holds once every bucket is
    captured: each bucket's logits stay alive, intermediates of the largest bucket are reused; with a
    low-bit cache (`lowbit`) also the v6 decode kernel's outlier-pass buffers of the largest bucket (two fp32
    tiles of the GQA group's width per token of max_model_len: ops/triton/lowbit_decode_fix.py)."""
    element = torch.empty((), dtype=dtype).element_size()
    buckets = graph_buckets(max_num_seqs)
    outputs = sum(b * arch.vocab_size * 4 for b in buckets)
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    per_token = (16 * arch.hidden_size + 4 * qkv + 4 * arch.top_k * max(arch.expert_intermediate_size, 1)) * element \
        + 2 * arch.num_heads * 128 * arch.head_dim * 4 + arch.vocab_size * 4
    passes = 0
    if lowbit:
        from moekv.ops.triton.lowbit_decode_fix import group_width
        width = group_width(max(arch.num_heads // max(arch.num_kv_heads, 1), 1))
        passes = 2 * buckets[-1] * arch.num_kv_heads * (max_model_len + 128) * width * 4
    return outputs + buckets[-1] * per_token + passes + (64 << 20)


class _Bucket:
    """Static buffers (and, when captured, the graph) of one batch-size bucket."""

    def __init__(self, size: int, max_pages: int, scratch_page: int, page_size: int, num_splits: int,
                 device: torch.device):
        self.size = size
        self.max_pages = max_pages
        width = len(_FIELDS) * size + size * max_pages
        pin = device.type == "cuda"
        self.host = torch.zeros(width, dtype=torch.int32, pin_memory=pin)            # [width]
        self.host_np = self.host.numpy()
        self.device_buf = torch.zeros(width, dtype=torch.int32, device=device)       # [width]
        self.copied: torch.cuda.Event | None = None        # the last host->device copy (pinned reuse)
        views = {name: self.device_buf[i * size:(i + 1) * size] for i, name in enumerate(_FIELDS)}
        self.views = views
        tables = self.device_buf[len(_FIELDS) * size:].view(size, max_pages)          # [Bb, W]
        self.meta = AttentionMetadata(
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            context_lens=views["context_lens"], seq_lens=views["seq_lens"], block_tables=tables,
            slot_mapping=torch.zeros(size, dtype=torch.int64, device=device),      # filled in the forward
            query_lens_host=[1] * size, context_lens_host=[0] * size,
            block_tables_host=[[scratch_page]] * size, max_query_len=1, max_seq_len=1,
            request_ids=[""] * size, fixed_num_splits=num_splits,
            token_valid=torch.zeros(size, dtype=torch.int64, device=device))        # filled in the forward
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)      # [Bb]
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)      # [Bb]
        # What the step reads back, in one transfer: [0] logits row usable (no NaN / +inf, something finite),
        # [1] its argmax, [2] the cache's non-finite KV flag (KVCache.step_flags; 0 when it has none)
        self.status = torch.zeros(3, size, dtype=torch.int64, device=device)        # [3, Bb]
        self.kv_flags = False                              # the forward copies the cache's flags into status[2]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None            # [Bb, V] float32, the graph's output


class ModelRunner:
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
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None
        self.graph_steps = 0                   # decode steps that ran through the graph path
        self.graph_replays = 0                 # ... of which replayed a captured graph
        self.idle_steps = 0                    # ... of which had padding rows only (collective steps)
        self.captures = 0
        self.coordinator = step_coordinator(model)

    # -- CUDA-graph set-up --------------------------------------------------------------------
    def graph_ineligibility(self, hooks_safe: bool = True) -> str | None:
        """Why decode steps of this model and cache cannot be captured (None: they can)."""
        from moekv.layers.experts import Experts, LocalExperts

        if not getattr(type(self.kv_cache), "supports_graph_decode", False):
            return f"the {type(self.kv_cache).__name__} KV cache does not support graph decode"
        if not hasattr(self.model, "compute_logits") or not hasattr(self.model, "layers"):
            return "the model is not a moekv decoder"
        for module in self.model.modules():
            if isinstance(module, Experts) and type(module) is not LocalExperts:
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

    def _num_splits(self, size: int) -> int:
        from moekv.ops.triton.split_k import plan_splits

        return plan_splits(size, self.kv_cache.spec.num_kv_heads, self.max_model_len, 64, self.device)[0]

    def _bucket(self, batch: int) -> _Bucket:
        size = next(b for b in self.buckets if b >= batch)
        bucket = self._buckets.get(size)
        if bucket is None:
            max_pages = -(-self.max_model_len // self.kv_manager.page_size)
            bucket = _Bucket(size, max_pages, self.scratch_page, self.kv_manager.page_size,
                             self._num_splits(size), self.device)
            self._fill(bucket, [])
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

    def _give_up_graphs(self, bucket: _Bucket, why: str) -> None:
        """Eager from now on (this bucket's step runs its static forward eagerly)."""
        bucket.graph, bucket.logits = None, None
        self.graph_mode = None
        self.graph_fallback_reason = f"{why}; eager from now on"
        logger.warning("moekv: %s", self.graph_fallback_reason)
        if self.coordinator is not None:
            self.coordinator.configure_graphs([], False)

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up eagerly on a side stream (Triton compiles, cuBLAS picks its kernels), then capture."""
        self._warm_up(bucket)
        bucket.graph, bucket.logits = self._record(bucket)
        self.captures += 1

    def _capture_collectively(self, bucket: _Bucket) -> None:
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

    def _warm_up(self, bucket: _Bucket) -> None:
        """Two eager padding-only forwards over the bucket's buffers (on a side stream on CUDA)."""
        meta = bucket.meta
        self._upload(bucket)
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with (torch.cuda.stream(stream) if cuda else nullcontext()), torch.inference_mode():
            for _ in range(2):
                self.kv_cache.begin_step(meta)
                self._static_forward(bucket)
                self.kv_cache.end_step(meta)
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def _record(self, bucket: _Bucket):
        """Capture the bucket's static forward -> (graph, its logits tensor)."""
        meta = bucket.meta
        graph = torch.cuda.CUDAGraph()
        self.kv_cache.begin_step(meta)
        # thread_local: the server's /metrics thread may read device tensors while a bucket is captured (and
        # NCCL's watchdog thread queries its events)
        mode = os.environ.get("MOEKV_CAPTURE_ERROR_MODE", "thread_local")
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode=mode):
            logits = self._static_forward(bucket)
        self.kv_cache.end_step(meta)
        torch.cuda.synchronize(self.device)
        logger.info("captured the decode CUDA graph for batch bucket %d (%d split-K splits)", bucket.size,
                    meta.fixed_num_splits)
        return graph, logits

    def _static_forward(self, bucket: _Bucket) -> torch.Tensor:
        """The decode forward over a bucket's static buffers -> logits [Bb, V] float32. Device work
        only: no host reads, no host-dependent branches (this is what a graph captures)."""
        views, meta = bucket.views, bucket.meta
        bucket.input_ids.copy_(views["input_ids"])                                  # int32 -> int64 [Bb]
        bucket.positions.copy_(views["positions"])
        meta.slot_mapping.copy_(views["slot_mapping"])
        meta.token_valid.copy_(views["token_valid"])
        # collective steps: the experts exchange all Bb rows, padding rows masked by token_valid
        with self.coordinator.static_forward(meta) if self.coordinator is not None else nullcontext():
            hidden = self.model.forward(bucket.input_ids, bucket.positions, self.kv_cache, meta)   # [Bb, H]
        logits = self.model.compute_logits(hidden)                                   # [Bb, V]
        bucket.status[0].copy_(usable_rows(logits))
        bucket.status[1].copy_(logits.argmax(dim=-1))
        flags = self.kv_cache.step_flags(meta)                                       # [Bb] bool or None
        bucket.kv_flags = flags is not None
        if flags is not None:
            bucket.status[2].copy_(flags)
        return logits

    def _fill(self, bucket: _Bucket, rows: list[tuple[int, int, list[int], str]]) -> None:
        """Write a step's rows (token id, position, block table, request id) into the bucket's host
        buffer and its metadata's host lists; rows past len(rows) are dummy sequences."""
        if bucket.copied is not None:
            bucket.copied.synchronize()              # the previous copy out of this pinned buffer is done
        size, page_size, scratch = bucket.size, self.kv_manager.page_size, self.scratch_page
        host = bucket.host_np
        fields = {name: host[i * size:(i + 1) * size] for i, name in enumerate(_FIELDS)}
        tables = host[len(_FIELDS) * size:].reshape(size, bucket.max_pages)
        context_lens, block_tables, request_ids = [], [], []
        for i in range(size):
            if i < len(rows):
                token, position, table, request_id = rows[i]
                valid = 1
            else:
                token, position, table, request_id, valid = 0, 0, [scratch], "", 0
            fields["input_ids"][i] = token
            fields["positions"][i] = position
            fields["context_lens"][i] = position
            fields["seq_lens"][i] = position + 1
            fields["slot_mapping"][i] = table[position // page_size] * page_size + position % page_size
            fields["token_valid"][i] = valid
            tables[i, :len(table)] = table
            context_lens.append(position)
            block_tables.append(table)
            request_ids.append(request_id)
        meta = bucket.meta
        meta.context_lens_host = context_lens
        meta.block_tables_host = block_tables
        meta.request_ids = request_ids
        meta.max_seq_len = max(context_lens) + 1

    def _upload(self, bucket: _Bucket) -> None:
        """The step's one host->device copy."""
        bucket.device_buf.copy_(bucket.host, non_blocking=True)
        if self.device.type == "cuda":
            bucket.copied = torch.cuda.Event()
            bucket.copied.record(torch.cuda.current_stream(self.device))

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

    @torch.inference_mode()
    def execute_idle(self) -> None:
        """A collective graph step on a rank without sequences: the agreed bucket with padding rows only,
        so this rank's collectives (inside the replayed graph) match the other ranks'."""
        self._execute_graph(SchedulerOutput())

    def _run_pre_hooks(self, bucket: _Bucket) -> None:
        """The model's own forward pre-hooks (the expert-load window) run eagerly, outside the graph."""
        if self.model._forward_pre_hooks:
            args = (bucket.input_ids, bucket.positions, self.kv_cache, bucket.meta)
            for hook in list(self.model._forward_pre_hooks.values()):
                hook(self.model, args)

    def _execute_graph(self, sched: SchedulerOutput) -> StepResult:
        rows = []
        for chunk in sched.chunks:
            request, position = chunk.request, chunk.start
            rows.append((request.token_ids(position, position + 1)[0], position,
                         self.kv_manager.block_table(request.request_id), request.request_id))
        agreed = self.coordinator.graph_bucket if self.coordinator is not None else None
        bucket = self._bucket(max(len(rows), agreed or 0))
        self._fill(bucket, rows)
        self._upload(bucket)
        self.kv_cache.begin_step(bucket.meta)
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
        finite, greedy, kv_flags = bucket.status.tolist()      # the step's one host read (waits for the forward)
        if bucket.kv_flags:
            self.kv_cache.end_step(bucket.meta, [bool(f) for f in kv_flags])     # no host read of its own
        else:
            self.kv_cache.end_step(bucket.meta)
        self.graph_steps += 1
        count = len(rows)
        return StepResult(logits=logits[:count], sample_chunks=list(range(count)),
                          finite=[bool(f) for f in finite[:count]], greedy_tokens=greedy[:count])

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
