"""Reference quantize/dequantize: error bounds, outliers and their budget, edge cases, exact accounting."""

import pytest
import torch

from moekv.kvcache import accounting
from moekv.core.lowbit_layout import PackedPages, QuantSpec
from moekv.ops.reference.lowbit import dequantize_pages, quantize_pages, token_scale_zero


def spec_for(bits, axis, page_size=32, head_dim=64, capacity=0, group_size=None, tau=3.0):
    return QuantSpec(bits=bits, axis=axis, head_dim=head_dim, page_size=page_size, group_size=group_size,
                     outlier_capacity=capacity, outlier_tau=tau)


def elementwise_scale(packed: PackedPages, spec: QuantSpec) -> torch.Tensor:
    """The scale S that applies to each element, [N, H, P, D] fp32."""
    n, h = packed.codes.shape[:2]
    if spec.axis == "channel":
        return packed.scale.float().unsqueeze(2).expand(n, h, spec.page_size, spec.head_dim)
    scale, _ = token_scale_zero(packed.scale, packed.zero, packed.scale_base, spec)
    return scale.repeat_interleave(spec.group_size, dim=-1)


def outlier_mask(packed: PackedPages, spec: QuantSpec) -> torch.Tensor:
    n, h = packed.codes.shape[:2]
    mask = torch.zeros(n, h, spec.page_size * spec.head_dim, dtype=torch.bool)
    for i in range(n):
        for j in range(h):
            count = int(packed.outlier_count[i, j])
            mask[i, j, (packed.outlier_idx[i, j, :count].long() & 0xFFFF)] = True
    return mask.view(n, h, spec.page_size, spec.head_dim)


def without_outliers(packed: PackedPages) -> PackedPages:
    return PackedPages(**{**packed.__dict__, "outlier_vals": torch.zeros_like(packed.outlier_vals)})


def keys_like(n=3, h=2, p=32, d=64, seed=0):
    """Keys with fixed outlier channels (large offset and spread) plus a few spikes."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, p, d, generator=generator)
    x[..., 3] = x[..., 3] * 4 + 12
    x[..., 40] = x[..., 40] * 3 - 7
    x[0, 0, 5, 10] = 30.0
    x[1, 1, 0, 0] = -25.0
    return x


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("axis, group_size", [("channel", None), ("token", None), ("token", 16)])
@pytest.mark.parametrize("capacity", [0, 20])
def test_round_trip_error_bounds(bits, axis, group_size, capacity):
    spec = spec_for(bits, axis, capacity=capacity, group_size=group_size)
    x = keys_like()
    packed, qualifying = quantize_pages(x, spec)
    x_hat = dequantize_pages(packed, spec)
    assert x_hat.shape == x.shape and x_hat.dtype == torch.float32
    mask = outlier_mask(packed, spec)
    scale = elementwise_scale(packed, spec)
    error = (x_hat - x).abs()
    # non-outliers: within half a quantization step (fp32 slack)
    assert (error[~mask] <= scale[~mask] / 2 + 1e-5 * (1 + x.abs()[~mask])).all()
    # outliers: reproduced to the fp16 precision of their residual over the code
    residual = (x - dequantize_pages(without_outliers(packed), spec))[mask]
    assert (error[mask] <= residual.abs() * 2**-11 + 1e-5).all()
    assert int(packed.outlier_count.sum()) == int(mask.sum()) <= capacity * 6
    assert (qualifying >= packed.outlier_count.int()).all()
    if capacity and group_size is None:       # (in 16-wide groups, channel 3's offset outranks the spikes)
        assert mask[0, 0, 5, 10] and mask[1, 1, 0, 0]          # the spikes are kept


def test_outliers_reduce_error():
    x = keys_like()
    errors = []
    for capacity in (0, 40):
        spec = spec_for(3, "token", capacity=capacity)
        packed, _ = quantize_pages(x, spec)
        errors.append(float((dequantize_pages(packed, spec) - x).norm()))
    assert errors[1] < 0.8 * errors[0]


def deviation_scores(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """|x - mean| / std of each element's group, [N, H, P*D] (the definition, written out)."""
    n, h, p, d = x.shape
    if spec.axis == "channel":
        mean, std = x.mean(2, keepdim=True), x.std(2, keepdim=True, correction=0)
        return ((x - mean).abs() / std).reshape(n, h, -1)
    g = x.unflatten(-1, (spec.num_groups, spec.group_size))
    mean, std = g.mean(-1, keepdim=True), g.std(-1, keepdim=True, correction=0)
    return ((g - mean).abs() / std).reshape(n, h, -1)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_budget_keeps_exactly_the_largest_deviations(axis):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 2, 32, 64, generator=generator)
    spikes = torch.randperm(32 * 64, generator=generator)[:60]       # far more candidates than slots
    x.view(2, 2, -1)[..., spikes] += torch.linspace(6, 40, 60)       # distinct magnitudes
    spec = spec_for(3, axis, capacity=10)
    packed, qualifying = quantize_pages(x, spec)
    scores = deviation_scores(x, spec)
    for i in range(2):
        for j in range(2):
            qualified = (scores[i, j] > spec.outlier_tau).nonzero().flatten()
            assert int(qualifying[i, j]) == qualified.numel() > spec.outlier_capacity   # the budget binds
            kept = packed.outlier_idx[i, j].long() & 0xFFFF
            assert int(packed.outlier_count[i, j]) == spec.outlier_capacity
            expected = scores[i, j].topk(spec.outlier_capacity).indices.sort().values
            assert torch.equal(kept, expected)                        # sorted, exactly the top deviations
            dropped = torch.ones_like(scores[i, j], dtype=torch.bool)
            dropped[kept] = False
            assert scores[i, j][kept].min() >= scores[i, j][dropped].max() > spec.outlier_tau   # threshold rose


def test_unused_outlier_slots_are_inert():
    x = torch.linspace(-1, 1, 32 * 64).view(1, 1, 32, 64)            # nothing beyond 3 sigma
    spec = spec_for(4, "channel", capacity=8)
    packed, qualifying = quantize_pages(x, spec)
    assert int(qualifying.sum()) == 0 and int(packed.outlier_count.sum()) == 0
    assert (packed.outlier_vals == 0).all() and (packed.outlier_idx == 0).all()


def test_outliers_saturate_instead_of_overflowing_fp16():
    x = torch.randn(1, 1, 32, 64)
    x[0, 0, 3, 3] = 1e6                                               # finite, beyond fp16 (fp32/bf16 models)
    x[0, 0, 9, 9] = -3e5
    for axis in ("channel", "token"):
        spec = spec_for(3, axis, capacity=4)
        packed, _ = quantize_pages(x, spec)
        x_hat = dequantize_pages(packed, spec)
        assert all(torch.isfinite(t.float()).all() for t in packed.tensors().values())
        assert torch.isfinite(x_hat).all()
        assert 6e4 < x_hat[0, 0, 3, 3] <= 65504 * 1.01 and -65504 * 1.01 <= x_hat[0, 0, 9, 9] < -6e4


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("value", [0.0, 3.0, -1e-3])
def test_constant_groups_do_not_divide_by_zero(axis, value):
    spec = spec_for(2, axis, capacity=4)
    x = torch.full((2, 2, 32, 64), value)
    packed, _ = quantize_pages(x, spec)
    x_hat = dequantize_pages(packed, spec)
    assert torch.isfinite(x_hat).all()
    assert (x_hat - x).abs().max() <= (elementwise_scale(packed, spec) / 2 + 1e-6).max()
    if value == 0.0:
        assert (x_hat == 0).all()


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_single_token_page(axis):
    spec = spec_for(3, axis, page_size=1, capacity=1)
    x = torch.randn(4, 2, 1, 64)
    packed, _ = quantize_pages(x, spec)
    x_hat = dequantize_pages(packed, spec)
    assert (x_hat - x).abs().max() <= (elementwise_scale(packed, spec) / 2 + 1e-5).max()


def test_page_shape_is_checked():
    with pytest.raises(ValueError, match="spec"):
        quantize_pages(torch.zeros(1, 1, 16, 64), spec_for(3, "channel", page_size=32))
    with pytest.raises(ValueError, match="16-bit"):
        spec_for(3, "channel", page_size=2048, head_dim=64)
    with pytest.raises(ValueError, match="divide"):
        spec_for(3, "token", group_size=24)


def test_accounting_matches_a_hand_count():
    key_spec = spec_for(3, "channel", page_size=4, head_dim=32, capacity=2)
    value_spec = spec_for(3, "token", page_size=4, head_dim=32, capacity=2, group_size=16)
    # keys, one head: codes 4 rows x (one triplet group: 3 words) x 4 B = 48; fp16 scale and
    # zero per channel 2 x 32 x 2 = 128; outliers 2 x (2 + 2) = 8; count 2  -> 186 bytes
    assert accounting.packed_page_bytes(key_spec) == 186
    # values: codes 48; uint8 scale and zero codes 4 tokens x 2 groups x 2 = 16; fp16 scale_base 2;
    # outliers 8; count 2 -> 76 bytes
    assert accounting.packed_page_bytes(value_spec) == 76
    for spec in (key_spec, value_spec):
        packed, _ = quantize_pages(torch.randn(5, 3, 4, 32), spec)
        assert packed.nbytes == 5 * accounting.packed_page_bytes(spec, num_kv_heads=3)
        assert PackedPages.empty(spec, 5, 3, "cpu").nbytes == packed.nbytes
    assert accounting.format_bits_per_value(key_spec, value_spec) == (186 + 76) * 8 / (2 * 4 * 32)
    # a sequence of 6 tokens in 4-token pages: 2 low-bit pages + 1 fp16 staging page (2 x 4 x 32 x 2 B = 512)
    bits = accounting.cache_bits_per_value(key_spec, value_spec, 1, 2, [6])
    assert bits == (2 * (186 + 76) + 512) * 8 / (2 * 6 * 32)
    assert accounting.cache_bits_per_value(key_spec, value_spec, 1, 2, [8]) == (186 + 76) * 8 / (2 * 4 * 32)
    # with one fp sink page, an 8-token sequence keeps page 0 in staging too
    assert accounting.pages_held(8, 4, fp_sink_pages=1) == (2, 1)
    assert accounting.pages_held(5, 4, fp_sink_pages=1) == (2, 2)
    assert accounting.pages_held(3, 4, fp_sink_pages=1) == (1, 1)


def test_outlier_capacity_fits_the_16_bit_count():
    """P * D = 65536 at 50 % would need a count of 32768, which int16 stores as -32768."""
    spec_for(3, "token", page_size=4096, head_dim=16, capacity=32767)
    with pytest.raises(ValueError, match="16-bit"):
        spec_for(3, "token", page_size=4096, head_dim=16, capacity=32768)
