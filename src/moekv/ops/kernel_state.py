"""The kernel configuration ops run with now (ops.dispatch re-exports every public name here).

The engine installs its `EngineConfig.kernels` (`install`), whose defaults the MOEKV_* variables override
(`KernelConfig.from_env`, read once, at import for code that runs without an engine); `override(...)` changes
fields for a `with` block (tests, benchmarks). `active()` is what the dispatch decisions read.
"""

from __future__ import annotations

import dataclasses
import sys
from contextlib import contextmanager
from typing import Any

from moekv.config import KernelConfig
from moekv.errors import ConfigError
from moekv.ops.choices import LOWBIT_DECODE_KERNELS


def _validated(config: KernelConfig) -> KernelConfig:
    if not isinstance(config, KernelConfig):
        raise ConfigError(f"expected a KernelConfig, got {config!r}")
    if config.lowbit_decode != "auto" and config.lowbit_decode not in LOWBIT_DECODE_KERNELS:
        raise ConfigError(f"low-bit decode kernel (KernelConfig.lowbit_decode, MOEKV_LOWBIT_DECODE) must be auto "
                          f"or one of {', '.join(LOWBIT_DECODE_KERNELS)}, got {config.lowbit_decode!r}")
    return config


_installed = _validated(KernelConfig.from_env())
_active = _installed


def install(config: KernelConfig) -> None:
    """Make `config` the kernel configuration of this process (the engine installs its own).
    Scoped `override`s still apply on top of it."""
    global _installed
    _installed = _validated(config)
    _refresh()


_override_stack: list[dict[str, Any]] = []


def _refresh() -> None:
    global _active
    merged: dict[str, Any] = {}
    for fields in _override_stack:
        merged.update(fields)
    _active = _validated(dataclasses.replace(_installed, **merged)) if merged else _installed
    _set_pdl(_active.pdl)


def _set_pdl(on: bool) -> None:
    """KernelConfig.pdl into ops.triton.pdl, which the Triton launches read (only where Triton imports)."""
    if on or "moekv.ops.triton.pdl" in sys.modules:
        try:
            from moekv.ops.triton import pdl
        except Exception:                                                     # noqa: BLE001 (no Triton here)
            return
        pdl.set_enabled(on)


_set_pdl(_active.pdl)


@contextmanager
def override(**fields):
    """Change KernelConfig fields inside a `with` block, over whatever is installed (an engine built
    inside the block keeps them too), e.g. `with dispatch.override(backend="reference"): ...` or
    `dispatch.override(lowbit_decode="tc")`. Yields the active KernelConfig."""
    _override_stack.append(fields)
    try:
        _refresh()
    except Exception:
        _override_stack.pop()
        raise
    try:
        yield _active
    finally:
        del _override_stack[next(i for i, f in enumerate(_override_stack) if f is fields)]
        _refresh()


def kernel_config() -> KernelConfig:
    """The kernel configuration ops run with now."""
    return _active


def active() -> KernelConfig:
    """kernel_config(), the name the dispatch decisions use."""
    return _active


def installed_config() -> KernelConfig:
    """The installed configuration, without the scoped overrides (to restore it with `install`)."""
    return _installed


def get_backend() -> str:
    return _active.backend


def skinny_gemm_enabled() -> bool:
    return _active.skinny_gemm_rows > 0


def batch_invariant() -> bool:
    """KernelConfig.batch_invariant: every row's result independent of the rest of its batch (the layers ask)."""
    return _active.batch_invariant


def skinny_gemm_max_rows() -> int:
    """The row limit of the skinny GEMM when on (1 with MOEKV_SKINNY_GEMM=auto, 16 otherwise)."""
    return _active.skinny_gemm_rows or KernelConfig.SKINNY_GEMM_MAX_ROWS
