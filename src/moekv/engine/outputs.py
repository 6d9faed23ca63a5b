"""A step's tokens into its requests: append, finish (EOS, stop token or string, grammar, max_tokens,
max_model_len), and the `RequestOutput` each request streams. Mixed into `engine.engine.Engine`; the same for
synchronous steps and for overlapped ones, whose tokens are read one step later (engine/overlap.py)."""

from __future__ import annotations

import time

from moekv.core.request import Request, RequestOutput


class TokenOutputs:
    """What turns sampled tokens into request state and outputs (uses the engine's sampling, eos ids,
    max_model_len, counters and `_finish`)."""

    def _token_outputs(self, requests: list[Request | None], tokens: list[int], finite: list[bool],
                       logprobs: list | None = None, sampled_logprobs: list | None = None) -> list[RequestOutput]:
        """One step's rows: a row with non-finite logits ends its request with an error, the others append
        their token. A row whose request is None (ended since its step was launched) is skipped."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for row, request in enumerate(requests):
            if request is None:
                continue
            if not finite[row]:
                self._finish(request, "error", "the model produced non-finite logits for this request")
                self.counters["errors"] += 1
                outputs.append(self._output(request, [], None))
                continue
            outputs.append(self._append_token(request, tokens[row], logprobs[row] if logprobs else None, now,
                                              sampled_logprobs[row] if sampled_logprobs else None))
        return outputs

    def record_token(self, request: Request, token: int, logprobs, now: float) -> None:
        """Append one generated token to a request: times, logprobs, counter, incremental detokenizer (the
        leader of expert-parallel serving records its remote requests' tokens through it too)."""
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        request.output_token_ids.append(token)
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        self.counters["generation_tokens"] += 1
        request.detokenizer.add(token)

    def _append_token(self, request: Request, token: int, logprobs, now: float,
                      sampled_logprob: float | None = None) -> RequestOutput:
        params = request.params
        text_before = len(request.detokenizer.text)
        self.record_token(request, token, logprobs, now)
        grammar_end = self.sampling.after_token(request, token, sampled_logprob)   # best_of, structured
        if grammar_end is not None:
            self._finish(request, grammar_end, None if grammar_end == "stop" else
                         "the sampled token does not fit the request's grammar")
        elif token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            self._finish(request, "stop")
        elif params.stop and self._match_stop(request, text_before):
            self._finish(request, "stop")
        elif len(request.output_token_ids) >= params.max_tokens or request.num_known_tokens >= self.max_model_len:
            self._finish(request, "length")
        return self._output(request, [token], logprobs)

    @staticmethod
    def _match_stop(request: Request, text_before: int) -> bool:
        """Search only where a match could be new: from `longest - 1` characters before this token's
        text (a token's text may be any length, so the window is not a fixed tail)."""
        text = request.detokenizer.text
        longest = max(len(s) for s in request.params.stop)
        window_start = max(0, text_before - longest + 1)
        hits = [i for i in (text.find(s, window_start) for s in request.params.stop) if i >= 0]
        if hits:
            request.stop_text_end = min(hits)
            return True
        return False

    def _output(self, request: Request, new_tokens: list[int], new_logprobs) -> RequestOutput:
        text = request.output_text
        emitted = request.num_emitted_chars
        visible = len(text)
        if request.params.stop and not request.status.is_finished:
            visible = max(emitted, len(text) - max(len(s) for s in request.params.stop) + 1)
        new_text = text[emitted:visible]
        request.num_emitted_chars = visible
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            new_token_ids=new_tokens, new_text=new_text, token_ids=list(request.output_token_ids),
            text=text if request.status.is_finished else text[:visible],
            finished=request.status.is_finished, finish_reason=request.finish_reason,
            logprobs=list(request.output_logprobs) if request.params.logprobs is not None else None,
            new_logprobs=[new_logprobs] if new_logprobs is not None else None, error=request.error,
            cumulative_logprob=request.cumulative_logprob)
