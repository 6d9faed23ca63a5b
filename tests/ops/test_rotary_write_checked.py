"""The checked write of q/k norm + rotary + KV write (ops.triton.layer.rotary_write, WRITE 2; the low-bit
cache's decode staging folded into the rotary launch) against its reference twin and against the unfused
composition (reference rotary, then ops.reference.lowbit.stage_decode_tokens): flags only ever set, a token
with a NaN / Inf anywhere in its key or value rows (all kv heads) written as zeros to its row and its copies,
finite tokens' rows exactly the rotated key and the (clipped) value, padding tokens sharing a row (each element from one of them),
rows not written untouched; and the dispatch's fallback where the kernel does not take the rows' dtype
(rounded to it before the check)."""

from __future__ import annotations

import pytest
import torch

from moekv.layers.rotary import RotaryEmbedding
from moekv.ops import dispatch
from moekv.ops.reference import layers as ref
from moekv.ops.reference.lowbit import stage_decode_tokens
from moekv.ops.triton.layer import rotary_write
from tests.ops.test_layer_kernels import _rand

ROWS, FILL = 10, 7.0
SLOTS = [6, 0, 3, 8, 5, 5]           # tokens 4 and 5: padding sharing a row
PRESET = [False, False, False, True, False, True]     # flags already set by an earlier layer


def _inputs(dtype, device, hq, hkv, head_dim, seed):
    num_tokens = len(SLOTS)
    qkv = _rand((num_tokens, (hq + 2 * hkv) * head_dim), dtype, device, seed, scale=2.0)
    q = qkv[:, :hq * head_dim].reshape(num_tokens, hq, head_dim)                  # strided views, as the layer's
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].reshape(num_tokens, hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim:].reshape(num_tokens, hkv, head_dim)
    k[1, hkv - 1, 3] = float("nan")                       # a NaN in the last kv head's key
    v[2, 0, head_dim - 1] = float("inf")                  # an Inf in a value
    positions = torch.tensor([0, 5, 77, 300, 1, 2], device=device)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, device)(positions, dtype)
    return q, k, v, cos, sin


def _target(dtype, device, hkv, head_dim):
    """key rows, value rows, slots, flags, key copy, value copy (the copies prefilled with garbage)."""
    rows = [torch.full((ROWS, hkv, head_dim), FILL, dtype=dtype, device=device) for _ in range(2)]
    copies = [torch.full((len(SLOTS), hkv, head_dim), -3.0, dtype=dtype, device=device) for _ in range(2)]
    flags = torch.tensor(PRESET, device=device)
    return (*rows, torch.tensor(SLOTS, device=device), flags, *copies)


def _check_written(target, k_rot, v_clipped, expect_bad):
    """The rows and copies as stage_decode_tokens writes them, from the rotated key / clipped value."""
    key_rows, value_rows, slots, flags, key_copy, value_copy = target
    bad = ~(torch.isfinite(k_rot).flatten(1).all(1) & torch.isfinite(v_clipped).flatten(1).all(1))
    assert bad.tolist() == expect_bad
    assert flags.tolist() == [a or b for a, b in zip(PRESET, bad.tolist())]          # OR: preset flags stay
    keep = (~bad)[:, None, None]
    want_k = torch.where(keep, k_rot, torch.zeros_like(k_rot))
    want_v = torch.where(keep, v_clipped, torch.zeros_like(v_clipped))
    assert torch.equal(key_copy, want_k) and torch.equal(value_copy, want_v)
    for t, slot in enumerate(SLOTS[:4]):
        assert torch.equal(key_rows[slot], want_k[t]) and torch.equal(value_rows[slot], want_v[t]), t
    # tokens 4 and 5 share row 5: their programs store it concurrently, so on a GPU each element holds one of the
    # two tokens' values (rows of padding tokens are scratch, never read for a real sequence)
    assert ((key_rows[5] == want_k[4]) | (key_rows[5] == want_k[5])).all()
    assert ((value_rows[5] == want_v[4]) | (value_rows[5] == want_v[5])).all()
    untouched = [r for r in range(ROWS) if r not in SLOTS]
    assert (key_rows[untouched] == FILL).all() and (value_rows[untouched] == FILL).all()
    for t in (t for t, b in enumerate(expect_bad) if b):                 # the bad tokens' rows: zeros
        assert (key_rows[SLOTS[t]] == 0).all() and (value_rows[SLOTS[t]] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,head_dim,norm,clip", [(4, 2, 16, "none", None), (6, 2, 32, "head", 1.5),
                                                       (2, 1, 8, "full", None)])
def test_checked_write_matches_reference(device, dtype, hq, hkv, head_dim, norm, clip):
    q, k, v, cos, sin = _inputs(dtype, device, hq, hkv, head_dim, seed=31)
    sizes = {"none": None, "head": (head_dim, head_dim), "full": (hq * head_dim, hkv * head_dim)}[norm]
    weights = (None, None) if sizes is None else (_rand((sizes[0],), dtype, device, 32),
                                                  _rand((sizes[1],), dtype, device, 33))
    assert rotary_write.supports(q, k, v, cos, sin, *_target(dtype, device, hkv, head_dim)[:3], *weights,
                                 *_target(dtype, device, hkv, head_dim)[3:])
    got = _target(dtype, device, hkv, head_dim)
    q_out, k_out = rotary_write.qk_norm_rotary_write(q, k, v, cos, sin, *got[:3], *weights, 1e-6, clip, *got[3:])
    want = _target(dtype, device, hkv, head_dim)
    q_ref, k_ref = ref.qk_norm_rotary_write(q, k, v, cos, sin, *want[:3], *weights, 1e-6, clip, *want[3:])
    v_clipped = v if clip is None else v.clamp(-clip, clip)
    expect_bad = [False, True, clip is None, False, False, False]     # the Inf value clipped: finite
    _check_written(got, k_out, v_clipped, expect_bad)   # the kernel's own rotated key (unzeroed) as it returns it
    _check_written(want, k_ref, v_clipped, expect_bad)
    if norm == "none":                              # elementwise: bit for bit the reference, rows and all
        assert torch.equal(q_out, q_ref) and torch.equal(k_out.isnan(), k_ref.isnan())
        assert torch.equal(k_out.nan_to_num(), k_ref.nan_to_num())
        private = [r for r in range(ROWS) if r != 5]             # row 5: the padding tokens' race (above)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a[private], b[private]) if i < 2 else torch.equal(a, b), i
    # the plain write of the same tokens stores the same finite rows (the checked mode changes nothing else)
    plain = [torch.full((ROWS, hkv, head_dim), FILL, dtype=dtype, device=device) for _ in range(2)]
    q_plain, k_plain = rotary_write.qk_norm_rotary_write(q, k, v, cos, sin, *plain, got[2], *weights, 1e-6, clip)
    assert torch.equal(q_plain, q_out) and torch.equal(k_plain.nan_to_num(), k_out.nan_to_num())
    for slot in (6, 8):                             # tokens 0 and 3: finite
        assert torch.equal(plain[0][slot], got[0][slot]) and torch.equal(plain[1][slot], got[1][slot])


def test_checked_write_equals_rotary_then_stage(device):
    """The fused launch against the two launches it replaces: rotary (reference), then the staging write."""
    dtype, hkv, head_dim = torch.bfloat16, 2, 16
    q, k, v, cos, sin = _inputs(dtype, device, 4, hkv, head_dim, seed=34)
    got = _target(dtype, device, hkv, head_dim)
    rotary_write.qk_norm_rotary_write(q, k, v, cos, sin, *got[:3], None, None, 1e-6, None, *got[3:])
    want = _target(dtype, device, hkv, head_dim)
    _, k_rot = ref.apply_rotary_qk(q, k, cos, sin)
    stage_decode_tokens(k_rot, v, want[0].unsqueeze(1), want[1].unsqueeze(1), want[2], want[3], want[4], want[5])
    for t in (0, 2, 3, 4, 5):                       # the shared row 5 aside, every row and copy the same
        assert torch.equal(got[4][t], want[4][t]) and torch.equal(got[5][t], want[5][t]), t
    assert torch.equal(got[3], want[3])
    for slot in (6, 0, 3, 8):
        assert torch.equal(got[0][slot], want[0][slot]) and torch.equal(got[1][slot], want[1][slot])


def test_checked_write_supports():
    dtype, device = torch.bfloat16, "cpu"
    q, k, v, cos, sin = _inputs(dtype, device, 4, 2, 16, seed=35)
    rows_k, rows_v, slots, flags, copy_k, copy_v = _target(dtype, device, 2, 16)
    args = (q, k, v, cos, sin, rows_k, rows_v, slots, None, None)
    assert rotary_write.supports(*args, flags, copy_k, copy_v)
    assert not rotary_write.supports(*args, flags.to(torch.uint8), copy_k, copy_v)       # flags must be bool
    assert not rotary_write.supports(*args, flags, copy_k.float(), copy_v.float())       # copies of q's dtype
    assert not rotary_write.supports(*args, flags, copy_k[:3], copy_v[:3])               # one per token
    assert not rotary_write.supports(*args, flags, None, None)
    assert not rotary_write.supports(q, k, v, cos, sin, None, None, None, None, None, flags, copy_k, copy_v)
    with pytest.raises(ValueError, match="checked"):
        ref.qk_norm_rotary_write(q, k, v, cos, sin, flags=flags, key_copy=copy_k, value_copy=copy_v)


def test_dispatch_fallback_rounds_to_the_rows_dtype_before_the_check(device, triton_backend, monkeypatch):
    """fp32 q/k/v and fp16 rows: not the kernel's (supports); dispatch composes rotary and the Triton staging
    kernel, after rounding to fp16, so a value beyond fp16's range is Inf there: flagged and zeroed."""
    calls = []
    monkeypatch.setattr(rotary_write, "qk_norm_rotary_write", lambda *a, **k: calls.append("fused"))
    q, k, v, cos, sin = _inputs(torch.float32, device, 4, 2, 16, seed=36)
    k[1] = 1.0                                      # token 1 finite in the key ...
    v[2] = 1.0
    v[1, 0, 0] = 1e5                                # ... but its value is Inf in fp16
    target = _target(torch.float16, device, 2, 16)
    q_out, k_out = dispatch.qk_norm_rotary_write(q, k, v, cos, sin, *target[:3], flags=target[3],
                                                 key_copy=target[4], value_copy=target[5])
    assert calls == []
    _check_written(target, k_out.half(), v.half(), [False, True, False, False, False, False])
    assert target[3].tolist() == [False, True, False, True, False, True]
