"""Rank-side machinery for `moekv serve --expert-parallel-size N`: one HTTP server, N lockstep engines.

    torchrun --nproc-per-node N -m moekv serve --expert-parallel-size N ...

Rank 0 runs the server; its AsyncEngine drives a `LeaderEngine`, which behaves like a plain Engine
(add_request / abort / release / step / has_unfinished / requests). Ranks 1..N-1 run
`follower_loop`. Every step, over the gloo control group:

1. the leader broadcasts a `StepCommand`: the requests it assigned to each rank since the last
   step (token ids, sampling params; the least-busy rank gets each new request) and aborts;
2. every rank adds / aborts its own, then all run one lockstep step (engine/lockstep.py);
3. the followers gather their step's RequestOutputs to the leader, which mirrors them into
   Request objects (`requests`), so the server streams remote requests exactly like local ones.

The leader validates and tokenizes every prompt itself (errors reach the client before anything
is sent). Scheduler and KV statistics a server reads from the engine (num_running, kv usage, ...)
are rank 0's own; token counters include the other ranks' requests. Wiring (in entrypoints/openai/cli.py):

    engine = build_serving_engine(config)   # LeaderEngine on rank 0; ranks > 0 serve steps until shutdown
    if engine is None:
        return 0
    ... AsyncEngine(engine, ...) as for a plain Engine; on shutdown: engine.stop_followers()

(engine.factory.build_serving_engine wraps rank 0's LockstepEngine in a LeaderEngine and runs
`follower_loop` on the other ranks.)

Failures: an exception on any rank inside the step protocol (the leader's step, a follower's loop)
is reported to every rank (distributed.failure); the others end at once with its error (under
torchrun the agent then stops the job), and the failed leader's engine refuses further steps with
ExpertParallelError instead of waiting for followers that are gone.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

from moekv.core.request import Request, RequestOutput
from moekv.distributed.failure import collective_section, failed
from moekv.engine.lockstep import LockstepEngine
from moekv.sampling import SamplingParams


@dataclass
class StepCommand:
    """What the leader tells every rank before a step."""

    adds: list[tuple[str, list[int], SamplingParams, int]] = field(default_factory=list)  # (id, tokens, params, rank)
    aborts: list[tuple[str, int]] = field(default_factory=list)                            # (id, rank)
    stop: bool = False


class _Requests(Mapping):
    """The leader's local requests and its mirrors of remote ones, as one read-only mapping."""

    def __init__(self, local: dict, mirrors: dict):
        self.local, self.mirrors = local, mirrors

    def __getitem__(self, request_id):
        return self.local[request_id] if request_id in self.local else self.mirrors[request_id]

    def __iter__(self):
        yield from self.local
        yield from self.mirrors

    def __len__(self):
        return len(self.local) + len(self.mirrors)


class LeaderEngine:
    """Rank 0's Engine stand-in for the server; anything not defined here is the local engine's."""

    def __init__(self, engine: LockstepEngine):
        self.engine = engine
        self.mirrors: dict[str, Request] = {}
        self.owner: dict[str, int] = {}
        self.requests = _Requests(engine.requests, self.mirrors)
        self._command = StepCommand()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _busy(self, rank: int) -> int:
        if rank == 0:
            return len(self.engine.scheduler.running) + len(self.engine.scheduler.waiting)
        return sum(1 for rid, r in self.owner.items() if r == rank and not self.mirrors[rid].status.is_finished)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> str:
        """Validate on the leader (InvalidRequestError as for a plain Engine), then keep or assign it."""
        request_id = self.engine.add_request(prompt, params, request_id)
        if request_id in self.mirrors:
            raise RuntimeError(f"request id {request_id!r} is already in use")   # ids are unique per server
        rank = min(range(self.engine.world_size), key=lambda r: (self._busy(r), r))
        if rank != 0:
            request = self.engine.requests.pop(request_id)
            self.engine.scheduler.remove(request)
            self.mirrors[request_id] = request
            self.owner[request_id] = rank
            self._command.adds.append((request_id, request.prompt_token_ids, params, rank))
        return request_id

    def abort(self, request_id: str) -> bool:
        mirror = self.mirrors.get(request_id)
        if mirror is None:
            return self.engine.abort(request_id)
        if mirror.status.is_finished:
            return False
        mirror.finish("abort")
        self._command.aborts.append((request_id, self.owner[request_id]))
        return True

    def release(self, request_id: str) -> None:
        mirror = self.mirrors.get(request_id)
        if mirror is None:
            self.engine.release(request_id)
        elif mirror.status.is_finished:
            del self.mirrors[request_id]
            del self.owner[request_id]

    def has_unfinished(self) -> bool:
        """Local knowledge only (no collective): the leader knows every request it handed out."""
        return (self.engine.has_local_work() or bool(self._command.adds or self._command.aborts)
                or any(not m.status.is_finished for m in self.mirrors.values()))

    def step(self) -> list[RequestOutput]:
        command, self._command = self._command, StepCommand()
        group = self.engine.runtime.group.cpu_group
        gathered: list = [None] * self.engine.world_size
        with collective_section("the leader's step"):
            dist.broadcast_object_list([command], src=0, group=group)
            outputs = self.engine.step()
            dist.gather_object([], gathered, dst=0, group=group)
        now = time.monotonic()
        for rank_outputs in gathered[1:]:
            for out in rank_outputs:
                if self._mirror(out, now):
                    outputs.append(out)
        return outputs

    def _mirror(self, out: RequestOutput, now: float) -> bool:
        request = self.mirrors.get(out.request_id)
        if request is None or (request.status.is_finished and request.finish_reason == "abort"):
            return False                         # released, or aborted here before the rank heard of it
        if out.new_token_ids and request.first_token_time is None:
            self.engine.counters["prompt_tokens"] += request.num_prompt_tokens
        for token, logprobs in zip(out.new_token_ids, out.new_logprobs or [None] * len(out.new_token_ids)):
            self.engine.record_token(request, token, logprobs, now)     # what the owning rank's engine did
        request.last_token_time = now
        request.cumulative_logprob = out.cumulative_logprob          # best_of > n ranks by it
        if out.finished:
            if out.text != request.detokenizer.text:
                request.stop_text_end = len(out.text)
            request.finish(out.finish_reason, out.error)
        return True

    def stop_followers(self) -> None:
        """Tell ranks > 0 to leave follower_loop (call once, when the server shuts down; a no-op after
        a failure: the followers have stopped already)."""
        if failed():
            return
        with collective_section("stopping the followers"):
            dist.broadcast_object_list([StepCommand(stop=True)], src=0, group=self.engine.runtime.group.cpu_group)


def follower_loop(engine: LockstepEngine) -> None:
    """Ranks > 0: apply the leader's commands and step with it until it says stop."""
    group = engine.runtime.group.cpu_group
    with collective_section(f"the follower loop of rank {engine.rank}"):
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=group)
            command: StepCommand = box[0]
            if command.stop:
                return
            for request_id, token_ids, params, rank in command.adds:
                if rank == engine.rank:
                    engine.add_request(token_ids, params, request_id)
            for request_id, rank in command.aborts:
                if rank == engine.rank:
                    engine.abort(request_id)
                    engine.release(request_id)
            outputs = engine.step()
            for out in outputs:
                if out.finished:
                    engine.release(out.request_id)
            dist.gather_object(outputs, None, dst=0, group=group)
