"""Host copies of the offloaded experts, and the device slot pool they are copied into.

HostExperts: one layer's experts in host memory (pinned when CUDA is available), in the model's dtype
(host format "native") or as FP8 e4m3 codes with per-output-channel fp32 scales ("fp8", the
`core.fp8.Fp8Weight` record: about half the bytes to move; the W8A16 experts kernels compute from the
slots directly). A model whose experts are FP8 already (an FP8 checkpoint, `--quantization fp8`) keeps
its own codes and block scales. Each expert is a few *planes* -- gate_up and down, for FP8 their codes
and their scales -- each [E, ...] with one expert's slice contiguous: a copy moves expert e's slice of
every plane, in `chunks` row ranges when it is staged piece by piece (policy.py).

SlotPool: the device slots of every offloaded layer in one set of planes [N, ...] of the same layout.
A pool index means the same thing in every layer, so slots can change hands: each layer owns S of them,
K more are staging slots for guesses (policy.py), and the last one is a trash slot for the entries a
device-side copy list leaves unused (device_staging.py). `weights()` is what the experts kernels read:
the plane tensors, or Fp8Weight records over the pool's codes and scales.

PooledExperts: what every offloaded layer holds -- its host copies, the pool, and the pool indices of its
slots -- the base of the host-managed (offload.OffloadedExperts) and the device-staged
(device_staging.DeviceStagedExperts) layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekv.core.fp8 import Fp8Weight, quantize_per_expert
from moekv.errors import ConfigError
from moekv.layers.experts import Experts

HOST_FORMATS = ("native", "fp8")


def to_host(weight: torch.Tensor) -> torch.Tensor:
    """A host copy of `weight`; pinned (page-locked, for asynchronous copies) only when CUDA exists."""
    host = weight.detach().to("cpu")                     # no copy when the weight already lives on the CPU
    return host.pin_memory() if torch.cuda.is_available() else host


def _host_weight(weight: torch.Tensor | Fp8Weight) -> torch.Tensor | Fp8Weight:
    if isinstance(weight, Fp8Weight):
        return Fp8Weight(to_host(weight.codes), to_host(weight.scale), weight.block)
    return to_host(weight)


@dataclass
class HostExperts:
    """One layer's experts in host memory: w_gate_up [E, 2I, H] and w_down [E, H, I], tensors or Fp8Weight."""

    gate_up: torch.Tensor | Fp8Weight
    down: torch.Tensor | Fp8Weight

    @classmethod
    def from_weights(cls, w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight,
                     host_format: str = "native") -> "HostExperts":
        """Host copies of a block's expert weights (on any device). "fp8" quantizes 16-bit weights per output
        channel on their own device (one expert at a time), then copies codes and scales to the host."""
        if host_format not in HOST_FORMATS:
            raise ConfigError(f"host_format must be one of {HOST_FORMATS}, got {host_format!r}")
        if isinstance(w_gate_up, Fp8Weight) != isinstance(w_down, Fp8Weight):
            raise ConfigError("offloaded experts need both projections in the same format (FP8 or 16-bit)")
        if host_format == "fp8" and not isinstance(w_gate_up, Fp8Weight):
            w_gate_up, w_down = quantize_per_expert(w_gate_up.detach()), quantize_per_expert(w_down.detach())
        return cls(_host_weight(w_gate_up), _host_weight(w_down))

    @property
    def fp8(self) -> bool:
        return isinstance(self.gate_up, Fp8Weight)

    @property
    def planes(self) -> list[torch.Tensor]:
        """The tensors one expert copy moves a slice [e] of."""
        if self.fp8:
            return [self.gate_up.codes, self.gate_up.scale, self.down.codes, self.down.scale]
        return [self.gate_up, self.down]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def expert_bytes(self) -> int:
        return sum(plane[0].nbytes for plane in self.planes)

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.codes.dtype if self.fp8 else self.gate_up.dtype


def plane_rows(plane: torch.Tensor, chunk: int, chunks: int, stop: int | None = None) -> slice:
    """Rows of one expert's slice of `plane` that chunk `chunk` of `chunks` covers (the last takes the rest),
    or chunks `chunk` .. `stop` - 1 together (one contiguous row range)."""
    rows = plane.shape[1] if plane.dim() > 1 else 1
    return slice(chunk * rows // chunks, (chunk + 1 if stop is None else stop) * rows // chunks)


class SlotPool:
    """Device slots for the experts of every offloaded layer: planes [N, ...] laid out like HostExperts'."""

    def __init__(self, template: HostExperts, num_slots: int, device: torch.device):
        self.device = torch.device(device)
        self.fp8 = template.fp8
        self.blocks = (template.gate_up.block, template.down.block) if self.fp8 else None
        self.planes = [torch.zeros((num_slots, *plane.shape[1:]), dtype=plane.dtype, device=self.device)
                       for plane in template.planes]                                  # each [N, ...]
        self.expert_bytes = template.expert_bytes

    @property
    def num_slots(self) -> int:
        return self.planes[0].shape[0]

    @property
    def trash(self) -> int:
        """The last slot: where unused entries of a device copy list go (never read by a layer)."""
        return self.num_slots - 1

    def weights(self) -> tuple[torch.Tensor | Fp8Weight, torch.Tensor | Fp8Weight]:
        """(w_gate_up [N, 2I, H], w_down [N, H, I]) as the experts kernels take them."""
        if self.fp8:
            return (Fp8Weight(self.planes[0], self.planes[1], self.blocks[0]),
                    Fp8Weight(self.planes[2], self.planes[3], self.blocks[1]))
        return self.planes[0], self.planes[1]

    def check_compatible(self, host: HostExperts) -> None:
        for mine, theirs in zip(self.planes, host.planes):
            if mine.shape[1:] != theirs.shape[1:] or mine.dtype != theirs.dtype:
                raise ConfigError(f"offloaded layers must share one expert layout; got {list(theirs.shape[1:])} "
                                  f"{theirs.dtype} next to {list(mine.shape[1:])} {mine.dtype}")


class PooledExperts(Experts):
    """One layer's offloaded experts: host copies + `len(slots)` slots of the shared device pool."""

    def __init__(self, layer_idx: int, host: HostExperts, pool: SlotPool, slots: list[int]):
        super().__init__()
        pool.check_compatible(host)
        self.layer_idx = layer_idx
        self.host = host
        self.pool = pool
        self.num_experts = host.num_experts
        self.num_slots = len(slots)
        self.slot_pool = list(slots)                            # local slot -> pool index

    @property
    def expert_bytes(self) -> int:
        return self.host.expert_bytes
