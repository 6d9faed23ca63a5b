"""One batch of prompts run to completion (the offline API's unit): queue all or none, step until every
request finishes, collect the outputs in prompt order. `Engine.generate` runs it on one process;
`LockstepEngine.generate` (engine/lockstep.py) runs each rank's share and all-gathers the outputs.

A prompt whose params ask for several sequences (`n`, `best_of`) becomes that many engine requests
(with a seed, sequence j uses seed + j); its output keeps the `n` with the highest cumulative
log-probability when `best_of > n`, else all `n` in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None       # with best_of > n: what ranked the sequences


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


def sequence_params(params) -> list:
    """The params of each engine request one prompt fans out to (seed + j for sequence j)."""
    count = params.num_sequences
    if count == 1:
        return [params]
    return [params if params.seed is None else replace(params, seed=(params.seed + j) % (1 << 64))
            for j in range(count)]


def add_all_or_none(engine, prompts: list, sampling_params: list) -> list[list[str]]:
    """Queue every prompt's sequences, or none: if one is invalid, the ones already queued are taken back.
    Returns each prompt's engine request ids."""
    groups: list[list[str]] = []
    try:
        for prompt, params in zip(prompts, sampling_params):
            group: list[str] = []
            groups.append(group)
            for seq_params in sequence_params(params):
                group.append(engine.add_request(prompt, seq_params))
    except Exception:
        for request_id in (r for group in groups for r in group):
            engine.abort(request_id)
            engine.release(request_id)
        raise
    return groups


def run_batch(engine, prompts: list, sampling_params: list) -> list[GenerationOutput]:
    """Queue the prompts, step the engine until they are all finished, return their outputs in order.
    On an error or Ctrl-C no request of the batch is left behind to run in the next call."""
    groups = add_all_or_none(engine, prompts, sampling_params)
    request_ids = [r for group in groups for r in group]
    pending = set(request_ids)
    try:
        while pending:
            for out in engine.step():
                if out.finished:
                    pending.discard(out.request_id)
            if pending and not engine.has_unfinished():
                raise RuntimeError("engine stopped with requests pending")  # a bug, not a user error
    except BaseException:
        for request_id in request_ids:
            engine.abort(request_id)
            engine.release(request_id)
        raise
    return collect_outputs(engine, prompts, groups)


def collect_outputs(engine, prompts: list, request_ids: list) -> list[GenerationOutput]:
    """The finished requests as GenerationOutputs in prompt order (and released from the engine).
    `request_ids[i]` is prompt i's request id, or the list of its sequences' ids."""
    results = []
    for prompt, group in zip(prompts, request_ids):
        group = [group] if isinstance(group, str) else list(group)
        requests = [engine.requests[r] for r in group]
        params = requests[0].params
        outputs = [CompletionOutput(0, r.output_text, list(r.output_token_ids), r.finish_reason,
                                    list(r.output_logprobs) if r.params.logprobs is not None else None,
                                    r.cumulative_logprob if params.num_sequences > params.n else None)
                   for r in requests]
        if params.num_sequences > params.n:
            outputs = sorted(outputs, key=lambda o: -o.cumulative_logprob)[:params.n]
        for index, output in enumerate(outputs):
            output.index = index
        results.append(GenerationOutput(
            request_id=group[0], prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=requests[0].prompt_token_ids, outputs=outputs))
        for request_id in group:
            engine.release(request_id)
    return results
