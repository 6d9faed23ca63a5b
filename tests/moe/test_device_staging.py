"""Device-driven staging (device_staging.py, ops/triton/moe/stage.py): the device slot table makes the same
choices as the host ExpertCache, the staging copy kernel equals its reference twin, the device-staged model
generates the resident model's greedy tokens and reads nothing back to the host in a decode step. On CUDA:
copies straight from pinned host memory and a captured, replayed decode step."""

from __future__ import annotations

import pytest
import torch

from moekv.config import OffloadConfig
from moekv.core.fp8 import FP8_DTYPE
from moekv.moe.prefetch import install_routing
from moekv.moe.prefetch.device_staging import DeviceSlotTable, DeviceStagedExperts
from moekv.moe.prefetch.pool import HostExperts, SlotPool
from moekv.moe.prefetch.residency import NEEDED, ExpertCache
from moekv.ops import dispatch
from moekv.ops.reference.moe_stage import stage_expert_copies as stage_reference
from tests.hf_fixtures import moekv_greedy
from tests.helpers import no_host_reads

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # Triton: the GPU, else its interpreter


def host_step(cache: ExpertCache, needed: list[int]) -> list[int]:
    """What OffloadedExperts does with the cache for one pass (on demand): returns the experts copied."""
    missing = [e for e in needed if not cache.record_need(e)]
    for e in needed:
        cache.protect(e, NEEDED)
    for e in missing:
        cache.admit(e, NEEDED)
    for e in needed:
        cache.use(e)
    cache.end_step()
    return missing


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("num_slots,num_tokens", [(2, 1), (3, 1), (4, 2), (6, 3)])
def test_device_table_makes_the_host_caches_choices(eviction, num_slots, num_tokens):
    num_experts, top_k = 8, 2
    generator = torch.Generator().manual_seed(num_slots * 10 + num_tokens)
    cache = ExpertCache(num_experts, num_slots, eviction)
    pool = list(range(10, 10 + num_slots))                     # pool slots of this layer (not 0-based)
    table = DeviceSlotTable(num_experts, pool, trash=99, eviction=eviction, device=torch.device("cpu"))
    skewed = torch.tensor([8.0, 4, 2, 1, 1, 1, 0.5, 0.5])      # some experts hot: LFU and LRU differ
    for _ in range(60):
        ids = torch.stack([torch.multinomial(skewed, top_k, generator=generator) for _ in range(num_tokens)])
        needed = sorted(set(ids.reshape(-1).tolist()))
        copied = host_step(cache, needed)
        src, dst = table.plan(ids)
        listed = [(e, d) for e, d in zip(src.tolist(), dst.tolist())]
        assert sorted(e for e, _ in listed if e >= 0) == copied
        assert all(d == 99 for e, d in listed if e < 0)        # unused entries go to the trash slot
        assert table.resident() == sorted(cache.resident_experts())
        lut = table.pool_index_of().tolist()
        for expert in range(num_experts):                      # the same slot, as a pool index
            slot = cache.slot_of_expert[expert]
            assert lut[expert] == (pool[slot] if slot >= 0 else -1)
    hits, misses, evictions = table.counters.tolist()
    assert (hits, misses, evictions) == (cache.counters.hits, cache.counters.misses, cache.counters.evictions)


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (5, 6, 16)), (FP8_DTYPE, (5, 12, 8)),
                                         (torch.float32, (5, 7, 1)), (torch.uint8, (5, 3, 3))])
def test_stage_kernel_matches_reference(dtype, shape):
    pytest.importorskip("triton")
    from moekv.ops.triton.moe.stage import stage_expert_copies as stage_triton

    generator = torch.Generator().manual_seed(0)
    src = torch.randint(0, 255, shape, dtype=torch.uint8, generator=generator).view(dtype) if dtype in (
        FP8_DTYPE, torch.uint8) else torch.randn(shape, generator=generator).to(dtype)
    if DEVICE.type == "cuda":
        src = src.pin_memory()                                  # the kernel reads it from the device (UVA)
    for ids, slots in [([3, -1, 0], [1, 6, 4]), ([-1, -1], [6, 6]), ([4, 4, 2, 1], [0, 2, 3, 5])]:
        out = {}
        for name, fn in (("reference", stage_reference), ("triton", stage_triton)):
            dst = torch.full((7, *shape[1:]), 7, dtype=torch.uint8).view(dtype) if dtype in (FP8_DTYPE, torch.uint8) \
                else torch.full((7, *shape[1:]), -3.0, dtype=dtype)
            dst = dst.to(DEVICE)
            fn(src, dst, torch.tensor(ids, device=DEVICE), torch.tensor(slots, device=DEVICE))
            out[name] = dst.cpu()
        valid = [(e, s) for e, s in zip(ids, slots) if e >= 0]
        for e, s in valid:
            assert torch.equal(out["triton"][s].view(torch.uint8), src[e].view(torch.uint8))
        untouched = [s for s in range(6) if s not in dict((s, e) for e, s in valid)]
        for s in untouched:                                    # the kernel writes nothing else (not even trash)
            assert torch.equal(out["triton"][s].view(torch.uint8), out["reference"][s].view(torch.uint8))


@pytest.mark.parametrize("backend,host_format", [("reference", "native"), ("reference", "fp8"),
                                                  ("triton", "native")], indirect=["backend"])
def test_device_staged_model_matches_resident_and_host_staging(backend, host_format):
    from moekv.models.loader import build_random_model
    from tests.moe.conftest import tiny_arch

    device = DEVICE if backend == "triton" else torch.device("cpu")

    def tiny_model(seed):
        return build_random_model(tiny_arch(), torch.float32, device, seed=seed)

    prompt = [[3, 1, 4, 1, 5, 9]]                              # prefill: groups of S read on the host
    reference = tiny_model(seed=2)
    if host_format == "fp8":
        from moekv.models.quantize import fp8_modules

        for module in fp8_modules(reference):
            if hasattr(module, "num_experts"):
                module.to_fp8()                                # FP8 experts: what fp8 host copies compute
    new_tokens = 8 if backend == "reference" else 4
    expected, _ = moekv_greedy(reference, prompt, max_new_tokens=new_tokens)
    runs = {}
    for staging in ("host", "device"):
        model = tiny_model(seed=2)
        runtime = install_routing(model, OffloadConfig(cpu_offload_experts=True, expert_cache_size=3, prefetch=False,
                                                       staging=staging, host_format=host_format), device)
        tokens, _ = moekv_greedy(model, prompt, max_new_tokens=new_tokens)
        runs[staging] = (tokens, runtime.stats()["offload"])
    assert runs["device"][0] == runs["host"][0] == expected
    host, device = runs["host"][1], runs["device"][1]
    assert (device["hits"], device["misses"], device["copies"]) == (host["hits"], host["misses"], host["copies"])
    assert device["staging"] == "device" and device["misses"] > 0


def test_device_staged_decode_reads_nothing_back(monkeypatch):
    """A decode step (T*k <= S) through the Triton kernels (on the GPU, else the CPU interpreter): no .item() /
    .tolist() / .cpu() / torch.tensor / bool() of a tensor, and the output equals the resident experts'."""
    pytest.importorskip("triton")
    from moekv.models.loader import build_random_model
    from tests.moe.conftest import tiny_arch

    model = build_random_model(tiny_arch(), torch.float32, DEVICE, seed=1)
    local = model.layers[0].mlp.experts
    host = HostExperts.from_weights(*local.weights())
    experts = DeviceStagedExperts(0, host, SlotPool(host, 4, DEVICE), [0, 1, 2])
    generator = torch.Generator().manual_seed(3)
    with dispatch.override(backend="triton"):
        for step in range(4):
            hidden = torch.randn(1, model.arch.hidden_size, generator=generator).to(DEVICE)
            ids = torch.randperm(8, generator=generator)[:2].reshape(1, 2).to(DEVICE)
            weights = torch.softmax(torch.randn(1, 2, generator=generator), -1).to(DEVICE)
            expected = local(hidden, ids, weights)
            with no_host_reads(monkeypatch, "the device-staged forward"):
                actual = experts(hidden, ids, weights)
            assert torch.equal(actual, expected), step
    assert experts.cache.counters.misses >= 2


def test_engine_runs_device_staged_decode_through_graph_buffers():
    """The engine takes device-staged experts for its graph decode path (static buffers, eager on the CPU)."""
    from moekv import LLM, SamplingParams
    from moekv.paths import default_model_dir

    prompts, params = [[5, 17, 33, 9], [7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    common = dict(dtype="fp32", device="cpu", page_size=4, max_model_len=64, max_num_seqs=2, cuda_graphs=False)
    expected = [o.outputs[0].token_ids for o in LLM(default_model_dir(), **common).generate(prompts, params)]
    llm = LLM(default_model_dir(), cpu_offload_experts=True, expert_cache_size="50%", staging="device", **common)
    runner = llm.engine.runner
    assert runner.enable_graphs(capture=False), runner.graph_fallback_reason
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert runner.graph_steps > 0 and llm.engine.routing_stats()["offload"]["misses"] > 0


# -- CUDA ------------------------------------------------------------------------------------------------------
@needs_cuda
def test_stage_kernel_reads_pinned_host_memory():
    from moekv.ops.triton.moe.stage import stage_expert_copies as stage_triton

    src = torch.randn(6, 256, 1024, dtype=torch.bfloat16).pin_memory()
    dst = torch.zeros(5, 256, 1024, dtype=torch.bfloat16, device="cuda")
    stage_triton(src, dst, torch.tensor([4, -1, 1], device="cuda"), torch.tensor([0, 4, 2], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(dst[0].cpu(), src[4]) and torch.equal(dst[2].cpu(), src[1])
    assert not dst[1].any() and not dst[4].any()


@needs_cuda
@pytest.mark.parametrize("host_format", ["native", "fp8"])
def test_device_staged_decode_replays_as_a_cuda_graph(host_format):
    """Capture one offloaded decode step (router output given) and replay it on new routing: the replay
    copies the new misses from host memory and equals the eager device-staged step and the resident experts."""
    from moekv.layers.experts import LocalExperts

    torch.manual_seed(0)
    local = LocalExperts(8, 256, 512, 0, torch.bfloat16, "cuda")
    with torch.no_grad():
        local.w_gate_up.normal_(0, 0.05)
        local.w_down.normal_(0, 0.05)
    if host_format == "fp8":
        local.to_fp8()
    host = HostExperts.from_weights(*local.weights())
    experts = DeviceStagedExperts(0, host, SlotPool(host, 4, torch.device("cuda")), [0, 1, 2])
    hidden = torch.randn(1, 256, dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([[0, 1]], device="cuda")
    weights = torch.tensor([[0.6, 0.4]], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        experts(hidden, ids, weights)                           # compiles, loads 0 and 1
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(hidden, ids, weights)
    for step, pair in enumerate([[2, 3], [0, 3], [5, 6], [6, 7], [1, 2]]):
        ids.copy_(torch.tensor([pair]))
        hidden.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, local(hidden, ids, weights)), step
    assert experts.table.resident() == [1, 2, 7]               # LRU after the replays
