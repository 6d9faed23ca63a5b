"""The device memory budget (engine/memory_budget.py) and what overlapped decode adds to it: the KV pool is sized
after the token feed of overlapped decode is set aside (exactly its bytes: one page fewer at the boundary), the
runner's buffers with overlap differ from synchronous decode's by the feed and the two host status rows only,
between steps an overlapped engine holds one more tensor than a synchronous one (the launched step's logits,
static in a captured graph), and a dropped engine frees its KV cache without waiting for the cycle collector
(session 20's B=64 "out of memory" was the previous row's cache, alive beside the next one's)."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moekv import LLM, SamplingParams
from moekv.config import CacheConfig
from moekv.core.lowbit_layout import PackedPages
from moekv.engine.engine import Engine
from moekv.engine.graph_buckets import graph_pool_bytes
from moekv.engine.memory_budget import (ACTIVATION_RESERVE, allocator_bytes, device_memory_budget, kv_page_count,
                                        overlap_decode_bytes)
from moekv.kvcache import KVCacheSpec, kv_cache_class
from moekv.kvcache.formats.lowbit_capacity import quant_specs
from moekv.models.registry import named_arch
from moekv.paths import default_model_dir

# the session-20 row: Mixtral-8x7B, B=64, 16k context + 180 tokens, int3 pages of 128, staging 2 * 64 + 8
MIXTRAL = named_arch("mixtral-8x7b")
B64_PAGES = 64 * -(-(16384 + 180) // 128) + 64 + 1
SPEC = KVCacheSpec(MIXTRAL.num_layers, MIXTRAL.num_kv_heads, MIXTRAL.head_dim, 128, torch.bfloat16)
INT3 = CacheConfig(kv_cache_dtype="int3", page_size=128, staging_pages=2 * 64 + 8)
H200 = 150_110_011_392          # bytes (139.80 GiB, as torch reports the device)
WEIGHTS = 93_405_585_408        # Mixtral-8x7B's bf16 parameters (86.99 GiB)


def test_overlap_decode_bytes_is_the_token_feed():
    """int64 [2 * last bucket], in 512-byte allocator blocks: 1 KiB at 64 sequences."""
    assert overlap_decode_bytes(64) == 2 * 64 * 8 == 1024
    assert overlap_decode_bytes(1) == 512 and overlap_decode_bytes(100) == allocator_bytes(1600) == 2048
    assert overlap_decode_bytes(96) == 1536


def test_the_session_20_allocation_was_one_layer_of_the_next_rows_int3_codes():
    """394.00 MiB = one layer's int3 key (or value) codes of the B=64 pool (8385 pages x 8 heads x 128 x 12 int32 =
    393.05 MiB, in 2 MiB segments), five orders of magnitude above anything overlapped decode allocates."""
    assert B64_PAGES == 8385
    key_spec, _ = quant_specs(SPEC, INT3)
    codes = PackedPages.empty(key_spec, B64_PAGES, SPEC.num_kv_heads, torch.device("meta")).codes
    two_mib = 2 << 20
    assert -(-codes.numel() * codes.element_size() // two_mib) * two_mib == 394 << 20
    assert overlap_decode_bytes(64) * 400_000 < 394 << 20


def _budget(overlap: bool, allocated: int = WEIGHTS, graphs: bool = True):
    return device_memory_budget(H200, 0.9, allocated, MIXTRAL, torch.bfloat16, kv_cache_class("int3"), SPEC, INT3,
                                64, 16384 + 188, graphs, overlap)


def test_budget_sets_overlap_bytes_aside_and_the_pool_loses_exactly_that():
    """Mixtral-8x7B at B=64 int3: the KV budget with overlap is 1024 bytes smaller; where the synchronous budget is
    a whole number of pages, the overlapped one holds one page fewer (ceil(1024 / page bytes)); with 1 KiB of slack
    both hold the same."""
    fmt, wanted = kv_cache_class("int3"), 10**9
    off, on = _budget(False), _budget(True)
    assert on.graph_pool == off.graph_pool == graph_pool_bytes(MIXTRAL, 64, torch.bfloat16, 0)
    assert off.overlap == 0 and on.overlap == 1024 and off.kv_bytes - on.kv_bytes == 1024
    assert off.kv_bytes == int(H200 * 0.9) - WEIGHTS - ACTIVATION_RESERVE - off.graph_pool
    assert _budget(True, graphs=False).overlap == 0            # no graph steps: nothing can overlap
    page = fmt.bytes_per_page(SPEC, INT3)
    boundary = WEIGHTS + (off.kv_bytes - fmt.fixed_bytes(SPEC, INT3)) % page     # off's budget: whole pages
    pages_off = kv_page_count(_budget(False, boundary).kv_bytes, fmt, SPEC, INT3, wanted)
    pages_on = kv_page_count(_budget(True, boundary).kv_bytes, fmt, SPEC, INT3, wanted)
    assert pages_off - pages_on == -(-1024 // page) == 1
    slack = boundary - 1024
    assert kv_page_count(_budget(True, slack).kv_bytes, fmt, SPEC, INT3, wanted) == pages_off
    assert pages_off > B64_PAGES                              # the B=64 row's pool fits with room to spare


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_sizes_its_pool_after_overlaps_bytes(monkeypatch, overlap):
    """Engine._num_pages on a CUDA device (its two memory queries stubbed), 16 GiB more in use than the weights so
    that the budget, not the pages 64 sequences want, decides: the same boundary as above."""
    fmt = kv_cache_class("int3")
    page, fixed = fmt.bytes_per_page(SPEC, INT3), fmt.fixed_bytes(SPEC, INT3)
    busy = WEIGHTS + (16 << 30)
    allocated = busy + (_budget(False, busy).kv_bytes - fixed) % page
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=H200))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated)
    config = types.SimpleNamespace(scheduler=types.SimpleNamespace(max_num_seqs=64),
                                   device=types.SimpleNamespace(overlap_decode=overlap))
    engine = types.SimpleNamespace(cache_config=CacheConfig(kv_cache_dtype="int3", page_size=128,
                                                            staging_pages=2 * 64 + 8, memory_fraction=0.9),
                                   config=config, max_model_len=16384 + 188, device=torch.device("cuda"),
                                   arch=MIXTRAL, model_dtype=torch.bfloat16, _wants_cuda_graphs=lambda: True)
    whole = (_budget(False, allocated).kv_bytes - fixed) // page
    assert (_budget(False, allocated).kv_bytes - fixed) % page == 0 and whole < B64_PAGES
    assert Engine._num_pages(engine, SPEC) == whole - (1 if overlap else 0)


def _static_llm(overlap: bool, kv: str = "fp32", max_num_seqs: int = 4) -> LLM:
    llm = LLM(model=default_model_dir(), dtype="fp32", kv_cache_dtype=kv, device="cpu", page_size=8,
              max_model_len=128, max_num_seqs=max_num_seqs, cuda_graphs=False)
    assert llm.engine.runner.enable_graphs(capture=False)
    assert not overlap or llm.engine.enable_overlap()
    return llm


def _runner_bytes(runner) -> int:
    """Bytes of the distinct storages the runner and its buckets hold (attributes, lists, metadata)."""
    seen: dict[int, int] = {}

    def visit(value, depth=0):
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, (list, tuple)) and depth < 2:
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict) and depth < 2:
            for item in value.values():
                visit(item, depth + 1)
    for holder in [runner, *runner._buckets.values(), *(b.meta for b in runner._buckets.values())]:
        for value in vars(holder).values():
            visit(value)
    return sum(seen.values())


@pytest.mark.parametrize("kv", ["fp32", "int3"])
def test_overlap_adds_the_feed_and_two_host_status_rows_to_the_runner(kv):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    held = []
    for overlap in (False, True):
        llm = _static_llm(overlap, kv)
        runner = llm.engine.runner
        for size in runner.buckets:                   # every bucket built, as after a run that used each size
            runner._bucket(size)
        llm.generate([[5, 17, 33], [7, 8], [9], [12, 13, 14, 15]], params)
        assert set(runner._buckets) == {1, 2, 4}
        assert not overlap or llm.engine.overlap.stats["overlapped"] >= 3
        held.append(_runner_bytes(llm.engine.runner))
    feed, host_status = 2 * 4 * 8, 2 * 3 * 4 * 8
    assert held[1] - held[0] == feed + host_status


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops allocate while the mode is on that are still alive (views follow their base)."""

    def __init__(self):
        super().__init__()
        self.live, self._refs = 0, {}                  # storage pointer -> [tensors alive, bytes]

    def _drop(self, key):
        entry = self._refs[key]
        entry[0] -= 1
        if not entry[0]:
            self.live -= entry[1]
            del self._refs[key]

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliasing = any(r.alias_info is not None for r in func._schema.returns)   # views, out=, in-place
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr():
                key = tensor.untyped_storage().data_ptr()
                if key not in self._refs:
                    if aliasing:
                        continue
                    self._refs[key] = [0, tensor.untyped_storage().nbytes()]
                    self.live += self._refs[key][1]
                self._refs[key][0] += 1
                weakref.finalize(tensor, self._drop, key)
        return out


@pytest.mark.parametrize("greedy", [True, False])
def test_between_steps_overlap_holds_only_the_launched_steps_logits(greedy):
    """Steady-state decode steps, static graph mode: what the steps allocate and leave alive is nothing for a
    synchronous engine and the launched step's logits [Bb, V] fp32 for an overlapped one (with captured graphs
    that tensor is the bucket's static output: no allocation)."""
    left = []
    for overlap in (False, True):
        llm = _static_llm(overlap)
        engine = llm.engine
        for i in range(4):
            engine.add_request([3 + i, 5, 7], SamplingParams(max_tokens=40, temperature=0.0 if greedy else 0.8,
                                                             top_p=0.9, seed=i, ignore_eos=True))
        for _ in range(4):
            engine.step()
        gc.collect()
        mode = _LiveBytes()
        with mode:
            for _ in range(6):
                engine.step()
            gc.collect()
        left.append(mode.live)
        assert not overlap or engine.overlap.stats["overlapped"] >= 6
    assert left == [0, 4 * engine.arch.vocab_size * 4]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kv", ["fp32", "int3"])
def test_a_dropped_engine_frees_its_cache_without_the_cycle_collector(overlap, kv):
    """No reference cycle holds the engine, its runner, buckets or KV cache (the manager's pool calls back through a
    weak reference, the overlapped steps hold a weak proxy of their engine): dropping the last reference frees
    them at once, before the next engine allocates its own."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        llm = _static_llm(overlap, kv)
        llm.generate([[5, 17, 33], [7, 8]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        engine = llm.engine
        refs = [weakref.ref(o) for o in (engine, engine.runner, engine.kv_cache, engine.kv_manager,
                                          *engine.runner._buckets.values())]
        del engine, llm
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        if enabled:
            gc.enable()
