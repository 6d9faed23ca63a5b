"""FP8 weights: float8_e4m3fn codes with float32 scales over blocks of the weight (the record, quantize, dequantize).

A weight W [..., N, K] (N output features, K input features; leading dims: experts) is held as

    codes [..., N, K]           float8_e4m3fn
    scale [..., ceil(N / bn), ceil(K / bk)]  float32,   W[..., n, k] ~= codes[..., n, k] * scale[..., n // bn, k // bk]

with block = (bn, bk). The layouts checkpoints and moekv use are all this one record:
  - block-wise (DeepSeek-V3 / Qwen3 FP8 checkpoints, `weight_scale_inv`): block (128, 128);
  - per output channel (`--quantization fp8`, per-channel `weight_scale`): block (1, K), scale [..., N, 1];
  - per tensor (FP8 Mixtral checkpoints' scalar `weight_scale`): stored per channel, the one scale repeated
    (`per_channel_scale`), which is exact.
The scale multiplies (a checkpoint's `weight_scale_inv` is, despite its name, the dequantization
multiplier). e4m3 holds |x| <= 448 with 3 mantissa bits; quantize_fp8 clamps to that range (no NaN, no inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.errors import ConfigError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                      # torch.finfo(torch.float8_e4m3fn).max


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale shape of a weight of `shape` [..., N, K] under `block` (bn, bk)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


@dataclass(frozen=True)
class Fp8Weight:
    """codes [..., N, K] float8_e4m3fn, scale [..., ceil(N/bn), ceil(K/bk)] float32, block (bn, bk)."""

    codes: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self) -> None:
        if self.codes.dtype != FP8_DTYPE:
            raise ConfigError(f"FP8 weight codes must be float8_e4m3fn, got {self.codes.dtype}")
        if self.scale.dtype != torch.float32:
            raise ConfigError(f"FP8 weight scales must be float32, got {self.scale.dtype}")
        bn, bk = self.block
        if not (isinstance(bn, int) and isinstance(bk, int) and bn >= 1 and bk >= 1):
            raise ConfigError(f"FP8 weight block must be two positive integers, got {self.block!r}")
        if tuple(self.scale.shape) != scale_shape(tuple(self.codes.shape), self.block):
            raise ConfigError(f"FP8 weight of shape {list(self.codes.shape)} with block {list(self.block)} needs "
                              f"scales of shape {list(scale_shape(tuple(self.codes.shape), self.block))}, got "
                              f"{list(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size()

    def __getitem__(self, index: int) -> "Fp8Weight":
        """One slice of the leading (expert) dimension."""
        return Fp8Weight(self.codes[index], self.scale[index], self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """codes * scale (in fp32), as `dtype`: [..., N, K]."""
        rows, cols = self.codes.shape[-2:]
        return (self.codes.float() * expand_scale(self.scale, self.block, rows, cols)).to(dtype)   # [..., N, K]


def k_tile_cap(weight, reduced: int | None = None) -> int | None:
    """The largest power of two dividing the scale-block width of an Fp8Weight (anything else: None) whose
    blocks are narrower than the reduced size (default: its last dimension), else None: the widest K tile of a
    kernel that never crosses a scale block."""
    if not isinstance(weight, Fp8Weight):
        return None
    width = weight.block[1]
    return width & -width if width < (weight.shape[-1] if reduced is None else reduced) else None


def expand_scale(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Block scales [..., ceil(N/bn), ceil(K/bk)] -> one scale per element [..., N, K]."""
    full = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return full.repeat_interleave(block[1], dim=-1)[..., :cols]


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] | None = None) -> Fp8Weight:
    """weight [..., N, K] -> Fp8Weight with scale = amax / 448 per block (None: per output channel,
    block (1, K)). All-zero blocks get scale 1 (their codes are 0). Values are clamped to +-448 before the
    cast, so nothing becomes NaN or inf."""
    rows, cols = weight.shape[-2:]
    block = (1, cols) if block is None else tuple(block)
    bn, bk = block
    padded_rows, padded_cols = -(-rows // bn) * bn, -(-cols // bk) * bk
    w = weight.float()
    if (padded_rows, padded_cols) != (rows, cols):
        w = torch.nn.functional.pad(w, (0, padded_cols - cols, 0, padded_rows - rows))
    lead = w.shape[:-2]
    blocks = w.reshape(*lead, padded_rows // bn, bn, padded_cols // bk, bk)
    amax = blocks.abs().amax(dim=(-3, -1))                                                # [..., N/bn, K/bk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    codes = codes.reshape(*lead, padded_rows, padded_cols)[..., :rows, :cols].to(FP8_DTYPE)
    return Fp8Weight(codes.contiguous(), scale.contiguous(), block)


def quantize_per_expert(weight: torch.Tensor, block: tuple[int, int] | None = None) -> Fp8Weight:
    """quantize_fp8 of weight [E, N, K], one expert at a time (bounds the fp32 temporaries to one expert)."""
    parts = [quantize_fp8(weight[expert], block) for expert in range(weight.shape[0])]
    return Fp8Weight(torch.stack([p.codes for p in parts]), torch.stack([p.scale for p in parts]), parts[0].block)


def encode_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> Fp8Weight:
    """weight [..., N, K] with given block scales: codes = clamp(weight / scale, +-448) (static scales; spikes
    beyond 448 * scale saturate at +-448, as e4m3 has no inf)."""
    scale = scale.float().to(weight.device)
    full = expand_scale(scale, tuple(block), *weight.shape[-2:])                          # [..., N, K]
    codes = (weight.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(codes, scale, tuple(block))


def per_channel_scale(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A checkpoint's `weight_scale` for a weight of `shape` [..., N, K] -> [..., N, 1] float32: one scale
    per tensor ([] / [1]), per leading index (e.g. per expert: [E] / [E, 1, 1]) or per output channel
    ([..., N] / [..., N, 1]), repeated where it covers more than one channel (exact)."""
    *lead, rows, _ = shape
    scale = scale.float()
    lead_numel = 1
    for size in lead:
        lead_numel *= size
    if scale.numel() == lead_numel * rows:
        return scale.reshape(*lead, rows, 1).contiguous()
    if scale.numel() == 1:
        return scale.reshape([1] * len(shape)).expand(*lead, rows, 1).contiguous()
    if scale.numel() == lead_numel:
        return scale.reshape(*lead, 1, 1).expand(*lead, rows, 1).contiguous()
    raise ConfigError(f"a weight_scale of shape {list(scale.shape)} fits neither one scale per tensor nor one "
                      f"per output channel of a weight of shape {list(shape)}")


def rowwise(weight: Fp8Weight) -> Fp8Weight:
    """The same values with one scale row per weight row (block (1, bk)): exact; lets weights whose row
    counts are not multiples of bn be concatenated along N."""
    if weight.block[0] == 1:
        return weight
    scale = expand_scale(weight.scale, (weight.block[0], 1), weight.codes.shape[-2], weight.scale.shape[-1])
    return Fp8Weight(weight.codes, scale.contiguous(), (1, weight.block[1]))


def concat_rows(parts: list[Fp8Weight]) -> Fp8Weight:
    """Concatenate FP8 weights along N (fused qkv, gate|up): kept block-wise when every part's row count is a
    multiple of bn and all blocks agree, else one scale row per weight row."""
    blocks = {part.block for part in parts}
    cols = {part.codes.shape[-1] for part in parts}
    if len(cols) != 1:
        raise ConfigError(f"cannot concatenate FP8 weights of different widths {sorted(cols)}")
    if len(blocks) != 1 or any(part.codes.shape[-2] % part.block[0] for part in parts):
        parts = [rowwise(part) for part in parts]
        if len({part.block for part in parts}) != 1:
            raise ConfigError(f"cannot concatenate FP8 weights with blocks {sorted(blocks)}")
    return Fp8Weight(torch.cat([p.codes for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=-2),
                     parts[0].block)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row activation quantization (W8A8): x [M, K] -> (codes [M, K] float8_e4m3fn, scale [M] float32)
    with scale = amax(|row|) / 448 (1 for an all-zero row), x[m] ~= codes[m] * scale[m]."""
    rows = x.float()
    amax = rows.abs().amax(dim=-1)                                                        # [M]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """quantize_rows then back to fp32: what a W8A8 kernel's dot sees of x [M, K] (the reference's input)."""
    codes, scale = quantize_rows(x)
    return codes.float() * scale[:, None]
