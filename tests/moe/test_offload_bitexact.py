"""Offloaded experts compute bit-identically to resident experts, in bf16, on every kernel path.

The bug these guard against (seen on an H200 in bf16): the offloaded block ran the fused kernels on
its [S, ...] slot tensors, so the launch configuration was chosen for S experts instead of E (the
decode path's down-projection K-split depends on min(T*k, E)), and a step needing more experts than
slots summed per-pass outputs that had each been rounded to bf16. Both change the last bits, and a
random-weight model's greedy tokens then drift from the resident run's.

Runs the Triton kernels on CUDA, else under Triton's CPU interpreter (TRITON_INTERPRET, set by the
root conftest), and the pure-PyTorch reference path on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from moekv.models.loader import build_random_model
from moekv.layers.experts import LocalExperts
from moekv.moe.prefetch import ExpertOffload
from moekv.moe.prefetch.offload import OffloadedExperts
from moekv.ops import dispatch
from tests.moe.conftest import tiny_arch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_EXPERTS, HIDDEN, INTER = 8, 32, 64


def local_experts(dtype=torch.bfloat16, seed=0, inter=INTER):
    local = LocalExperts(NUM_EXPERTS, HIDDEN, inter, 0, dtype, DEVICE)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        local.w_gate_up.copy_(torch.randn(local.w_gate_up.shape, generator=generator) * 0.3)
        local.w_down.copy_(torch.randn(local.w_down.shape, generator=generator) * 0.3)
    return local


def offloaded_from(local, num_slots, host_format="native"):
    return OffloadedExperts.standalone(0, *local.weights(), num_slots, DEVICE, host_format=host_format)


def routing(num_tokens, generator, top_k=2):
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), -1)
    return ids.to(DEVICE), weights.to(DEVICE)


# T = 1 and 16: decode kernel (16 is the default decode limit); 24: grouped kernel; 16 tokens x top-2
# touch more experts than 2 or 3 slots, so those steps run in several passes.
@pytest.mark.parametrize("num_slots", [1, 2, 3, 8])
def test_offloaded_bf16_is_bit_identical_to_resident(backend, num_slots):
    local = local_experts()
    offloaded = offloaded_from(local, num_slots)
    generator = torch.Generator().manual_seed(1)
    for num_tokens in (1, 3, 16, 24):
        hidden = (torch.randn(num_tokens, HIDDEN, generator=generator)).to(DEVICE, torch.bfloat16)
        topk_ids, topk_weights = routing(num_tokens, generator)
        expected = local(hidden, topk_ids, topk_weights)
        actual = offloaded(hidden, topk_ids, topk_weights)
        assert torch.equal(actual, expected), (backend, num_slots, num_tokens,
                                               (actual.float() - expected.float()).abs().max().item())


def test_launch_configuration_follows_the_resident_shape(monkeypatch):
    """A K-split that depends on the weight tensor's expert count (as default_split_k and tuned
    config files do) must not change the offloaded result. fp32, where a different split order
    shows in the output bits (in bf16 the output rounding hides it most of the time)."""
    pytest.importorskip("triton")
    from moekv.ops.triton.moe import decode as moe_decode

    def split_by_experts(num_tokens, top_k, num_experts, hidden, inter, block_n, block_k):
        return 1 if num_experts == NUM_EXPERTS else 2    # inter 512, BLOCK_K 128: (c0+c1)+(c2+c3) vs ((c0+c1)+c2)+c3
    monkeypatch.setattr(moe_decode, "default_split_k", split_by_experts)
    with dispatch.override(backend="triton"):
        local = local_experts(torch.float32, seed=3, inter=512)
        generator = torch.Generator().manual_seed(4)
        hidden = torch.randn(4, HIDDEN, generator=generator).to(DEVICE) * 4
        topk_ids, topk_weights = routing(4, generator)
        expected = local(hidden, topk_ids, topk_weights)
        two_splits = moe_decode.moe_experts_decode(hidden, local.w_gate_up, local.w_down, topk_ids, topk_weights,
                                                   {"down": {"SPLIT_K": 2}})
        assert not torch.equal(two_splits, expected)      # the split order is visible in this setup
        for num_slots in (4, 6):                          # the kernel alone would pick 2 splits for these
            assert torch.equal(offloaded_from(local, num_slots)(hidden, topk_ids, topk_weights), expected)


@pytest.mark.parametrize("num_slots", [2, 4])
def test_bf16_greedy_tokens_match_resident(backend, num_slots):
    """A whole bf16 model: prefill (several passes) and decode give the resident model's logits bit
    for bit, hence the same greedy tokens."""
    arch = tiny_arch(num_layers=2)
    model = build_random_model(arch, torch.bfloat16, DEVICE, seed=0)
    prompt = torch.randint(0, arch.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    expected_tokens, expected_logits = greedy(model, prompt, 4)
    offload = ExpertOffload(model, num_slots=num_slots, device=DEVICE)
    tokens, logits = greedy(model, prompt, 4)
    assert tokens == expected_tokens
    for a, b in zip(logits, expected_logits):
        assert torch.equal(a, b)
    assert offload.counters().misses > 0


@torch.inference_mode()
def greedy(model, prompt: list[int], steps: int):
    from moekv.core.attention_metadata import AttentionMetadata
    from moekv.kvcache.base import KVCacheSpec
    from moekv.kvcache.formats.full_precision import FullPrecisionKVCache
    from moekv.kvcache.manager import KVCacheManager, pages_needed

    arch, device = model.arch, model.device
    page_size = 16
    num_pages = pages_needed(len(prompt) + steps + 1, page_size) + 1
    spec = KVCacheSpec(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                       page_size=page_size, dtype=model.embed_tokens.weight.dtype)
    cache = FullPrecisionKVCache(spec, num_pages, device)
    manager = KVCacheManager(num_pages, page_size, on_pages_freed=cache.pages_freed)
    seq, start, tokens, logits = list(prompt), 0, [], []
    for _ in range(steps):
        manager.grow("s", len(seq))
        meta = AttentionMetadata.build(query_lens=[len(seq) - start], context_lens=[start],
                                       block_tables=[manager.block_table("s")], page_size=page_size,
                                       device=device, request_ids=["s"])
        hidden = model(torch.tensor(seq[start:], device=device), torch.arange(start, len(seq), device=device),
                       cache, meta)
        row = model.compute_logits(hidden[-1:])
        logits.append(row.float().cpu())
        token = int(row.argmax())
        start = len(seq)
        seq.append(token)
        tokens.append(token)
    return tokens, logits


# -- FP8 host experts (host_format="fp8") ------------------------------------------------------------------
def fp8_twin(local):
    """The same experts held resident in FP8 (per output channel), as LocalExperts.to_fp8 does it."""
    twin = LocalExperts(NUM_EXPERTS, HIDDEN, local.w_down.shape[2], 0, local.w_gate_up.dtype, DEVICE)
    with torch.no_grad():
        twin.w_gate_up.copy_(local.w_gate_up)
        twin.w_down.copy_(local.w_down)
    twin.to_fp8()
    return twin


@pytest.mark.parametrize("num_slots", [2])
def test_fp8_host_experts_are_bit_identical_to_resident_fp8(backend, num_slots):
    """FP8 host copies are computed from directly (W8A16 kernels, or the reference's fp32 matmuls on
    dequantized weights): the output equals the resident FP8 experts' bit for bit, in several passes too."""
    local = local_experts()
    resident = fp8_twin(local)
    offloaded = offloaded_from(local, num_slots, host_format="fp8")
    assert offloaded.host.fp8 and offloaded.expert_bytes < local.w_gate_up[0].nbytes + local.w_down[0].nbytes
    generator = torch.Generator().manual_seed(2)
    for num_tokens in (1, 24):                  # decode kernel; grouped kernel in several passes
        hidden = torch.randn(num_tokens, HIDDEN, generator=generator).to(DEVICE, torch.bfloat16)
        topk_ids, topk_weights = routing(num_tokens, generator)
        expected = resident(hidden, topk_ids, topk_weights)
        actual = offloaded(hidden, topk_ids, topk_weights)
        assert torch.equal(actual, expected), (backend, num_slots, num_tokens)
        assert not torch.equal(actual, local(hidden, topk_ids, topk_weights))    # it really is FP8


def test_fp8_model_offloads_as_fp8(backend):
    """An FP8 model (quantized at load) offloads with FP8 host copies whatever host_format says, and its
    greedy tokens and logits equal the resident FP8 model's."""
    from moekv.config import OffloadConfig
    from moekv.models.quantize import quantize_model
    from moekv.moe.prefetch import install_routing

    arch = tiny_arch(num_layers=2)
    model = build_random_model(arch, torch.bfloat16, DEVICE, seed=1)
    quantize_model(model)
    prompt = torch.randint(0, arch.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    expected_tokens, expected_logits = greedy(model, prompt, 3)
    runtime = install_routing(model, OffloadConfig(cpu_offload_experts=True, expert_cache_size=2, prefetch=False),
                              DEVICE)
    assert all(experts.host.fp8 for experts in runtime.offload.layers.values())
    tokens, logits = greedy(model, prompt, 3)
    assert tokens == expected_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, expected_logits))
