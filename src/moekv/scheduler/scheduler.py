"""A first-come-first-served continuous-batching scheduler with chunked prefill and preemption.

Each step:
1. Running requests keep their place: each needs its next chunk (1 token when decoding). If the
   pool has no page for it, the most recently admitted running request is preempted (its pages are
   freed; it goes back to the front of the queue and is recomputed later) until the chunk fits.
2. Waiting requests are admitted in arrival order while the token budget, `max_num_seqs` and the
   free pages allow; a long prompt is split into chunks under the token budget.
With prefix caching (the KV manager holds a PrefixCache), a waiting request starts from its longest
cached prefix of full pages: it is admitted at its first uncached token and its prefill computes only the
rest. Pages are registered once the step that computed them has committed (at the next schedule, or when
the request leaves), so a failed step never publishes a page. A waiting request whose next uncached page
another request completes in this very step waits one step (and then hits it) instead of computing a copy
(in-batch prefix sharing: 64 requests arriving at once with one long prefix prefill it once); it keeps its
place at the front of the queue, and requests behind it that share nothing are admitted meanwhile.
Nothing is ever dropped: a request that can never fit is rejected when it is added (engine). The token
budget covers a decode token for every running sequence: SchedulerConfig rejects max_num_batched_tokens <
max_num_seqs, which would leave the last running sequences waiting while the first ones decode.
"""

from __future__ import annotations

from collections import deque

from moekv.config import SchedulerConfig
from moekv.core.request import Request, RequestStatus
from moekv.kvcache.manager import KVCacheManager
from moekv.scheduler.output import ScheduledChunk, SchedulerOutput


MAX_DEFERRED = 64      # waiting requests one step may hold back for in-batch prefix sharing before it stops looking


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager):
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # per scheduled step not registered yet, oldest first: the requests whose chunk in it fills a page
        self._completing: list[list[Request]] = []

    # -- queue management ---------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its pages (finish or abort)."""
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.cache_computed(request.request_id, request.num_committed_tokens, request.token_ids)
        self.kv.free(request.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the decision -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._register_completed(len(self._completing))   # pages the last step filled can now be found by others
        self._completing.append([])

        pending: set[bytes] = set()         # digests of the full pages this step completes
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            total = request.num_computed_tokens + num_new
            while not self.kv.can_grow(request.request_id, total):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted itself; `running` shrank, index now points past it
            self.kv.grow(request.request_id, total)
            out.chunks.append(ScheduledChunk(request, num_new))
            self._track_pages(request, request.num_computed_tokens, total, pending)
            budget -= num_new
            index += 1

        deferred: list[Request] = []        # wait a step for a page being computed now; keep their place
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]           # holds no pages: new, preempted or recovering
            hits = self.kv.match_prefix(request.request_id, request.num_tokens, request.token_ids)
            start = len(hits) * self.kv.page_size
            num_new = min(request.num_tokens - start, budget)
            total = start + num_new
            if not self.kv.can_admit(request.request_id, total, hits):
                break
            if pending and self.kv.next_uncached_page(request.request_id, len(hits), request.num_tokens,
                                                      request.token_ids) in pending:
                deferred.append(self.waiting.popleft())   # its next page is computed now: hit it next step
                if len(deferred) >= MAX_DEFERRED:
                    break                       # a long queue of sharers: look no further this step
                continue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.kv.admit(request.request_id, hits, total, request.num_tokens)
            request.num_computed_tokens = start
            self._track_pages(request, start, total, pending)
            out.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return out

    def schedule_ahead(self, finishing: set[str]) -> SchedulerOutput | None:
        """Overlapped decode (engine/overlap.py): the next step, decided while the step before it runs and its
        tokens are not read yet. Every running request decodes its next token (the one in flight), except those
        named in `finishing` (they end with the step in flight: max_tokens, max_model_len).

        Returns None, changing nothing, unless this is what `schedule()` would decide once that step is read:
        no request waits (an admission), every running request but `finishing` has exactly one token to compute
        (none is prefilling), and plainly free pages cover every sequence's next token (no preemption, no
        eviction of a cached page). The pages of the step in flight are registered only when a later step is
        scheduled (it may still fail); the in-batch sharing digests are not needed (nothing waits)."""
        if self.waiting:
            return None
        decoding = [r for r in self.running if r.request_id not in finishing]
        if not decoding or len(decoding) > self.config.max_num_batched_tokens:
            return None
        if any(r.num_tokens - r.num_computed_tokens != 1 for r in decoding):
            return None
        needed = sum(self.kv.num_new_pages(r.request_id, r.num_computed_tokens + 1) for r in decoding)
        tails = sum(self.kv.needs_tail(r.request_id, r.num_computed_tokens + 1) for r in decoding)
        if needed > self.kv.pool.num_unused or tails > self.kv.num_free_tails:
            return None
        self._register_completed(len(self._completing) - 1)     # all but the step in flight
        self._completing.append([])
        out = SchedulerOutput()
        for request in decoding:
            total = request.num_computed_tokens + 1
            self.kv.grow(request.request_id, total)
            out.chunks.append(ScheduledChunk(request, 1))
            if self.kv.prefix_cache is not None and total % self.kv.page_size == 0:
                self._completing[-1].append(request)
        return out

    def _register_completed(self, count: int) -> None:
        """Register the pages the oldest `count` scheduled steps filled (those steps have been read)."""
        done, self._completing = self._completing[:max(count, 0)], self._completing[max(count, 0):]
        for request in (r for step in done for r in step):
            self.kv.cache_computed(request.request_id, request.num_committed_tokens, request.token_ids)

    def _track_pages(self, request: Request, start: int, end: int, pending: set[bytes]) -> None:
        """A chunk [start, end) that fills pages (prefix caching): register them after the step and note
        their digests for in-batch sharing. Most decode chunks fill none and cost one division."""
        page_size = self.kv.page_size
        if self.kv.prefix_cache is None or end // page_size == start // page_size:
            return
        self._completing[-1].append(request)
        pending.update(self.kv.pages_computing(request.request_id, start, end, request.token_ids))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.cache_computed(request.request_id, request.num_committed_tokens, request.token_ids)
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        out.chunks = [c for c in out.chunks if c.request is not request]
