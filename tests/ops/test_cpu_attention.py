"""The CPU path of paged full-precision attention (torch's fused SDPA, ops/cpu/attention.py) against its reference
twin: ragged batches, chunked prefill over cached pages, decode, GQA, page boundaries, adversarial data; and the
dispatch rule (auto on a CPU tensor -> the fused path, backend "reference" -> the twin)."""

import pytest
import torch

from moekv.ops import dispatch
from moekv.ops.cpu import attention as cpu_attention
from moekv.ops.reference import attention as reference
from moekv.testing.attention_cases import DATA_KINDS, build_fp_case, make_data

SCALE = 0.125


def _close(out, ref, dtype):
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("context_lens,query_lens", [
    ([0], [1]),                       # one token, nothing cached
    ([0, 0], [16, 33]),               # prefill, page boundary (16) and past it
    ([15, 16, 17], [1, 1, 1]),        # decode at page - 1 / page / page + 1
    ([40, 5, 0], [24, 1, 7]),         # a mixed step: chunked prefill over cached pages, decode, fresh prompt
])
def test_matches_reference(dtype, group, context_lens, query_lens):
    q, k, v, meta = build_fp_case(context_lens, query_lens, 2, group, 64, 16, dtype, "cpu", seed=len(context_lens))
    out = cpu_attention.paged_attention_full_precision(q, k, v, meta, SCALE)
    _close(out, reference.paged_attention_full_precision(q, k, v, meta, SCALE), dtype)


@pytest.mark.parametrize("kind", DATA_KINDS)
def test_adversarial_data(kind):
    q, k, v, meta = build_fp_case([30, 0], [20, 9], 2, 4, 64, 16, torch.float32, "cpu", seed=3)
    gen = torch.Generator().manual_seed(7)
    k = make_data(k.shape, torch.float32, kind, gen)
    v = make_data(v.shape, torch.float32, kind, gen)
    out = cpu_attention.paged_attention_full_precision(q, k, v, meta, SCALE)
    ref = reference.paged_attention_full_precision(q, k, v, meta, SCALE)
    assert torch.isfinite(ref).all()
    _close(out, ref, torch.float32)


def test_dispatch_takes_the_fused_path_on_cpu(monkeypatch):
    q, k, v, meta = build_fp_case([8], [4], 2, 4, 64, 16, torch.float32, "cpu")
    calls = []
    real = cpu_attention.paged_attention_full_precision
    monkeypatch.setattr(cpu_attention, "paged_attention_full_precision",
                        lambda *a: calls.append("cpu") or real(*a))
    with dispatch.override(backend="auto"):
        dispatch.paged_attention_full_precision(q, k, v, meta, SCALE)
    assert calls == ["cpu"]
    with dispatch.override(backend="reference"):
        dispatch.paged_attention_full_precision(q, k, v, meta, SCALE)
    assert calls == ["cpu"]                   # "reference" forces the twin
