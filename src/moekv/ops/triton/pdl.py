"""Programmatic dependent launch (PDL, compute capability >= 9.0) for the Triton kernels of a decode step
(KernelConfig.pdl, MOEKV_PDL=1; off by default until a GPU run measures it, docs/moe-kernels.md "Kernels per decode
layer").

Inside a CUDA graph a decode layer is a chain of small dependent kernels (norms, rotary, attention and its combine,
routing, the expert GEMVs), and each waits for the one before it to finish and for its own launch before any of
its CTAs start. With PDL a kernel launched with `launch_pdl=True` may be scheduled while its predecessor still runs,
once every CTA of the predecessor has executed `griddepcontrol.launch_dependents` (or exited): its launch and CTA
set-up overlap the predecessor's tail.

The contract that keeps this exact: every kernel launched with PDL calls `enter(USE_PDL)` first, before any global
load or store -- `griddepcontrol.wait` blocks until the predecessor grid has completed and its memory is visible,
so nothing is read early and nothing the predecessor still reads is overwritten early -- then signals its own
dependents. `launch_kwargs(tensor)` returns both switches together (USE_PDL for the kernel, launch_pdl for the
launcher), so a kernel can never be launched early without its wait. The v7 low-bit CUDA kernel does the same
(`active_on`: `Params::pdl`, `griddepcontrol.wait` at its top, `cudaLaunchKernelEx` with the programmatic
attribute). A kernel without PDL (cuBLAS, torch) never triggers early, so the kernel after it starts when it ends.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_enabled = False
_ON = {"USE_PDL": True, "launch_pdl": True}       # what launch_kwargs hands out (spread into launches, never edited)
_OFF = {"USE_PDL": False}


def set_enabled(on: bool) -> None:
    """Called by ops.dispatch when the active KernelConfig changes (its `pdl` field)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _triton_takes_pdl() -> bool:
    """Triton's CUDA backend takes the `launch_pdl` option and has the gdc intrinsics."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except Exception:                                                           # noqa: BLE001
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def active_on(tensor: torch.Tensor) -> bool:
    """Whether a launch on tensor's device uses PDL: the switch is on and the device has compute capability >= 9.0
    (the v7 CUDA kernel asks this; Triton launches ask launch_kwargs, which also needs Triton's support)."""
    if not (_enabled and tensor.is_cuda):
        return False
    return _hopper(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def launch_kwargs(tensor: torch.Tensor) -> dict:
    """The kernel's USE_PDL constexpr and the launcher's launch_pdl option for a launch on tensor's device:
    {"USE_PDL": True, "launch_pdl": True} when PDL is on there and Triton takes it, else {"USE_PDL": False}."""
    return _ON if active_on(tensor) and _triton_takes_pdl() else _OFF


@triton.jit
def enter(USE_PDL: tl.constexpr):
    """First statement of a PDL-launched kernel: wait for the predecessor grid (its completion and memory), then let
    this kernel's own dependents be scheduled. A no-op without USE_PDL (the interpreter never compiles the branch)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
