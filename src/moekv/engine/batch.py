"""One batch of prompts run to completion (the offline API's unit): queue all or none, step until every
request finishes, collect the outputs in prompt order. `Engine.generate` runs it on one process;
`LockstepEngine.generate` (engine/lockstep.py) runs each rank's share and all-gathers the outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


def add_all_or_none(engine, prompts: list, sampling_params: list) -> list[str]:
    """Queue every prompt, or none: if one is invalid, the ones already queued are taken back."""
    request_ids: list[str] = []
    try:
        for prompt, params in zip(prompts, sampling_params):
            request_ids.append(engine.add_request(prompt, params))
    except Exception:
        for request_id in request_ids:
            engine.abort(request_id)
            engine.release(request_id)
        raise
    return request_ids


def run_batch(engine, prompts: list, sampling_params: list) -> list[GenerationOutput]:
    """Queue the prompts, step the engine until they are all finished, return their outputs in order.
    On an error or Ctrl-C no request of the batch is left behind to run in the next call."""
    request_ids = add_all_or_none(engine, prompts, sampling_params)
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
    return collect_outputs(engine, prompts, request_ids)


def collect_outputs(engine, prompts: list, request_ids: list[str]) -> list[GenerationOutput]:
    """The finished requests as GenerationOutputs in prompt order (and released from the engine)."""
    results = []
    for prompt, request_id in zip(prompts, request_ids):
        request = engine.requests[request_id]
        results.append(GenerationOutput(
            request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(0, request.output_text, list(request.output_token_ids),
                                      request.finish_reason,
                                      list(request.output_logprobs) if request.params.logprobs is not None
                                      else None)]))
        engine.release(request_id)
    return results
