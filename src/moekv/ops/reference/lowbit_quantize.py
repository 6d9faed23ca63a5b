"""Reference (pure PyTorch) page quantizer of the low-bit KV format: quantize pages, dequantize pages, and the
token axis's coded scales -- the oracle of the Triton quantizers (ops/triton/lowbit/quantize*.py). Layout and
formulas: core/lowbit_layout.py and docs/kv-format.md. All arithmetic is fp32. The cache-facing ops built on it
(staged pages, paged attention) are in ops/reference/lowbit.py, which re-exports these.
"""

from __future__ import annotations

import math

import torch

from moekv.core.lowbit_layout import CLIP_STEP, SCALE_CODE_STEPS, PackedPages, QuantSpec
from moekv.core.lowbit_order import pack_page_codes, unpack_page_codes

FP16_MAX = 65504.0
FP16_TINY = 2.0 ** -24         # smallest positive fp16 (subnormal): the floor of a channel scale
SCALE_BASE_FLOOR = 2.0 ** -14  # smallest normal fp16: the floor of a token-axis scale_base


def _fp16_rounded(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (fp32, finite) -> fp16 rounded toward +inf (up) or -inf, saturated to +-65504."""
    h = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    toward = torch.full_like(h, float("inf") if up else float("-inf"))
    wrong_side = h.float() < x if up else h.float() > x
    h = torch.where(wrong_side, torch.nextafter(h, toward), h)
    return h.clamp(-FP16_MAX, FP16_MAX)


def token_scale_zero(scale_code: torch.Tensor, zero_code: torch.Tensor, scale_base: torch.Tensor,
                     spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode token-axis scale/zero: codes [N, H, P, G] uint8, scale_base [N, H] fp16 -> S, Z [N, H, P, G] fp32.

    S = scale_base * 2 ** (-scale_code / 16);  Z = -(S * zero_code) * 2 ** -(8 - bits).
    """
    base = scale_base.float()[:, :, None, None]                                   # [N, H, 1, 1]
    scale = base * torch.exp2(-scale_code.float() / SCALE_CODE_STEPS)             # [N, H, P, G]
    zero = -(scale * zero_code.float()) * 2.0 ** -spec.zero_fraction_bits          # [N, H, P, G]
    return scale, zero


def _grouped(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, int]:
    """View x [N, H, P, D] so one quantization group runs along the returned dim."""
    if spec.axis == "channel":
        return x, 2                                                                # groups: [N, H, :, D]
    return x.unflatten(-1, (spec.num_groups, spec.group_size)), -1                 # [N, H, P, G, g]


def _select_outliers(grouped: torch.Tensor, dim: int, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """The budgeted outliers of each (page, head): values beyond tau * std of their group; when more
    qualify than `outlier_capacity`, the largest |x - mean| / std win.

    Returns mask [N, H, P*D] bool, kept flat indices [N, H, C] (sorted, unused = P*D), qualifying [N, H] int32.
    """
    n, h = grouped.shape[:2]
    if spec.outlier_select == "range":
        return _select_outliers_by_range(grouped, dim, spec)
    deviation = _deviation(grouped, dim).reshape(n, h, -1)                        # [N, H, P*D]
    qualifies = deviation > spec.outlier_tau
    num_qualifying = qualifies.sum(-1, dtype=torch.int32)                           # [N, H]
    mask = torch.zeros_like(qualifies)
    size = deviation.shape[-1]
    if spec.outlier_capacity == 0:
        return mask, torch.empty(n, h, 0, dtype=torch.long, device=grouped.device), num_qualifying
    score = torch.where(qualifies, deviation, torch.full_like(deviation, -1.0))
    top_score, top_idx = score.topk(spec.outlier_capacity, dim=-1)                  # [N, H, C]
    kept = top_score > spec.outlier_tau
    mask.scatter_(-1, top_idx, kept)
    kept_idx = torch.where(kept, top_idx, torch.full_like(top_idx, size)).sort(-1).values
    return mask, kept_idx, num_qualifying


def _deviation(grouped: torch.Tensor, dim: int) -> torch.Tensor:
    """|x - mean| / std of each value within its group (std 0: 1), grouped's shape."""
    mean = grouped.mean(dim, keepdim=True)
    std = grouped.std(dim, keepdim=True, correction=0)
    return (grouped - mean).abs() / torch.where(std > 0, std, torch.ones_like(std))


def _num_qualifying(grouped: torch.Tensor, dim: int, spec: QuantSpec) -> torch.Tensor:
    """Values beyond tau * std of their group, per (page, head) [N, H] int32 (the budget-hit statistic)."""
    return (_deviation(grouped, dim) > spec.outlier_tau).flatten(2).sum(-1, dtype=torch.int32)


def _select_outliers_by_range(grouped: torch.Tensor, dim: int, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor,
                                                                                         torch.Tensor]:
    """outlier_select = "range" (docs/kv-format.md §4): `outlier_capacity` greedy steps per (page, head); each
    removes one value from the inliers, the group end (its largest or its smallest inlier) whose removal lowers
    that group's squared range the most. Ranges as the quantizer sees them (token axis: widened to include 0);
    a group keeps at least one inlier; ties go to the lowest flat index; a step whose best gain is negative
    (no group has two inliers left) removes nothing. tau plays no part in the choice (num_qualifying is still
    the count beyond tau * std, the budget-hit statistic). The Triton quantizer runs the same steps in the same
    fp32 arithmetic (quantize_parts.select_by_range). Returns what _select_outliers does."""
    n, h = grouped.shape[:2]
    num_qualifying = _num_qualifying(grouped, dim, spec)
    size = math.prod(grouped.shape[2:])                                             # P * D
    flat = torch.arange(size, device=grouped.device).view(grouped.shape[2:]).expand_as(grouped)
    big = torch.full_like(flat, size)
    out = torch.zeros_like(grouped, dtype=torch.bool)
    inf = torch.full_like(grouped, float("inf"))
    token = spec.axis == "token"
    for _ in range(spec.outlier_capacity):
        inlier = ~out
        count = inlier.sum(dim, keepdim=True)
        hi1 = torch.where(inlier, grouped, -inf).amax(dim, keepdim=True)
        lo1 = torch.where(inlier, grouped, inf).amin(dim, keepdim=True)
        at_hi = torch.where(inlier & (grouped == hi1), flat, big).amin(dim, keepdim=True)
        at_lo = torch.where(inlier & (grouped == lo1), flat, big).amin(dim, keepdim=True)
        hi2 = torch.where(inlier & (flat != at_hi), grouped, -inf).amax(dim, keepdim=True)
        lo2 = torch.where(inlier & (flat != at_lo), grouped, inf).amin(dim, keepdim=True)
        if token:
            hi1, hi2, lo1, lo2 = hi1.clamp(min=0.0), hi2.clamp(min=0.0), lo1.clamp(max=0.0), lo2.clamp(max=0.0)
        span = hi1 - lo1
        top_span, bottom_span = hi2 - lo1, hi1 - lo2
        gain_top = span * span - top_span * top_span
        gain_bottom = span * span - bottom_span * bottom_span
        allowed = count > 1
        gain_top = torch.where(allowed, gain_top, torch.full_like(gain_top, -1.0))
        gain_bottom = torch.where(allowed, gain_bottom, torch.full_like(gain_bottom, -1.0))
        best = torch.maximum(gain_top.flatten(2).amax(-1), gain_bottom.flatten(2).amax(-1))        # [N, H]
        shape = (n, h) + (1,) * (grouped.dim() - 2)
        best_b = best.view(shape)
        pick = torch.minimum(torch.where(gain_top == best_b, at_hi, size).flatten(2).amin(-1),
                             torch.where(gain_bottom == best_b, at_lo, size).flatten(2).amin(-1))   # [N, H]
        pick = torch.where(best >= 0, pick, torch.full_like(pick, size))
        out |= flat == pick.view(shape)
    mask = out.reshape(n, h, size)
    kept_idx = torch.where(mask, flat.reshape(n, h, size), size).sort(-1).values[..., :spec.outlier_capacity]
    return mask, kept_idx, num_qualifying



def _needed(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Token axis: the smallest scale whose codes cover [lo, hi] with the zero code's resolution."""
    return ((hi - lo) / (spec.levels - 2.0 ** -spec.zero_fraction_bits)).clamp_min(FP16_TINY)


def _scale_zero(lo: torch.Tensor, hi: torch.Tensor, scale_base: torch.Tensor | None, spec: QuantSpec):
    """A group range [lo, hi] -> (S, Z fp32, stored scale, stored zero), all shaped like lo (keepdim).

    Channel: Z = fp16 of lo rounded down, S = fp16 of (hi - Z) / L rounded up. Token: the largest
    scale code with S >= needed below `scale_base`, zero_code = ceil(-lo * 2^(8-b) / S) (docs/kv-format.md §3).
    """
    if spec.axis == "channel":
        zero16 = _fp16_rounded(lo, up=False)
        scale16 = _fp16_rounded(((hi - zero16.float()) / spec.levels).clamp_min(FP16_TINY), up=True)
        return scale16.float(), zero16.float(), scale16, zero16
    needed = _needed(lo, hi, spec).squeeze(-1)                                     # [N, H, P, G]
    frac = 2.0 ** spec.zero_fraction_bits
    base = scale_base.float()[:, :, None, None]
    scale_code = torch.floor(-SCALE_CODE_STEPS * torch.log2(needed / base)).clamp(0, 255).to(torch.uint8)
    scale, _ = token_scale_zero(scale_code, scale_code, scale_base, spec)
    scale_code = torch.where(scale < needed, scale_code.clamp_min(1) - 1, scale_code)  # guard log2 rounding
    scale, _ = token_scale_zero(scale_code, scale_code, scale_base, spec)
    zero_code = torch.ceil(-lo.squeeze(-1) * frac / scale).clamp(0, 255).to(torch.uint8)
    scale, zero = token_scale_zero(scale_code, zero_code, scale_base, spec)
    return scale.unsqueeze(-1), zero.unsqueeze(-1), scale_code.unsqueeze(-1), zero_code.unsqueeze(-1)


def _choose_ranges(grouped: torch.Tensor, dim: int, inlier: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   spec: QuantSpec):
    """Scale, zero point and codes per group from its inlier range [lo, hi] (keepdim along `dim`).

    Range search (docs/kv-format.md §3): a candidate (a, b) shrinks the range's low end by a and its high end
    by b steps of CLIP_STEP of its half width (lo + a/16 * w/2, hi - b/16 * w/2); per group the candidate of
    least squared error over its inliers wins, a later candidate only when strictly better. Stage 1: the
    symmetric a = b = k for k = 0..clip_steps (k = 0 is min/max); with clip_refine = R, stage 2 moves the low
    end alone, a = A + j for j = -R..R (j != 0, clamped to [0, clip_steps]), from each group's best (A, B),
    then stage 3 the high end alone likewise. Token axis: scale_base comes from the unshrunk ranges.
    Returns (S, Z fp32 keepdim, stored scale, stored zero, scale_base or None, codes fp32 like grouped).
    """
    scale_base = None
    if spec.axis == "token":
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)                             # the range includes 0
        scale_base = _fp16_rounded(_needed(lo, hi, spec).amax(dim=(2, 3, 4)).clamp_min(SCALE_BASE_FLOOR), up=True)
    half = (hi - lo) * 0.5
    state = {}

    def consider(a: torch.Tensor | float, b: torch.Tensor | float) -> None:
        lo_c = lo if isinstance(a, float) and a == 0 else lo + (a * CLIP_STEP) * half
        hi_c = hi if isinstance(b, float) and b == 0 else hi - (b * CLIP_STEP) * half
        scale, zero, stored_scale, stored_zero = _scale_zero(lo_c, hi_c, scale_base, spec)
        codes = ((grouped - zero) / scale).round().clamp(0, spec.levels)
        candidate = (scale, zero, stored_scale, stored_zero, codes)
        if spec.clip_steps == 0:
            state["best"] = candidate
            return
        diff = codes * scale + zero - grouped
        error = torch.where(inlier, diff * diff, torch.zeros_like(diff)).sum(dim, keepdim=True)
        a = torch.as_tensor(a, device=error.device).expand_as(error)
        b = torch.as_tensor(b, device=error.device).expand_as(error)
        if "best" not in state:
            state.update(best=candidate, error=error, a=a, b=b)
            return
        better = error < state["error"]
        state["best"] = tuple(torch.where(better, new, old) for new, old in zip(candidate, state["best"]))
        state["error"] = torch.where(better, error, state["error"])
        state["a"], state["b"] = torch.where(better, a, state["a"]), torch.where(better, b, state["b"])

    for k in range(spec.clip_steps + 1):
        consider(float(k), float(k))
    for end in ("a", "b") if spec.clip_refine else ():
        start = state[end]
        for j in range(-spec.clip_refine, spec.clip_refine + 1):
            if j == 0:
                continue
            moved = (start + j).clamp(0, spec.clip_steps)
            consider(moved, state["b"]) if end == "a" else consider(state["a"], moved)
    scale, zero, stored_scale, stored_zero, codes = state["best"]
    squeeze = 2 if spec.axis == "channel" else -1
    return scale, zero, stored_scale.squeeze(squeeze), stored_zero.squeeze(squeeze), scale_base, codes


def quantize_pages(x: torch.Tensor, spec: QuantSpec) -> tuple[PackedPages, torch.Tensor]:
    """Quantize full pages: x [N, H, P, D] (any float dtype, finite) -> (PackedPages of N pages,
    num_qualifying [N, H] int32: values that passed tau; > spec.outlier_capacity means the budget bound).
    """
    n, h, p, d = x.shape
    if (p, d) != (spec.page_size, spec.head_dim):
        raise ValueError(f"pages of shape [P={p}, D={d}] do not match the spec's [{spec.page_size}, {spec.head_dim}]")
    xf = x.float().clamp(-FP16_MAX, FP16_MAX)                                      # saturate: see docs
    grouped, dim = _grouped(xf, spec)
    outlier, kept_idx, num_qualifying = _select_outliers(grouped, dim, spec)
    inlier = ~outlier.view(grouped.shape)
    lo = torch.where(inlier, grouped, torch.full_like(grouped, float("inf"))).amin(dim, keepdim=True)
    hi = torch.where(inlier, grouped, torch.full_like(grouped, float("-inf"))).amax(dim, keepdim=True)
    lo = torch.where(torch.isinf(lo), torch.zeros_like(lo), lo)                    # a group of outliers only
    hi = torch.where(torch.isinf(hi), torch.zeros_like(hi), hi)
    scale, zero, stored_scale, stored_zero, scale_base, codes = _choose_ranges(grouped, dim, inlier, lo, hi, spec)
    dequantized = codes * scale + zero
    codes = codes.reshape(n, h, p, d).to(torch.uint8)
    capacity = spec.outlier_capacity
    valid = kept_idx < p * d                                                       # [N, H, C]
    idx = torch.where(valid, kept_idx, torch.zeros_like(kept_idx))
    residual = (grouped - dequantized).reshape(n, h, p * d).gather(-1, idx)        # [N, H, C]
    residual = torch.where(valid, residual.clamp(-FP16_MAX, FP16_MAX), torch.zeros_like(residual))
    packed = PackedPages(
        codes=pack_page_codes(codes, spec), scale=stored_scale, zero=stored_zero, scale_base=scale_base,
        outlier_vals=residual.to(torch.float16).reshape(n, h, capacity),
        outlier_idx=torch.where(idx >= 1 << 15, idx - (1 << 16), idx).to(torch.int16).reshape(n, h, capacity),
        outlier_count=valid.sum(-1).to(torch.int16))
    return packed, num_qualifying


def dequantize_pages(packed: PackedPages, spec: QuantSpec) -> torch.Tensor:
    """PackedPages of N pages -> [N, H, P, D] fp32: S * code + Z, plus each outlier's fp16 residual."""
    codes = unpack_page_codes(packed.codes, spec, torch.float32)                # [N, H, P, D]
    n, h, p, d = codes.shape
    if spec.axis == "channel":
        x = codes * packed.scale.float().unsqueeze(2) + packed.zero.float().unsqueeze(2)
    else:
        scale, zero = token_scale_zero(packed.scale, packed.zero, packed.scale_base, spec)   # [N, H, P, G]
        grouped = codes.unflatten(-1, (spec.num_groups, spec.group_size))          # [N, H, P, G, g]
        x = (grouped * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(-2)
    if spec.outlier_capacity:
        idx = packed.outlier_idx.long() & 0xFFFF                                   # [N, H, C]
        x = x.reshape(n, h, p * d).scatter_add(-1, idx, packed.outlier_vals.float()).view(n, h, p, d)
    return x
