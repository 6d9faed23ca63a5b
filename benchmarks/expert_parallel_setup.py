"""Set-up pieces of benchmarks/bench_expert_parallel.py: progress lines, the tiny shape, the memory plan (weights + KV
pool + reserve against the free device memory) and the engine config of a run."""

from __future__ import annotations

import argparse
import os
import time

import torch

from moekv.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig,
                          SchedulerConfig)

TINY = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            expert_intermediate_size=128, max_position_embeddings=4096)
GIB = 1 << 30
RESERVE_BYTES = 4 * GIB        # activations, kernel workspaces, the CUDA caching allocator's slack
_T0 = time.perf_counter()
_RANK = int(os.environ.get("RANK", "0"))


def log(message: str, all_ranks: bool = False) -> None:
    """A progress line on rank 0 (or on every rank), flushed at once: a run cut by a time limit shows
    how far it got."""
    if _RANK == 0 or all_ranks:
        prefix = f"[{time.perf_counter() - _T0:7.1f}s]" + (f" rank {_RANK}:" if all_ranks else "")
        print(f"{prefix} {message}", flush=True)


def kv_dtype_available(name: str, arch, page_size: int, device) -> str | None:
    """None if the KV format `name` builds here, else why not."""
    from moekv.kvcache import KVCacheSpec, create_kv_cache

    try:
        spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, page_size, torch.bfloat16)
        create_kv_cache(CacheConfig(kv_cache_dtype=name, page_size=page_size, staging_pages=1), spec, 2, device)
    except Exception as exc:  # noqa: BLE001 - any failure means: fall back and say why
        return f"{type(exc).__name__}: {exc}"
    return None


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(arch, dtype=torch.bfloat16) -> tuple[int, int]:
    """(expert bytes, all other parameter bytes) of the whole model, counted on the meta device."""
    from moekv.models.registry import model_class

    model = model_class(arch.architecture)(arch, dtype=dtype, device="meta")
    experts = other = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if ".experts." in name:
            experts += size
        else:
            other += size
    return experts, other


def kv_pool_bytes(config: EngineConfig, arch) -> tuple[int, int]:
    """(pages, bytes) of the KV pool an engine with `config` allocates (the format's own accounting)."""
    from moekv.kvcache import KVCacheSpec, kv_cache_class

    cache = config.cache
    spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, cache.page_size, torch.bfloat16)
    format_class = kv_cache_class(cache.kv_cache_dtype)
    pages = cache.num_pages
    return pages, pages * format_class.bytes_per_page(spec, cache) + format_class.fixed_bytes(spec, cache)


def memory_plan(what: str, weights: int, kv: int, kv_pages: int, device, rank: int) -> dict:
    """Check that `weights` + `kv` + a reserve fit in the free device memory; ConfigError-like
    RuntimeError with the numbers if not (CPU: recorded, not checked)."""
    plan = {"what": what, "weights_gib": weights / GIB, "kv_pool_gib": kv / GIB, "kv_pages": kv_pages,
            "reserve_gib": RESERVE_BYTES / GIB}
    if device.type != "cuda":
        return plan
    free, total = torch.cuda.mem_get_info(device)
    plan.update(free_gib=free / GIB, total_gib=total / GIB)
    need = weights + kv + RESERVE_BYTES
    if need > free:
        raise RuntimeError(
            f"rank {rank}, {what}: needs {need / GIB:.1f} GiB (weights {weights / GIB:.1f} + KV pool "
            f"{kv / GIB:.1f} for {kv_pages} pages + reserve {RESERVE_BYTES / GIB:.0f}) but only {free / GIB:.1f} "
            f"of {total / GIB:.1f} GiB are free on {device}; lower --seqs or --context, use more ranks, or a "
            f"smaller --kv-cache-dtype")
    return plan


def engine_config(args, arch, kv_dtype: str, seqs_per_rank: int, ep_size: int, device,
                  cuda_graphs: bool = True) -> EngineConfig:
    page = args.page_size
    pages_per_seq = -(-(args.context + args.steps + args.warmup + 2) // page)
    return EngineConfig(
        model=ModelConfig(model=args.shape, dtype="bf16", max_model_len=args.context + args.steps + args.warmup + 8),
        cache=CacheConfig(kv_cache_dtype=kv_dtype, page_size=page, num_pages=max(1, seqs_per_rank) * pages_per_seq + 4,
                          staging_pages=max(1, seqs_per_rank) + 8 if kv_dtype.startswith("int") else None),
        scheduler=SchedulerConfig(max_num_seqs=max(1, seqs_per_rank), max_num_batched_tokens=max(256, seqs_per_rank)),
        parallel=ParallelConfig(expert_parallel_size=ep_size, expert_dispatch=args.dispatch,
                                allgather_max_tokens=args.allgather_max_tokens),
        device=DeviceConfig(str(device), cuda_graphs=cuda_graphs))


def replace_steps(args, steps: int) -> argparse.Namespace:
    """args with `steps` timed steps (the batch-1 runs may time fewer)."""
    return argparse.Namespace(**{**vars(args), "steps": steps})
