"""Settings and inputs of benchmarks/bench_attention.py: the shapes, widths and launch configs (module
attributes its command line overrides: read them as `attention_setup.X` at call time, never copy them at
import), the timer, and the inputs of each cell (SDPA's contiguous cache, paged bf16 pages, low-bit pages and
the bytes each kernel reads), plus the low-bit implementations that import here."""

from __future__ import annotations

import importlib
import math
import time

import torch
import torch.nn.functional as F

from benchmarks.timing import cuda_graph_ms
from moekv.core.attention_metadata import AttentionMetadata
from moekv.core.lowbit_layout import PackedPages, QuantSpec
from moekv.ops.triton.lowbit import quantize as lowbit_quantize

HQ, HKV, D = 32, 8, 128
SCALE = 1.0 / math.sqrt(D)
SHAPES = [(1, 16384), (1, 131072), (8, 32768), (32, 16384), (128, 16384)]
CURVE = [(1, L) for L in (2048, 8192, 16384, 32768, 65536, 131072)]
BITS = (4, 3, 2)
FP_PAGE, LOWBIT_PAGE = 16, 128
# Run 1 (see docs/attention-kernels.md) swept more; these are the survivors and the open questions.
FP_CONFIGS = [dict(BLOCK_N=128, num_warps=4, num_stages=2), dict(BLOCK_N=64, num_warps=4, num_stages=3),
              dict(BLOCK_N=128, num_warps=4, num_stages=2, waves=4)]
# Low-bit decode implementations compared by this script: name -> (module, function, launch configs).
# "v7" is the decode kernel (CUDA C++, ops/cuda; its configs: forced split counts beside the planned one); "v4"
# the general Triton kernel (decode and prefill; configs passed as config=...), the fallback for other formats.
LOWBIT_IMPLS = {
    "v7": ("moekv.ops.cuda.lowbit_decode", "paged_attention_lowbit_decode", [{}]),
    "v4": ("moekv.ops.triton.lowbit.attention", "paged_attention_lowbit", [dict(num_warps=4)]),
}
TUNING = ((32, 16384), (1, 16384))           # the first one's winners serve every other shape
SWEPT_BITS = (3,)                          # other widths take int3's winner
DEVICE = "cuda"
DRY_SHAPES = [(1, 300), (2, 260)]
OUTLIERS = "default"          # --outliers: "default" = the cache's (CacheConfig), "1%" on keys and values (v6-era runs)
STAGING_BLOCK = None          # --staging-block: the tail page's rows in shuffled blocks of this many (None: one whole page)
STAGING_ONLY = False          # --staging-only: the tail page as an id beyond the low-bit pages (lazy_partial_page)
T0 = time.perf_counter()


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- timing
class Timer:
    def __init__(self, cold: bool, reps: int = 10, trials: int = 5):
        self.cold, self.reps, self.trials = cold, reps, trials
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE) if cold and DEVICE == "cuda" else None
        self._flush_ms = None

    def _graph_ms(self, body) -> float:
        return cuda_graph_ms(body, self.reps, self.trials)

    def remeasure_flush(self) -> None:
        """Time the L2 flush again at its next use (each run of a --runs table subtracts its own)."""
        self._flush_ms = None

    def __call__(self, fn) -> float:
        """Median milliseconds of one call of fn."""
        if DEVICE == "cpu":                                   # --dry: wall clock of one call
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        if not self.cold:
            return self._graph_ms(fn)
        if self._flush_ms is None:
            self._flush_ms = self._graph_ms(self.flush.zero_)

        def body():
            self.flush.zero_()
            fn()
        return max(self._graph_ms(body) - self._flush_ms, 1e-4)


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy bandwidth in TB/s (read + write bytes)."""
    if DEVICE == "cpu":
        return 1.0
    src = torch.empty(2**28, dtype=torch.float32, device=DEVICE)                # 1 GiB
    dst = torch.empty_like(src)
    ms = Timer(cold=False, reps=5)(lambda: dst.copy_(src))
    del src, dst
    return 2 * 2**30 / ms / 1e9                                                  # 1 GiB read + 1 GiB written


# ---------------------------------------------------------------- caches
def shuffled_tables(batch: int, pages_per_seq: int, generator) -> tuple[list[list[int]], int]:
    num_pages = batch * pages_per_seq
    perm = torch.randperm(num_pages, generator=generator).tolist()
    return [perm[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(batch)], num_pages


def random_kv(shape, heavy_channels: bool = True) -> torch.Tensor:
    """bf16 rows; keys get a few heavy channels (8x), the outlier pattern per-channel keys are built for."""
    x = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    if heavy_channels:
        x[..., :4] *= 8.0
    return x


def build_fp(batch: int, length: int, generator):
    tables, num_pages = shuffled_tables(batch, -(-length // FP_PAGE), generator)
    key_pages = torch.randn((num_pages, FP_PAGE, HKV, D), device=DEVICE, dtype=torch.bfloat16)
    value_pages = torch.randn_like(key_pages)
    meta = AttentionMetadata.build([1] * batch, [length - 1] * batch, tables, FP_PAGE, DEVICE)
    nbytes = 2 * batch * length * HKV * D * 2 + meta.block_tables.numel() * 4
    return key_pages, value_pages, meta, nbytes


def lowbit_specs(bits: int) -> tuple[QuantSpec, QuantSpec]:
    """The engine's format (CacheConfig defaults: channel-axis keys without outliers, values with 0.25%), or 1% of
    fp16 outlier slots on both sides with --outliers 1%."""
    from moekv.config import CacheConfig

    cache = CacheConfig(kv_cache_dtype=f"int{bits}")
    key_fraction, value_fraction = ((cache.key_outlier_fraction, cache.value_outlier_fraction) if OUTLIERS == "default"
                                    else (0.01, 0.01))
    return (QuantSpec(bits=bits, axis="channel", head_dim=D, page_size=LOWBIT_PAGE,
                      outlier_capacity=QuantSpec.capacity_for(key_fraction, LOWBIT_PAGE, D)),
            QuantSpec(bits=bits, axis="token", head_dim=D, page_size=LOWBIT_PAGE,
                      outlier_capacity=QuantSpec.capacity_for(value_fraction, LOWBIT_PAGE, D)))


def build_lowbit(batch: int, length: int, bits: int, generator, chunk: int = 1024):
    """A decode step's state: context of length-1 tokens per sequence (full pages low-bit, the tail
    page in a staging slot), the new token passed in full precision."""
    key_spec, value_spec = lowbit_specs(bits)
    pages_per_seq = -(-length // LOWBIT_PAGE)
    tables, num_pages = shuffled_tables(batch, pages_per_seq, generator)
    stores = []
    for spec in (key_spec, value_spec):
        store = PackedPages.empty(spec, num_pages, HKV, DEVICE)
        for start in range(0, num_pages, chunk):
            n = min(chunk, num_pages - start)
            rows = random_kv((n, HKV, LOWBIT_PAGE, D), heavy_channels=spec is key_spec)
            packed, _ = lowbit_quantize.quantize_pages(rows, spec)
            store.store(torch.arange(start, start + n, device=DEVICE), packed)
        stores.append(store)
    context = length - 1
    full = context // LOWBIT_PAGE
    block = STAGING_BLOCK or LOWBIT_PAGE
    per_page = LOWBIT_PAGE // block
    staging_only = STAGING_ONLY and context % LOWBIT_PAGE != 0
    slot_of_page = torch.full((num_pages + (batch if staging_only else 0), per_page), -1, dtype=torch.int32,
                              device=DEVICE)
    staging_shape = (batch * per_page, block, HKV, D)
    staging_keys = torch.randn(staging_shape, device=DEVICE, dtype=torch.bfloat16)
    staging_values = torch.randn_like(staging_keys)
    if context % LOWBIT_PAGE:
        if staging_only:                                   # the tail page: a staging-only id per sequence
            for i, t in enumerate(tables):
                t[full] = num_pages + i
        held = -(-(context % LOWBIT_PAGE) // block)
        order = torch.randperm(batch * per_page, generator=generator).view(batch, per_page)[:, :held]
        tails = torch.tensor([t[full] for t in tables], device=DEVICE)
        slot_of_page[tails, :held] = order.to(torch.int32).to(DEVICE)
    if per_page == 1:
        slot_of_page = slot_of_page[:, 0].contiguous()     # whole pages: the one-slot-per-page map, as before
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, LOWBIT_PAGE, DEVICE)
    query = torch.randn((batch, HQ, D), device=DEVICE, dtype=torch.bfloat16)
    key = torch.randn((batch, HKV, D), device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    args = (query, key, value, stores[0], stores[1], key_spec, value_spec, staging_keys, staging_values,
            slot_of_page, meta)
    return args, lowbit_bytes_read(stores, (key_spec, value_spec), tables, full, context, batch)


def lowbit_bytes_read(stores, specs, tables, full_pages: int, context: int, batch: int, block_c: int = 16) -> int:
    """Bytes the low-bit kernel reads for one decode step (per the kernel's loads)."""
    ids = torch.tensor([t[:full_pages] for t in tables], device=DEVICE).flatten()
    total = 0
    for store, spec in zip(stores, specs):
        per_page_head = LOWBIT_PAGE * spec.words_per_row * 4
        if spec.axis == "channel":
            per_page_head += 2 * D * 2
        else:
            per_page_head += 2 * LOWBIT_PAGE * spec.num_groups + 2
        per_page_head += 2                                                        # outlier count
        total += per_page_head * ids.numel() * HKV
        counts = store.outlier_count.index_select(0, ids).long()                 # [n, H]
        total += int(((counts + block_c - 1) // block_c * block_c).sum().item()) * 4
    tail = context - full_pages * LOWBIT_PAGE
    total += 2 * batch * tail * HKV * D * 2                                       # staging rows
    total += batch * (len(tables[0]) * 8 + HKV * 2 * D * 2)                      # tables, slot map, new token
    return total


def sdpa_fns(batch: int, length: int):
    """Two spellings of GQA decode in torch SDPA over a contiguous bf16 cache; the faster is the baseline."""
    k = torch.randn((batch, HKV, length, D), device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q_rows = torch.randn((batch, HKV, HQ // HKV, D), device=DEVICE, dtype=torch.bfloat16)   # group as rows
    q_gqa = q_rows.reshape(batch, HQ, 1, D)
    fns = {"rows": lambda: F.scaled_dot_product_attention(q_rows, k, v, scale=SCALE)}
    try:
        F.scaled_dot_product_attention(q_gqa, k, v, scale=SCALE, enable_gqa=True)
        fns["enable_gqa"] = lambda: F.scaled_dot_product_attention(q_gqa, k, v, scale=SCALE, enable_gqa=True)
    except Exception:                                                             # older torch
        pass
    return fns, 2 * batch * length * HKV * D * 2


# ---------------------------------------------------------------- implementations
def lowbit_impls(only: str | None = None) -> dict:
    """name -> (callable(*args, scale, **cfg), configs) for each implementation that imports here."""
    impls = {}
    for name, (module, function, configs) in LOWBIT_IMPLS.items():
        if only and name not in only.split(","):
            continue
        try:
            fn = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as exc:
            print(f"    low-bit implementation {name} unavailable: {exc}", flush=True)
            continue
        if name == "v4":
            impls[name] = ((lambda *a, _fn=fn, **c: _fn(*a, config=c)), configs)
        else:
            impls[name] = (fn, configs)
    return impls
