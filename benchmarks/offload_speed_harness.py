"""The two decode harnesses of `bench_offload.py speed` (benchmarks/offload_speed.py): batch-1 greedy decode
through the model's forward (eager modes: the bench's own loop, its KV cache and block table) and through the
engine (graph modes: CUDA graphs on CUDA, the static buffers run eagerly on the CPU)."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EagerDecoder:
    """Greedy batch-1 decode through the model's forward, one step per `step()` (step 0: the prompt)."""

    def __init__(self, model, prompt: list[int], total_steps: int):
        from moekv.kvcache.base import KVCacheSpec
        from moekv.kvcache.formats.full_precision import FullPrecisionKVCache
        from moekv.kvcache.manager import KVCacheManager, pages_needed

        arch, self.device, self.model = model.arch, model.device, model
        self.page_size = 16
        num_pages = pages_needed(len(prompt) + total_steps + 1, self.page_size) + 1
        spec = KVCacheSpec(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                           page_size=self.page_size, dtype=model.embed_tokens.weight.dtype)
        self.cache = FullPrecisionKVCache(spec, num_pages, self.device)
        self.manager = KVCacheManager(num_pages, self.page_size, on_pages_freed=self.cache.pages_freed)
        self.seq, self.start, self.tokens = list(prompt), 0, []

    @torch.inference_mode()
    def step(self) -> float:
        from moekv.core.attention_metadata import AttentionMetadata

        seq, start, device = self.seq, self.start, self.device
        self.manager.grow("s", len(seq))
        meta = AttentionMetadata.build(query_lens=[len(seq) - start], context_lens=[start],
                                       block_tables=[self.manager.block_table("s")], page_size=self.page_size,
                                       device=device, request_ids=["s"])
        sync(device)
        began = time.perf_counter()
        hidden = self.model(torch.tensor(seq[start:], device=device), torch.arange(start, len(seq), device=device),
                            self.cache, meta)
        token = int(self.model.compute_logits(hidden[-1:]).argmax())          # host sync
        elapsed = time.perf_counter() - began
        self.start = len(seq)
        seq.append(token)
        self.tokens.append(token)
        return elapsed


def run_eager(model, prompt, args, device, on_warm, on_timed=None) -> dict:
    """on_timed(): called right after the timed steps (before the profiled ones); its value is "snapshot"."""
    from benchmarks.decode_steps import busy_fraction

    decoder = EagerDecoder(model, prompt, args.warmup + args.tokens + args.profile_steps + 1)
    for _ in range(args.warmup + 1):
        decoder.step()
    on_warm()
    times = [decoder.step() for _ in range(args.tokens)]
    snapshot = on_timed() if on_timed is not None else None
    tokens = list(decoder.tokens)
    busy = busy_fraction(decoder.step, args.profile_steps, device) if args.profile_steps else None
    return {"seconds_per_token": sum(times) / len(times), "tokens": tokens, "gpu_busy": busy, "snapshot": snapshot}


def run_graph(model, prompt, args, device, dtype_name: str, on_warm, routers) -> dict:
    """Decode through the engine: CUDA graphs on CUDA (static buffers run eagerly on the CPU). The timed steps
    are benchmarks.decode_steps.time_steps's: wall time per step and each step's graph replay time (CUDA
    events) from the same steps; GPU busy = replay / wall."""
    from benchmarks.decode_steps import time_steps
    from moekv.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
    from moekv.engine.engine import Engine
    from moekv.sampling import SamplingParams

    new_tokens = args.warmup + args.tokens + 2
    max_len = len(prompt) + new_tokens + 8
    config = EngineConfig(model=ModelConfig(model="random:mixtral-8x7b", max_model_len=max_len),
                          cache=CacheConfig(kv_cache_dtype=dtype_name, page_size=16, num_pages=-(-max_len // 16) + 2,
                                            enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=1),
                          device=DeviceConfig(str(device), cuda_graphs=device.type == "cuda"))
    engine = Engine(config, model=model)
    runner = engine.runner
    try:
        if device.type != "cuda":
            runner.enable_graphs(capture=False)
        if runner.graph_mode is None:
            raise RuntimeError(f"the engine runs eagerly: {runner.graph_fallback_reason}")
        request_id = engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                               ignore_eos=True))
        request = engine.requests[request_id]
        engine.step()                                                      # the prompt
        saved = [router.position.clone() for router in routers]
        with torch.inference_mode():
            runner._bucket(1)                      # capture now; its warm-up forwards must not move the replay
        for router, position in zip(routers, saved):
            router.position.copy_(position)
        for _ in range(args.warmup):
            engine.step()
        on_warm()
        timed = time_steps(engine, args.tokens, device)
        tokens = list(request.output_token_ids)
    finally:
        engine.routing.remove_hooks()
    replay = timed["graph_replay_ms"]
    return {"seconds_per_token": timed["tpot_ms"] / 1e3, "tokens": tokens, "graph_replay_ms": replay,
            "gpu_busy": replay / timed["tpot_ms"] if replay else None, "graph_replays": timed["graph_replays"]}
