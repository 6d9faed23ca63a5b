"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from moekv.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, OffloadConfig, ParallelConfig,
                           SchedulerConfig)
from moekv.engine.engine import Engine
from moekv.errors import InvalidRequestError, NotAvailableError
from moekv.sampling import SamplingParams


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


class LLM:
    """Load a Hugging Face MoE checkpoint folder and generate from batches of prompts.

    Extra keyword arguments go to the config they belong to: `page_size`, `num_pages`,
    `memory_fraction`, `outlier_fraction`, `key_axis` (CacheConfig); `max_num_seqs`,
    `max_num_batched_tokens` (SchedulerConfig); `expert_parallel_size`, `num_redundant_experts`,
    `expert_dispatch` (ParallelConfig: run under torchrun, docs/expert-parallel.md);
    `cpu_offload_experts`, `expert_cache_size`, `prefetch`, `lookahead`, `extra_candidates`,
    `eviction`, `track_prediction` (OffloadConfig); `cuda_graphs` (DeviceConfig: False runs every step
    eagerly, like `--enforce-eager`), `cpu_threads`.
    """

    def __init__(self, model: str, dtype: str = "auto", kv_cache_dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, seed: int = 0, **kwargs):
        config = make_engine_config(model, dtype, kv_cache_dtype, device, max_model_len, seed, **kwargs)
        if config.parallel.expert_parallel_size > 1:      # one process per rank under torchrun: ep_runner
            from moekv.entrypoints.ep_runner import build_engine

            self.engine = build_engine(config)
        else:
            self.engine = Engine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[GenerationOutput]:
        """Generate for every prompt as one continuously batched run; outputs in prompt order.

        All prompts are validated before any runs: a bad one raises InvalidRequestError and
        nothing is queued.
        """
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                         isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise InvalidRequestError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts",
                                      param="sampling_params")
        engine = self.engine
        if getattr(engine, "is_lockstep", False):   # expert parallel: this rank's share, lockstep, all-gather
            from moekv.entrypoints.ep_runner import generate_lockstep

            return generate_lockstep(engine, prompts, sampling_params)
        request_ids = add_all_or_none(engine, prompts, sampling_params)
        pending = set(request_ids)
        try:
            while pending:
                for out in engine.step():
                    if out.finished:
                        pending.discard(out.request_id)
                if pending and not engine.has_unfinished():
                    raise RuntimeError("engine stopped with requests pending")  # a bug, not a user error
        except BaseException:   # an error or Ctrl-C: leave no request behind to run in the next call
            for request_id in request_ids:
                engine.abort(request_id)
                engine.release(request_id)
            raise
        return collect_outputs(engine, prompts, request_ids)

    def rebalance(self):
        """Expert parallelism only, and collective (every rank calls it between generate calls):
        re-place experts from the load recorded since the last rebalance and move their weights.
        Returns one distributed.sharding.LayerRebalance per MoE layer."""
        if not getattr(self.engine, "is_lockstep", False):
            raise NotAvailableError("rebalance() needs expert_parallel_size > 1")
        return self.engine.rebalance()


def add_all_or_none(engine: Engine, prompts: list, sampling_params: list) -> list[str]:
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


def collect_outputs(engine: Engine, prompts: list, request_ids: list[str]) -> list[GenerationOutput]:
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


def make_engine_config(model: str, dtype: str = "auto", kv_cache_dtype: str = "auto", device: str = "auto",
                       max_model_len: int | None = None, seed: int = 0, **kwargs) -> EngineConfig:
    """Sort keyword arguments into the config dataclass they belong to (unknown names are an error)."""
    groups = {CacheConfig: {}, SchedulerConfig: {}, ParallelConfig: {}, OffloadConfig: {}, DeviceConfig: {}}
    for key, value in kwargs.items():
        owner = next((cls for cls in groups if key in cls.__dataclass_fields__), None)
        if owner is None:
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
        groups[owner][key] = value
    return EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed),
        cache=CacheConfig(kv_cache_dtype=kv_cache_dtype, **groups[CacheConfig]),
        scheduler=SchedulerConfig(**groups[SchedulerConfig]),
        parallel=ParallelConfig(**groups[ParallelConfig]),
        device=DeviceConfig(device=device, **groups[DeviceConfig]),
        offload=OffloadConfig(**groups[OffloadConfig]),
    )
