"""The device memory the engine plans for before its KV pool exists (CUDA, `CacheConfig.num_pages` unset).

The KV pool gets what is left of `CacheConfig.memory_fraction` of the device once these are set aside: what is
allocated already (the weights), a fixed activation reserve, the CUDA-graph pool's estimate
(`graph_buckets.graph_pool_bytes`, with the cache format's decode workspace of the largest bucket) and the
device buffers overlapped decode adds (`overlap_decode_bytes`). `DeviceMemoryBudget` holds each share, so the
engine's log line names every buffer the pool was sized around.

What overlapped decode (DeviceConfig.overlap_decode, engine/overlap.py) allocates that synchronous graph decode
does not. On the device, only the token feed: int64 [2 * last bucket] (`CudaGraphSteps.enable_token_feed`),
16 * max_num_seqs bytes (1 KiB at 64 sequences). Nothing else, by construction:
- the two steps in flight run the same bucket: its input buffer, status row and captured output logits [Bb, V]
  are static, and step n+1's replay overwrites step n's logits only after step n's tokens were drawn (at its
  launch) and its status row was copied out (stream order), so no second [Bb, V] exists;
- every bucket is captured once, in the one shared graph pool: an overlapped step never builds a bucket
  (`GraphReplay.has_bucket`: the first step of a new batch size runs synchronously and captures it), and
  `enable_token_feed`, called while the engine is built, finds no bucket to capture again;
- the captured forward reads and writes the feed in place (`index_select(out=)`, `copy_`), adding no block to
  the graph pool;
- a non-greedy draw at launch (`SamplingStep.draw_tokens`) makes the temporaries the synchronous sampler
  makes in its step, and frees them before the next launch.
On the host: two pinned status rows int64 [3 * last bucket] (48 * max_num_seqs bytes), outside this budget.
Static graph mode (buckets run eagerly, no capture: CPU tests) is the one exception: there a step's logits are
a fresh tensor, so the launched step's [Bb, V] fp32 stays alive while the next step's are computed (Bb * V * 4
bytes more at the peak); the engine never sizes a CUDA pool for that mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.engine.graph_buckets import graph_buckets, graph_pool_bytes

ACTIVATION_RESERVE = 2 << 30    # bytes kept free for activations (eager steps, prefill) when sizing the KV pool
ALLOCATOR_GRANULE = 512         # the CUDA caching allocator rounds every block up to a multiple of 512 bytes


def allocator_bytes(nbytes: int) -> int:
    """What a tensor of `nbytes` takes from the CUDA caching allocator (its block size)."""
    return -(-nbytes // ALLOCATOR_GRANULE) * ALLOCATOR_GRANULE


def overlap_decode_bytes(max_num_seqs: int) -> int:
    """Device bytes overlapped decode adds to synchronous graph decode: the token feed, int64 [2 * last bucket]
    (see the module docstring for why nothing else)."""
    return allocator_bytes(2 * graph_buckets(max_num_seqs)[-1] * torch.empty((), dtype=torch.int64).element_size())


@dataclass(frozen=True)
class DeviceMemoryBudget:
    """The shares of the device memory the engine plans (bytes); `kv_bytes` is the KV pool's."""

    usable: int             # memory_fraction of the device
    allocated: int          # allocated before the cache exists (the weights)
    activations: int        # ACTIVATION_RESERVE
    graph_pool: int         # graph_pool_bytes (0 without CUDA graphs)
    overlap: int            # overlap_decode_bytes (0 without overlapped decode)

    @property
    def kv_bytes(self) -> int:
        return self.usable - self.allocated - self.activations - self.graph_pool - self.overlap

    def describe(self) -> str:
        mib = 1 << 20
        return (f"{self.usable / mib:.0f} MiB usable - {self.allocated / mib:.0f} allocated - "
                f"{self.activations / mib:.0f} activations - {self.graph_pool / mib:.1f} graph pool - "
                f"{self.overlap} B overlapped decode = {self.kv_bytes / mib:.0f} MiB for the KV pool")


def device_memory_budget(total: int, memory_fraction: float, allocated: int, arch, model_dtype: torch.dtype,
                         format_class, spec, cache_config, max_num_seqs: int, max_model_len: int,
                         graphs: bool, overlap: bool) -> DeviceMemoryBudget:
    """The budget of a device of `total` bytes with `allocated` in use. `graphs`: decode steps replay CUDA graphs
    (the shared pool's estimate is set aside); `overlap`: overlapped decode too (ignored without graphs: no step
    can overlap). `format_class` is the KV cache class (`kv_cache_class`), `spec` its KVCacheSpec."""
    pool = extra = 0
    if graphs:
        workspace = format_class.graph_workspace_bytes(spec, cache_config, arch.num_heads,
                                                       graph_buckets(max_num_seqs)[-1], max_model_len)
        pool = graph_pool_bytes(arch, max_num_seqs, model_dtype, workspace)
        extra = overlap_decode_bytes(max_num_seqs) if overlap else 0
    return DeviceMemoryBudget(int(total * memory_fraction), allocated, ACTIVATION_RESERVE, pool, extra)


def kv_page_count(budget_bytes: int, format_class, spec, cache_config, wanted: int) -> int:
    """Pages of the format that fit `budget_bytes` (after its fixed bytes), at most `wanted`."""
    page_bytes = format_class.bytes_per_page(spec, cache_config)
    return int(min(wanted, (budget_bytes - format_class.fixed_bytes(spec, cache_config)) // page_bytes))
