"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import Sequence

from moekv.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, OffloadConfig, ParallelConfig,
                           SchedulerConfig)
from moekv.engine.batch import CompletionOutput, GenerationOutput, add_all_or_none, collect_outputs
from moekv.engine.factory import build_engine
from moekv.errors import InvalidRequestError
from moekv.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "GenerationOutput", "add_all_or_none", "collect_outputs",
           "make_engine_config", "resolve_model_names"]


class LLM:
    """Load a Hugging Face MoE checkpoint (a folder, or a Hub id already in the local Hugging Face cache:
    `revision`, `tokenizer`, `tokenizer_revision`, `download_dir`, `generation_config`) and generate.

    Extra keyword arguments go to the config they belong to: `page_size`, `num_pages`,
    `memory_fraction`, `outlier_fraction`, `key_axis`, `enable_prefix_caching` (CacheConfig; default True:
    full KV pages of prompt prefixes are shared across requests); `max_num_seqs`,
    `max_num_batched_tokens` (SchedulerConfig); `expert_parallel_size`, `num_redundant_experts`,
    `expert_dispatch` (ParallelConfig: run under torchrun, docs/expert-parallel.md);
    `cpu_offload_experts`, `expert_cache_size`, `prefetch`, `lookahead`, `extra_candidates`,
    `eviction`, `track_prediction`, `prefetch_threshold`, `staging_slots`, `host_format`, `staging`,
    `prefetch_guard`, `cpu_compute_fraction` (OffloadConfig, docs/expert-offload.md); `cuda_graphs`
    (DeviceConfig: False runs every step eagerly, like `--enforce-eager`), `overlap_decode` (DeviceConfig:
    overlapped CUDA-graph decode steps, engine/overlap.py), `cpu_threads`. `quantization="fp8"` quantizes
    the projections and experts of a 16-bit checkpoint to FP8 at load time (W8A16, per output channel; FP8
    checkpoints load as FP8 without it): docs/weight-quantization.md.
    """

    def __init__(self, model: str, dtype: str = "auto", kv_cache_dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, seed: int = 0, quantization: str | None = None, **kwargs):
        model, kwargs = resolve_model_names(model, kwargs)
        config = make_engine_config(model, dtype, kv_cache_dtype, device, max_model_len, seed,
                                    quantization=quantization, **kwargs)
        self.engine = build_engine(config)    # expert parallel: this rank's LockstepEngine (under torchrun)

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
        # one process: a continuously batched run; expert parallel: this rank's share, lockstep, all-gather
        return self.engine.generate(prompts, sampling_params)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: Sequence[dict] | None = None) -> list[GenerationOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of them.

        Each conversation is rendered with the checkpoint's chat template (or `chat_template`), with
        `tools` (OpenAI / transformers function schemas) passed to it as `tools`, then generated as
        `generate` does; every output's `prompt` is the rendered text."""
        if self.tokenizer is None:
            raise InvalidRequestError("chat needs the model's tokenizer (tokenizer.json)", param="messages")
        if not messages:
            return []
        conversations = [messages] if isinstance(messages[0], dict) else [list(m) for m in messages]
        texts, prompts = [], []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt,
                                                      template=chat_template, tools=tools)
            texts.append(text)
            prompts.append(self.tokenizer.encode_rendered(text))
        if isinstance(sampling_params, Sequence) and len(sampling_params) != len(prompts):
            raise InvalidRequestError(f"got {len(sampling_params)} sampling params for {len(prompts)} "
                                      f"conversations", param="sampling_params")
        outputs = self.generate(prompts, sampling_params)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def rebalance(self):
        """Expert parallelism only, and collective (every rank calls it between generate calls):
        re-place experts from the load recorded since the last rebalance and move their weights.
        Returns one distributed.sharding.LayerRebalance per MoE layer."""
        return self.engine.rebalance()      # NotAvailableError on one process


def resolve_model_names(model: str, kwargs: dict) -> tuple[str, dict]:
    """`model`, `tokenizer=` and `generation_config=` as checkpoint folders: a folder as given, a Hugging Face
    id from the local cache (`revision=`, `tokenizer_revision=`, `download_dir=`; models.hub, never a
    download). Returns the model folder and the keyword arguments without the revision / cache ones."""
    from moekv.models.hub import resolve_model_dir

    kwargs = dict(kwargs)
    revision, download_dir = kwargs.pop("revision", None), kwargs.pop("download_dir", None)
    tokenizer_revision = kwargs.pop("tokenizer_revision", None)
    model = resolve_model_dir(model, revision, download_dir)
    if kwargs.get("tokenizer") is not None:
        kwargs["tokenizer"] = resolve_model_dir(kwargs["tokenizer"], tokenizer_revision, download_dir,
                                                what="tokenizer")
    if kwargs.get("generation_config", "auto") not in ("auto", "vllm", "none"):
        kwargs["generation_config"] = resolve_model_dir(kwargs["generation_config"], None, download_dir,
                                                        what="generation_config")
    return model, kwargs


def make_engine_config(model: str, dtype: str = "auto", kv_cache_dtype: str = "auto", device: str = "auto",
                       max_model_len: int | None = None, seed: int = 0, quantization: str | None = None,
                       **kwargs) -> EngineConfig:
    """Sort keyword arguments into the config dataclass they belong to (unknown names are an error).

    `tokenizer=` is a folder (None: the model's), `generation_config=` auto, vllm or a folder; names
    are taken as given (`resolve_model_names` turns Hub ids into cached folders first)."""
    tokenizer = kwargs.pop("tokenizer", None)
    generation_config = kwargs.pop("generation_config", "auto")
    groups = {CacheConfig: {}, SchedulerConfig: {}, ParallelConfig: {}, OffloadConfig: {}, DeviceConfig: {}}
    for key, value in kwargs.items():
        owner = next((cls for cls in groups if key in cls.__dataclass_fields__), None)
        if owner is None:
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
        groups[owner][key] = value
    return EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, tokenizer=tokenizer,
                          quantization=quantization, generation_config=generation_config),
        cache=CacheConfig(kv_cache_dtype=kv_cache_dtype, **groups[CacheConfig]),
        scheduler=SchedulerConfig(**groups[SchedulerConfig]),
        parallel=ParallelConfig(**groups[ParallelConfig]),
        device=DeviceConfig(device=device, **groups[DeviceConfig]),
        offload=OffloadConfig(**groups[OffloadConfig]),
    )
