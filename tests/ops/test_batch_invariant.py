"""The batch-invariant mode's kernels (KernelConfig.batch_invariant): the invariant GEMM against its twin, and row
invariance -- a row computed inside batches of other sizes and other rows gives the same bits (torch.equal) -- for
the GEMM, the MoE experts and full-precision attention (decode with host-planned and CUDA-graph split counts,
prefill chunks, and a decode row against the same row in a prefill chunk).

On CPU the Triton kernels run under the interpreter (numpy arithmetic): equality there checks the kernels' logic
(fixed tiles, fixed split boundaries, masks, merge order), not a GPU's rounding; on a CUDA machine the same tests
run the compiled kernels (the `device` fixture) and are the GPU check. The row-by-row twins (the mode's CPU path)
are checked for invariance too. Without the mode the decode and prefill kernels give a row different bits
(test_without_the_mode_decode_and_prefill_differ keeps these tests honest).
"""

from __future__ import annotations

import pytest
import torch

from moekv.core.attention_metadata import AttentionMetadata
from moekv.core.fp8 import quantize_fp8
from moekv.ops import dispatch
from moekv.ops.reference.attention import causal_attention_reference
from moekv.ops.reference.invariant_linear import invariant_linear as linear_reference
from moekv.ops.reference.moe import moe_experts_reference
from moekv.ops.triton.attention import invariant as attention_invariant
from moekv.ops.triton.attention.decode import paged_decode_full_precision
from moekv.ops.triton.attention.prefill import paged_prefill_full_precision
from moekv.ops.triton.layer.invariant_linear import invariant_linear
from tests.ops.helpers import assert_close

_EPS = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _data(kind: str, shape, gen, dtype):
    x = torch.randn(shape, generator=gen)
    if kind == "heavy_tail":                       # log-normal magnitudes over ~8 decades
        x = x * torch.exp(2.0 * torch.randn(shape, generator=gen)).clamp(max=30.0 if dtype == torch.float16 else 1e6)
    elif kind == "spikes":                         # a few huge entries among ordinary ones
        mask = torch.rand(shape, generator=gen) < 0.01
        x = torch.where(mask, x.sign() * (200.0 if dtype == torch.float16 else 1e4), x)
    return x.to(dtype)


def _assert_gemm_close(out, x, w, bias):
    """|kernel - twin| <= 2 (K + 1) u S + eps(dtype) |twin|: both sum the same exact products in fp32 in different
    orders (see tests/ops/test_skinny_gemm.py), then round once."""
    ref = linear_reference(x, w, bias).float()
    wf = w.dequantize() if hasattr(w, "dequantize") else w.float()
    s = x.float().abs() @ wf.abs().t() + (0 if bias is None else bias.float().abs())
    bound = 2 * (x.shape[1] + 1) * 2.0 ** -24 * s + _EPS[x.dtype] * ref.abs() + 1e-30
    assert torch.isfinite(out.float()).all()
    assert ((out.float() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["normal", "heavy_tail", "spikes"])
def test_gemm_matches_its_twin(device, dtype, kind):
    gen = torch.Generator().manual_seed(_EPS[dtype].hex().__len__() * 7 + len(kind))
    k, n = 100, 90                                 # neither a multiple of the 64-wide tiles
    w = _data(kind, (n, k), gen, dtype).to(device) * 0.1
    bias = _data("normal", (n,), gen, dtype).to(device)
    for m in (1, 3, 70):                           # one row, ragged, more than one row tile
        x = _data(kind, (m, k), gen, dtype).to(device)
        _assert_gemm_close(invariant_linear(x, w, bias), x, w, bias)
        _assert_gemm_close(invariant_linear(x, w), x, w, None)


@pytest.mark.parametrize("block", [None, (16, 32)])
def test_gemm_fp8_weights(device, block):
    gen = torch.Generator().manual_seed(7)
    w = quantize_fp8(torch.randn(80, 96, generator=gen), block)
    w = type(w)(w.codes.to(device), w.scale.to(device), w.block)
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16).to(device)
    _assert_gemm_close(invariant_linear(x, w), x, w, None)
    rows = torch.randn(20, 96, generator=gen).to(torch.bfloat16).to(device)
    assert torch.equal(invariant_linear(rows[3:4], w), invariant_linear(rows, w)[3:4])


def _embedded(rows: torch.Tensor, m: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of m rows holding rows[:n] (n = min(m, len)) at random positions among random others."""
    n = min(m, rows.shape[0])
    batch = torch.randn((m, rows.shape[1]), generator=gen).to(rows.dtype).to(rows.device) * 3
    where = torch.randperm(m, generator=gen)[:n]
    batch[where] = rows[:n]
    return batch, where


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_rows_are_batch_invariant(device, dtype):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(72, 136, generator=gen).to(dtype).to(device)
    bias = torch.randn(72, generator=gen).to(dtype).to(device)
    rows = torch.randn(64, 136, generator=gen).to(dtype).to(device)
    for fn in (invariant_linear, linear_reference):
        alone = torch.cat([fn(rows[i:i + 1], w, bias) for i in range(rows.shape[0])])
        for m in (1, 3, 17, 64, 100):
            batch, where = _embedded(rows, m, gen)
            assert torch.equal(fn(batch, w, bias)[where], alone[:where.numel()]), (fn.__module__, m)


def test_layers_take_the_invariant_gemm_in_the_mode(device, monkeypatch):
    from moekv.layers.linear import Linear

    calls = []
    original = dispatch.invariant_linear
    monkeypatch.setattr(dispatch, "invariant_linear", lambda *a: calls.append(a) or original(*a))
    layer = Linear(16, 8, True, torch.bfloat16, device)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 16).to(torch.bfloat16).to(device)
    with dispatch.override(batch_invariant=True):
        out = layer(x)
        assert dispatch.fused_decode_layer() is False and dispatch.fused_moe_combine() is False
        logits = dispatch.skinny_linear(x, layer.weight)         # router and lm_head go through skinny_linear
    assert len(calls) == 1 and torch.equal(logits, linear_reference(x, layer.weight))
    assert torch.equal(out, linear_reference(x, layer.weight, layer.bias))
    assert dispatch.fused_decode_layer() is True                 # back to the defaults outside the block


# -- MoE ------------------------------------------------------------------------------------------------------
def _moe_case(gen, dtype, device, num_tokens=64, experts=4, hidden=32, inter=48, top_k=2):
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype).to(device)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype).to(device)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    logits = torch.randn(num_tokens, experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, w_gate_up, w_down, ids.to(device), weights.to(device)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_moe_rows_are_batch_invariant(device, backend):
    """The grouped path with its one config for every T (Triton), or the row-wise twin (auto on CPU)."""
    gen = torch.Generator().manual_seed(11)
    x, w_gate_up, w_down, ids, weights = _moe_case(gen, torch.bfloat16, device)
    with dispatch.override(batch_invariant=True, backend=backend):
        if backend == "triton":
            assert dispatch.moe_experts_path(x[:1], 4, 48) == "grouped"     # no decode path at T = 1
        full = dispatch.moe_experts(x, w_gate_up, w_down, ids, weights)
        assert_close(full, moe_experts_reference(x, w_gate_up, w_down, ids, weights), torch.bfloat16)
        for m, start in ((1, 5), (3, 0), (17, 40)):
            part = dispatch.moe_experts(x[start:start + m], w_gate_up, w_down, ids[start:start + m],
                                        weights[start:start + m])
            assert torch.equal(part, full[start:start + m]), m
        # the same tokens among other tokens (other experts' loads, other slot positions)
        order = torch.randperm(64, generator=gen).to(device)
        shuffled = dispatch.moe_experts(x[order], w_gate_up, w_down, ids[order], weights[order])
        assert torch.equal(shuffled, full[order])


# -- attention ------------------------------------------------------------------------------------------------
P, HKV, GROUP, D, SCALE = 16, 2, 4, 32, 32 ** -0.5
TARGET = 300                    # the sequence under test: keys 0..299 (two splits of 256)


def _pool(device, dtype=torch.bfloat16, pages=80):
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(pages, P, HKV, D, generator=gen).to(dtype).to(device)
    values = torch.randn(pages, P, HKV, D, generator=gen).to(dtype).to(device)
    queries = torch.randn(TARGET, HKV * GROUP, D, generator=gen).to(dtype).to(device)
    perm = torch.randperm(pages, generator=gen).tolist()
    return keys, values, queries, perm


def _decode(keys, values, queries, tables, lens, pos_of_target, index, num_splits=None):
    """Decode the batch whose sequence `index` is the target at position pos_of_target (others: random queries)."""
    batch = len(lens)
    q = torch.randn(batch, HKV * GROUP, D).to(queries.dtype).to(queries.device)
    q[index] = queries[pos_of_target]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=queries.device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=queries.device)
    out = paged_decode_full_precision(q, keys, values, table, seq_lens, max(lens), SCALE, num_splits=num_splits,
                                      invariant=True)
    return out[index]


def test_decode_rows_do_not_depend_on_the_batch_or_the_graph_bucket(device):
    keys, values, queries, perm = _pool(device)
    target = perm[:-(-TARGET // P)]
    others = [perm[20:60], perm[60:62], perm[62:63]]            # 640 keys (3 splits), 20, 5
    pos = TARGET - 1
    alone = _decode(keys, values, queries, [target], [TARGET], pos, 0)
    cases = [([others[1], target], [20, TARGET], 1, None),       # a shorter companion: 2 splits planned
             ([others[0], target, others[2]], [640, TARGET, 5], 1, None),   # a longer one: 3 splits planned
             ([target, others[2]], [TARGET, 5], 0, attention_invariant.num_splits(2048))]   # a graph bucket's count
    for tables, lens, index, splits in cases:
        assert torch.equal(_decode(keys, values, queries, tables, lens, pos, index, splits), alone), (lens, splits)
    ref = causal_attention_reference(queries[pos:pos + 1], *_gather(keys, values, target, TARGET), pos, SCALE)
    assert_close(alone, ref[0], torch.bfloat16)


def _gather(keys, values, table, length):
    pages = torch.tensor(table, dtype=torch.long, device=keys.device)
    return keys.index_select(0, pages).flatten(0, 1)[:length], values.index_select(0, pages).flatten(0, 1)[:length]


def _prefill(keys, values, queries, chunks):
    """chunks: [(table, context_len, query_len, queries or None)] -> the kernel's output per chunk."""
    qs = [q if q is not None else torch.randn(n, HKV * GROUP, D).to(queries.dtype).to(queries.device)
          for _, _, n, q in chunks]
    meta = AttentionMetadata.build([n for _, _, n, _ in chunks], [c for _, c, _, _ in chunks],
                                   [t for t, _, _, _ in chunks], P, queries.device)
    out = paged_prefill_full_precision(torch.cat(qs), keys, values, meta.block_tables, meta.query_start_loc,
                                       meta.context_lens, meta.max_query_len, SCALE, invariant=True)
    return out.split([n for _, _, n, _ in chunks])


def test_prefill_rows_do_not_depend_on_the_chunk_and_equal_decode(device):
    keys, values, queries, perm = _pool(device)
    target = perm[:-(-TARGET // P)]
    whole = _prefill(keys, values, queries, [(target, 0, TARGET, queries)])[0]             # one cold chunk
    hit = _prefill(keys, values, queries, [(perm[30:34], 10, 50, None),                      # a prefix-cache hit:
                                           (target, 256, TARGET - 256, queries[256:])])[1]   # the tail only
    assert torch.equal(hit, whole[256:])
    chunked = _prefill(keys, values, queries, [(target, 100, 37, queries[100:137])])[0]      # a middle chunk
    assert torch.equal(chunked, whole[100:137])
    for pos in (0, 255, 256, TARGET - 1):                     # decode rows: the same bits as the prefill rows
        assert torch.equal(_decode(keys, values, queries, [target[:pos // P + 1]], [pos + 1], pos, 0), whole[pos])
    assert_close(whole, causal_attention_reference(queries, *_gather(keys, values, target, TARGET), 0, SCALE),
                 torch.bfloat16)


def test_dispatch_routes_attention_in_the_mode(device):
    """Through ops.dispatch: the Triton path with a graph bucket's fixed split count, and on the CPU the row-wise
    twin (each token alone), whose decode row equals its prefill row."""
    keys, values, queries, perm = _pool(device, torch.float32)
    target = perm[:-(-TARGET // P)]
    pos = TARGET - 1
    meta = AttentionMetadata.build([TARGET], [0], [target], P, device)
    decode_meta = AttentionMetadata.build([1], [pos], [target], P, device)
    for backend in ("triton", "auto"):
        with dispatch.override(batch_invariant=True, backend=backend):
            whole = dispatch.paged_attention_full_precision(queries, keys, values, meta, SCALE)
            decode_meta.fixed_num_splits = attention_invariant.num_splits(1024) if backend == "triton" else None
            row = dispatch.paged_attention_full_precision(queries[pos:pos + 1], keys, values, decode_meta, SCALE)
        assert torch.equal(row[0], whole[pos]), backend
        assert_close(whole, causal_attention_reference(queries, *_gather(keys, values, target, TARGET), 0, SCALE),
                     torch.float32)


def test_without_the_mode_decode_and_prefill_differ(device):
    """The default kernels plan splits by the batch and walk keys differently in decode and prefill: the same row
    differs in its last bits (what the mode removes; if this starts failing the tests above lost their teeth)."""
    keys, values, queries, perm = _pool(device)
    target = perm[:-(-TARGET // P)]
    meta = AttentionMetadata.build([TARGET], [0], [target], P, device)
    whole = paged_prefill_full_precision(queries, keys, values, meta.block_tables, meta.query_start_loc,
                                         meta.context_lens, meta.max_query_len, SCALE)
    rows = [paged_decode_full_precision(queries[pos:pos + 1], keys, values, meta.block_tables,
                                        torch.tensor([pos + 1], dtype=torch.int32, device=device), pos + 1, SCALE,
                                        num_splits=splits)[0]
            for pos in (TARGET - 1, 260, 200) for splits in (1, 3)]
    expected = [whole[pos] for pos in (TARGET - 1, 260, 200) for _ in (1, 3)]
    assert not all(torch.equal(a, b) for a, b in zip(rows, expected))


def _ptxas_bundled() -> bool:
    import importlib.util
    import os

    spec = importlib.util.find_spec("triton.backends.nvidia")
    return spec is not None and os.path.exists(os.path.join(os.path.dirname(spec.origin), "bin", "ptxas"))


@pytest.mark.skipif(not _ptxas_bundled(), reason="Triton's NVIDIA backend (bundled ptxas) is not installed")
def test_kernels_compile_for_sm90_with_one_dot_instruction():
    """What the interpreter cannot show: the mode's kernels compile for an H100 / H200 (no GPU needed), and the decode
    and the prefill kernel's score and value dots lower to the same instruction (wgmma, 64-row tiles in both), so
    a decode row and a prefill row are multiplied alike."""
    from tests.ops.ptx_compile import ptx_in_child

    ptx = dict(zip(["decode", "linear", "linear_fp8", "merge", "prefill"],
                   ptx_in_child("[p[k] for p in [compile_batch_invariant()] for k in sorted(p)]")))
    for name in ("decode", "prefill", "linear"):
        assert "wgmma.mma_async" in ptx[name] and "mma.sync" not in ptx[name], name
    assert ".entry" in ptx["merge"] and ".entry" in ptx["linear_fp8"]
