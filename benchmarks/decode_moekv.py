"""bench_decode's moekv side: the engine for one row (cache sized to the scenario, the per-row switches
applied), its prefill or synthetic context, the timed decode steps and the row they give; and moekv's
last-token logits of one prompt (the parity check against transformers, layer_profile's tests)."""

from __future__ import annotations

import time
import weakref

import torch

from benchmarks import layer_profile
from benchmarks.decode_floor import kv_bits_at
from benchmarks.decode_scenarios import apply_switches, installed_settings, prompts
from benchmarks.decode_steps import busy_fraction, free_memory, sync, time_steps
from benchmarks.synthetic_kv import admit_with_context, fill_kv_synthetic

from moekv.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from moekv.core.attention_metadata import AttentionMetadata
from moekv.engine.engine import Engine
from moekv.kvcache import KVCacheSpec, create_kv_cache
from moekv.sampling import SamplingParams


# every row's KV cache: none may outlive its row. Session 20's B=64 "overlap on" row ran out of memory allocating
# one layer's int3 codes (394 MiB) beside the "off" row's whole cache (28.9 GiB), which a reference cycle kept
# alive past the row (docs/decode-results.md, "Host work of a graph decode step, and overlapped steps").
_ROW_CACHES: weakref.WeakSet = weakref.WeakSet()


def check_rows_freed(device: torch.device) -> None:
    """Raise if an earlier row's KV cache is still alive (after a collection): this row's cache would be allocated
    beside it and fail for a reason of the bench's own, not of the row's configuration."""
    if len(_ROW_CACHES):
        free_memory(device)
    alive = list(_ROW_CACHES)
    if alive:
        pages = sum(cache.num_pages for cache in alive)
        raise RuntimeError(f"{len(alive)} earlier row's KV cache(s) ({pages} pages) still alive: an engine was not "
                           f"freed, and this row's cache would be allocated beside it")


def device_memory(device: torch.device, after_build: int | None = None) -> dict | None:
    """CUDA: bytes allocated once the row's engine was built, and the peak over the row (None on other devices)."""
    if device.type != "cuda":
        return None
    return {"allocated_after_build": after_build, "peak_allocated": torch.cuda.max_memory_allocated(device)}


def make_engine(model, batch: int, context: int, kv: str, new_tokens: int, args, graphs: bool = True,
                switches: dict[str, bool] | None = None) -> Engine:
    """An engine over `model` for `batch` sequences of `context` + `new_tokens` tokens in a `kv` cache; args
    gives page_size (None: 16 bf16, 128 low-bit), prefill_chunk and model (the name); `switches` sets per-row
    switches (benchmarks/decode_scenarios.py: {name: on}), the others keep the environment's configuration."""
    page_size = args.page_size or (128 if kv.startswith("int") else 16)
    max_len = context + new_tokens + 8
    num_pages = batch * -(-max_len // page_size) + batch + 1
    low_bit = kv.startswith("int")
    cache = CacheConfig(kv_cache_dtype=kv, page_size=page_size, num_pages=num_pages,
                        staging_pages=2 * batch + 8 if low_bit else None,
                        staging_block_size=getattr(args, "staging_block", None) if low_bit else None,
                        lazy_partial_page=bool(getattr(args, "lazy_partial_page", False)) and low_bit)
    config = EngineConfig(model=ModelConfig(model=f"random:{args.model}", max_model_len=max_len), cache=cache,
                          scheduler=SchedulerConfig(max_num_seqs=batch,
                                                    max_num_batched_tokens=max(args.prefill_chunk, batch)),
                          device=DeviceConfig(str(model.device), cuda_graphs=graphs))
    return Engine(apply_switches(config, switches), model=model)


def run_moekv(model, batch: int, context: int, kv: str, args, device: torch.device, graphs: bool = True,
              switches: dict[str, bool] | None = None) -> dict:
    """One moekv row: prefill (or a synthetic context), --warmup steps, --steps timed steps (wall and graph
    replay of the same steps), --profile-steps profiled ones (GPU busy; eager rows: the kernel breakdown and,
    with --layer-profile, one decoder layer's kernels)."""
    # sequences prefilled first decode while the others prefill: room for those steps too
    prefill_steps = -(-batch * context // args.prefill_chunk) + batch
    new_tokens = prefill_steps + args.warmup + args.steps + args.profile_steps + 4
    synthetic = args.synthetic_kv
    if synthetic:
        new_tokens = args.warmup + args.steps + args.profile_steps + 4
    check_rows_freed(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = make_engine(model, batch, context, kv, new_tokens, args, graphs, switches)
    _ROW_CACHES.add(engine.kv_cache)
    built = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    installed = installed_settings(engine)                          # what the engine installed for its ops
    prefill_s = None
    if synthetic:                      # context counted as cached over synthetic pages: no prefill
        admit_with_context(engine, batch, context, new_tokens, model.arch.vocab_size, seed=0)
        fill_kv_synthetic(engine.kv_cache)
    else:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        for tokens in prompts(batch, context, model.arch.vocab_size):
            engine.add_request(tokens, params)
        sync(device)
        start = time.perf_counter()
        while any(not r.output_token_ids for r in engine.requests.values()):   # prefill: every first token
            engine.step()
        sync(device)
        prefill_s = time.perf_counter() - start
    for _ in range(args.warmup):
        engine.step()
    timed = time_steps(engine, args.steps, device)          # wall and graph replay of the same steps
    step_ms, replay_ms = timed["tpot_ms"], timed["graph_replay_ms"]
    breakdown = {} if not graphs else None
    busy = busy_fraction(engine.step, args.profile_steps, device, breakdown)
    layers = layer_profile.profile_layers(engine.step, model, args.profile_steps, device) \
        if not graphs and args.layer_profile else None
    assert all(len(r.output_token_ids) < new_tokens for r in engine.scheduler.running), "a sequence finished early"
    runner = engine.runner
    row = {"system": "moekv" if graphs else "moekv-eager", "kv": kv, "batch": batch, "context": context,
           "tpot_ms": step_ms, "tokens_per_s": batch * 1e3 / step_ms, "gpu_busy": busy,
           "prefill_tokens_per_s": None if prefill_s is None else batch * context / prefill_s,
           "synthetic_kv": synthetic, "kv_bits_per_value": engine.kv_bits_per_value(),
           **kv_bits_at(engine.kv_cache, batch, context),
           "cuda_graphs": runner.graph_mode == "cuda", "graph_steps": runner.graph_steps,
           "graph_replay_ms": replay_ms, "gpu_busy_replay": None if replay_ms is None else replay_ms / step_ms,
           "outside_graph_ms": timed["outside_graph_ms"], "graph_replays": timed["graph_replays"],
           "step_ms_median": timed["step_ms_median"], "steps_by_kind": timed["by_kind"],
           "graph_fallback": runner.graph_fallback_reason, "kernel_breakdown": breakdown, "layer_profile": layers,
           "device_memory": device_memory(device, built), **installed}
    if engine.overlap is not None:
        row["overlap_stats"] = dict(engine.overlap.stats)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.routing.remove_hooks()      # the model outlives the engine: its next row's engine must not run this hook
    del engine, runner                 # every reference, so that free_memory's collection frees the KV cache and the
    free_memory(device)                # graphs before the next row allocates (session 20: B=64 overlap=on ran OOM;
    return row                         # the next row checks: check_rows_freed)


@torch.inference_mode()
def moekv_logits(model, tokens: list[int]) -> torch.Tensor:
    """Last-token logits [V] of one prompt through moekv's model and a fresh full-precision cache."""
    arch, device, page = model.arch, model.device, 16
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[model.dtype]
    pages = -(-len(tokens) // page)
    spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, page, model.dtype)
    cache = create_kv_cache(CacheConfig(kv_cache_dtype=name), spec, pages + 1, device)
    meta = AttentionMetadata.build([len(tokens)], [0], [list(range(1, pages + 1))], page, device)
    ids = torch.tensor(tokens, device=device)
    hidden = model(ids, torch.arange(len(tokens), device=device), cache, meta)           # [T, H]
    return model.compute_logits(hidden[-1:])[0]
