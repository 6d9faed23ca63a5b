"""The engine loop: `step()` = schedule -> run -> sample -> postprocess.

The engine owns the model, the KV cache and its manager, the scheduler and the requests. It is
synchronous and single-threaded; `engine.async_engine` wraps it for the server. This is the
single-process member of the engine family; `engine.factory.build_engine` picks it or, under expert
parallelism, `engine.lockstep.LockstepEngine` (one per rank; `engine.leader.LeaderEngine` serves HTTP).
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import torch

from moekv import envs
from moekv.config import EngineConfig, torch_dtype
from moekv.core.request import Request, RequestOutput
from moekv.engine.cpu_threads import CpuThreads
from moekv.engine.batch import GenerationOutput, run_batch
from moekv.engine.memory_budget import device_memory_budget, kv_page_count
from moekv.engine.model_runner import ModelRunner
from moekv.engine.outputs import TokenOutputs
from moekv.engine.overlap import OverlappedSteps
from moekv.engine.sampling_step import SamplingStep
from moekv.engine.step_result import usable_rows
from moekv.errors import ConfigError, InvalidRequestError, KVCacheCorruptionError, ModelLoadError, NotAvailableError
from moekv.kvcache import KVCacheManager, KVCacheSpec, create_kv_cache, kv_cache_class
from moekv.kvcache.prefix_cache import PrefixCache
from moekv.ops import dispatch
from moekv.sampling import SamplingParams
from moekv.scheduler.scheduler import Scheduler
from moekv.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("moekv.engine")


class Engine(TokenOutputs):
    rank = 0                 # this process's place among the engine's ranks (expert parallelism: LockstepEngine)
    world_size = 1

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None,
                 tokenizer: Tokenizer | None = None):
        """Build from a checkpoint folder (`config.model.model`), or around a given model object
        (tests, random-weight benchmarks); `tokenizer=None` then means token-id prompts only."""
        self.config = config
        self.device = torch.device(config.device.resolved)
        dispatch.install(config.kernels)          # this engine's kernel switches (KernelConfig)
        model_dir = Path(config.model.model)
        if model is None:
            from moekv.models.loader import load_model

            dtype = None if config.model.dtype == "auto" else torch_dtype(config.model.dtype)
            # With expert offloading, load on the CPU: install_routing moves the experts to host memory
            # and the rest of the model to the device, so the whole model never has to fit on it.
            load_device = "cpu" if config.offload.cpu_offload_experts else self.device
            model = load_model(model_dir, dtype=dtype, device=load_device, quantization=config.model.quantization)
            tokenizer_dir = Path(config.model.tokenizer_dir)
            tokenizer = Tokenizer(tokenizer_dir) if (tokenizer_dir / "tokenizer.json").is_file() else None
        from moekv.moe.prefetch import install_routing

        self.routing = install_routing(model, config.offload, self.device)   # load stats, prediction, offload
        self.model = model.eval()
        self.arch = model.arch
        self._cpu_threads = None
        if self.device.type == "cpu":
            if config.device.cpu_kernel_cache_entries is not None:
                envs.limit_onednn_caches(config.device.cpu_kernel_cache_entries)
            self._cpu_threads = CpuThreads(config.device.cpu_threads, self.arch.hidden_size)
        self.tokenizer = tokenizer
        self.model_dtype = next(model.parameters()).dtype
        self.max_model_len = self._resolve_max_model_len()
        self.eos_token_ids = self._eos_token_ids(config.model.generation_config_dir)
        self.generation_defaults = generation_defaults(config.model.generation_config_dir)

        cache_config = config.cache
        kv_dtype_name = cache_config.kv_cache_dtype
        if kv_dtype_name == "auto":
            kv_dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.model_dtype]
        full_dtype = torch_dtype(kv_dtype_name) if kv_dtype_name in ("bf16", "fp16", "fp32") else self.model_dtype
        from dataclasses import replace

        self.cache_config = replace(cache_config, kv_cache_dtype=kv_dtype_name)
        spec = KVCacheSpec(num_layers=self.arch.num_layers, num_kv_heads=self.arch.num_kv_heads,
                           head_dim=self.arch.head_dim, page_size=self.cache_config.resolved_page_size,
                           dtype=full_dtype)
        if self.cache_config.is_low_bit and self.cache_config.staging_pages is None:
            # Each running sequence holds one fp staging page for its partial tail (plus its sink pages),
            # and briefly two in the step that fills a page; never more than there are pages. One more
            # for the graph runner's scratch page: its padding rows take a slot and keep it for good.
            per_seq = 2 + self.cache_config.fp_sink_pages
            self.cache_config = replace(self.cache_config,
                                        staging_pages=config.scheduler.max_num_seqs * per_seq + 1)
        num_pages = self._num_pages(spec)
        if self.cache_config.is_low_bit and self.cache_config.staging_pages > num_pages:
            self.cache_config = replace(self.cache_config, staging_pages=num_pages)
        self.kv_cache = create_kv_cache(self.cache_config, spec, num_pages, self.device)
        prefix_cache = PrefixCache(spec.page_size, self._prefix_salt(spec)) \
            if self.cache_config.enable_prefix_caching else None
        self.kv_manager = KVCacheManager(num_pages, spec.page_size, on_pages_freed=self.kv_cache.pages_freed,
                                         prefix_cache=prefix_cache, keeps_freed_page=self.kv_cache.keeps_freed_page,
                                         staging_only_ids=self.kv_cache.staging_only_ids(),
                                         on_page_renamed=self.kv_cache.page_renamed)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv_manager, self.device,
                                  max_num_seqs=config.scheduler.max_num_seqs, max_model_len=self.max_model_len)
        self.runner.step_hooks = self.routing      # graph steps capture the device half of its per-step hook
        if self._wants_cuda_graphs():
            # decode steps replay CUDA graphs (takes one scratch page from the pool for padding rows)
            self.runner.enable_graphs(capture=True, hooks_safe=self._routing_hooks_graph_safe())
        else:
            self.runner.graph_fallback_reason = (
                "not on CUDA" if self.device.type != "cuda" else
                "cuda_graphs=False (--enforce-eager)" if not config.device.cuda_graphs else
                "experts are offloaded to host memory (staging='device' replays graphs)")
        usable_tokens = (num_pages - self.runner.reserved_pages) * spec.page_size
        if usable_tokens < self.max_model_len:
            raise ConfigError(f"the KV cache holds {usable_tokens} tokens, fewer than "
                              f"max_model_len={self.max_model_len}; lower max_model_len or give the cache "
                              f"more memory")
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.sampling = SamplingStep(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        self.overlap: OverlappedSteps | None = None
        if config.device.overlap_decode:
            self.enable_overlap()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._rng = torch.Generator().manual_seed(config.model.seed)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "errors": 0}
        logger.info("KV cache: %s, %d pages x %d tokens = %d tokens; max concurrency at max_model_len=%d: %.1f",
                    kv_dtype_name, num_pages, spec.page_size, self.kv_manager.capacity_tokens,
                    self.max_model_len, self.kv_manager.capacity_tokens / self.max_model_len)

    def enable_overlap(self) -> bool:
        """Overlapped decode steps (DeviceConfig.overlap_decode; engine/overlap.py): False, and synchronous steps,
        when decode steps do not run through graph buckets (then no step could overlap)."""
        if self.overlap is None:
            if not self.runner.enable_token_feed():
                logger.info("overlap_decode: off, decode steps run eagerly (%s)", self.runner.graph_fallback_reason)
                return False
            self.overlap = OverlappedSteps(self)
        return True

    # -- set-up helpers -----------------------------------------------------------------------
    def _resolve_max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        asked = self.config.model.max_model_len
        if asked is None:
            return limit
        if asked > limit:
            raise ConfigError(f"max_model_len={asked} exceeds the model's max_position_embeddings={limit}")
        return asked

    def _prefix_salt(self, spec: KVCacheSpec) -> bytes:
        """What besides the tokens decides a page's keys/values: the model, its dtype and weight quantization,
        the page format."""
        c = self.cache_config
        knobs = (c.kv_cache_dtype, c.key_axis, c.key_outlier_fraction, c.value_outlier_fraction, c.outlier_tau,
                 c.fp_sink_pages, c.token_group_size)
        return repr((str(Path(self.config.model.model).resolve()), self.arch, str(self.model_dtype),
                     self.config.model.quantization, spec, knobs)).encode()

    def _wants_cuda_graphs(self) -> bool:
        """Config-level: graphs asked for, on CUDA, experts local (the runner checks the rest)."""
        offload = self.config.offload
        return (self.device.type == "cuda" and self.config.device.cuda_graphs
                and (not offload.cpu_offload_experts or offload.staging == "device"))

    def _routing_hooks_graph_safe(self) -> bool:
        """Expert offloading and prefetch listeners synchronise or use side streams: not capturable.
        The load tracker (a pre-hook, run eagerly) and a listener-less predictor (device ops) are."""
        routing = self.routing
        offload = getattr(routing, "offload", None)
        if offload is not None and getattr(offload, "staging_mode", "host") != "device":
            return False
        predictor = getattr(routing, "predictor", None)
        return predictor is None or not predictor.listeners

    def _eos_token_ids(self, generation_dir: str | None) -> set[int]:
        ids = set(self.arch.eos_token_ids)
        gen_path = Path(generation_dir or "") / "generation_config.json"
        if generation_dir is not None and gen_path.is_file():
            try:
                eos = json.loads(gen_path.read_text()).get("eos_token_id")
            except json.JSONDecodeError as exc:
                raise ModelLoadError(f"{gen_path} is not valid JSON: {exc}") from exc
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _num_pages(self, spec: KVCacheSpec) -> int:
        """The KV pool's pages: `CacheConfig.num_pages`, else what the memory budget leaves (engine/memory_budget.py:
        on CUDA every other share of the device is set aside first, overlapped decode's buffers included)."""
        config = self.cache_config
        if config.num_pages is not None:
            return config.num_pages
        format_class = kv_cache_class(config.kv_cache_dtype)
        max_num_seqs = self.config.scheduler.max_num_seqs
        wanted = max_num_seqs * -(-self.max_model_len // spec.page_size) + 1
        if self.device.type == "cuda":
            graphs = self._wants_cuda_graphs()
            plan = device_memory_budget(torch.cuda.get_device_properties(self.device).total_memory,
                                        config.memory_fraction, torch.cuda.memory_allocated(self.device), self.arch,
                                        self.model_dtype, format_class, spec, config, max_num_seqs,
                                        self.max_model_len, graphs, self.config.device.overlap_decode)
            logger.info("KV budget: %s", plan.describe())
            budget = plan.kv_bytes
        else:
            budget = config.cpu_cache_bytes
        num_pages = kv_page_count(budget, format_class, spec, config, wanted)
        if num_pages < 1:
            raise ConfigError("no memory is left for the KV cache; lower the model size or raise memory_fraction")
        return num_pages

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises InvalidRequestError (and keeps nothing) if it is bad."""
        token_ids = self._prompt_tokens(prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt is {len(token_ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                f"for a generated token", param="prompt")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id == "":
            # "" names the padding rows of a CUDA-graph decode bucket (the low-bit cache never reports them)
            raise InvalidRequestError("a request id must not be empty", param="request_id")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,),
                                                                                  generator=self._rng))
            generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampling.check(params)
        grammar = self.sampling.grammar_matcher(params)          # structured outputs: compiled here
        request = Request(request_id, token_ids, params, IncrementalDetokenizer(self.tokenizer), generator,
                          grammar=grammar)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this model folder has no tokenizer.json; pass token ids",
                                          param="prompt")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise InvalidRequestError("a token-id prompt must be a list of integers", param="prompt")
            bad = [t for t in token_ids if not 0 <= t < self.arch.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, "
                                          f"{self.arch.vocab_size})", param="prompt")
        else:
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got "
                                      f"{type(prompt).__name__}", param="prompt")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return token_ids

    def abort(self, request_id: str) -> bool:
        """End a request now and free its pages. Returns False if it was unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None or request.status.is_finished:
            return False
        self._finish(request, "abort")
        if self.overlap is not None:
            self.overlap.drop_if_dead()          # a launched step left without a live row is read and dropped
        return True

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        if self.overlap is not None:
            self.overlap.forget(request)        # its row of a step not read yet is discarded
        self.scheduler.remove(request)
        request.finish(reason, error)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.overlap is not None and self.overlap.in_flight is not None)

    def release(self, request_id: str) -> None:
        """Forget a finished request (callers that stream outputs release after the last one)."""
        request = self.requests.get(request_id)
        if request is not None and request.status.is_finished:
            del self.requests[request_id]

    def generate(self, prompts: list, sampling_params: list) -> list[GenerationOutput]:
        """Run one batch of prompts to completion (all validated first: a bad one queues nothing)."""
        return run_batch(self, prompts, sampling_params)

    def rebalance(self, min_gain: float = 0.0):
        """Expert placement exists only under expert parallelism (LockstepEngine)."""
        raise NotAvailableError("rebalance() needs expert_parallel_size > 1")

    def stop_followers(self) -> None:
        """When the server shuts down: one process has no other ranks to stop (see LeaderEngine)."""

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.overlap is not None:        # overlapped decode: this call's outputs are the previous step's
            return self.overlap.step()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        return self._run_step(sched)

    def _run_step(self, sched) -> list[RequestOutput]:
        """One scheduled step, synchronously: run, sample, append, finish."""
        self.counters["steps"] += 1
        try:
            if self._cpu_threads is not None:
                self._cpu_threads.for_step(sched.num_tokens)
            result = self.runner.execute(sched)
        except KVCacheCorruptionError as exc:
            return self._recover_from_corruption(sched, exc)
        for chunk in sched.chunks:
            # start/end derive from num_computed_tokens: count the prompt tokens before advancing it
            start, end = chunk.start, chunk.end
            if start < chunk.request.num_prompt_tokens:
                self.counters["prompt_tokens"] += min(end, chunk.request.num_prompt_tokens) - start
            chunk.request.num_computed_tokens = end
        if not result.sample_chunks:
            return []
        requests = [sched.chunks[i].request for i in result.sample_chunks]
        # A row is broken if it holds NaN or +inf, or nothing finite; -inf alone is a legal mask.
        logits = result.logits
        params = [r.params for r in requests]
        finite = result.finite            # graph decode steps read it back with the step's one host read
        if finite is None:
            finite = usable_rows(logits).tolist()                                   # [S]
        if result.greedy_tokens is not None and self.sampling.graph_argmax_suffices(params):
            # the argmax the graph step computed (what sample() would pick); broken rows are discarded below
            return self._token_outputs(requests, list(result.greedy_tokens), finite)
        if not all(finite):
            broken = torch.tensor([not f for f in finite], device=logits.device)
            logits = logits.masked_fill(broken.unsqueeze(-1), 0.0)   # sampled but discarded below
        sampled = self.sampling.sample(logits, requests)
        return self._token_outputs(requests, sampled.token_ids, finite, sampled.logprobs, sampled.sampled_logprobs)

    def _recover_from_corruption(self, sched, exc: KVCacheCorruptionError) -> list[RequestOutput]:
        """End the requests whose keys/values were non-finite; recompute the rest of the step's requests
        (their pages may hold a partial write from the failed step)."""
        bad = set(exc.request_ids)
        if not bad:
            bad = {c.request.request_id for c in sched.chunks}
        outputs = []
        for chunk in sched.chunks:
            request = chunk.request
            if request.request_id in bad:
                self._finish(request, "error", f"non-finite keys or values: {exc}")
                self.counters["errors"] += 1
                outputs.append(self._output(request, [], None))
            else:
                self.scheduler.remove(request)
                request.num_computed_tokens = 0
                self.scheduler.add(request)
        return outputs

    # -- stats --------------------------------------------------------------------------------
    def prefix_cache_stats(self) -> dict[str, float]:
        """Prefix-cache counters since start, in tokens (queries, hits) and cached pages; {} when off."""
        cache = self.kv_manager.prefix_cache
        return cache.stats() if cache is not None else {}

    def kv_bits_per_value(self) -> float:
        lengths = [r.num_computed_tokens for r in self.scheduler.running]
        return self.kv_cache.bits_per_value(lengths or [0])

    def expert_load(self) -> torch.Tensor:
        """[num_layers, num_experts] routed token-slots since start (reads the device counters)."""
        return self.model.expert_load.detach().cpu()

    def routing_stats(self) -> dict:
        """Expert load (total, decayed window, hot / cold experts), prediction recall per layer and
        overall (1 and 2 layers ahead), expert-cache hits / misses / prefetches (see
        moe.prefetch.runtime.RoutingRuntime.stats). Reads device counters: call between steps."""
        return self.routing.stats()


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def generation_defaults(generation_dir: str | None) -> dict[str, float]:
    """The sampling defaults a checkpoint's generation_config.json sets (vLLM's `--generation-config auto`):
    temperature, top_p, top_k, repetition_penalty, for requests that leave them out (server only)."""
    path = Path(generation_dir or "") / "generation_config.json"
    if generation_dir is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    return {key: data[key] for key in GENERATION_DEFAULT_KEYS
            if isinstance(data.get(key), (int, float)) and not isinstance(data.get(key), bool)}

