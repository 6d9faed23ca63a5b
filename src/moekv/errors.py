"""Typed errors raised at the boundaries (CLI, offline API, server, loader).

Deep code trusts validated inputs; these are the errors a user sees. Each carries a message
that says what was wrong and what to do about it.
"""

from __future__ import annotations


class MoekvError(Exception):
    """Base class of every error moekv raises on purpose."""


class ConfigError(MoekvError, ValueError):
    """A configuration value is invalid (unknown dtype, negative size, ...)."""


class ModelLoadError(MoekvError):
    """A checkpoint folder cannot be loaded (missing file, corrupt or misshaped tensor, ...)."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not one moekv implements."""


class InvalidRequestError(MoekvError, ValueError):
    """A request (prompt or sampling parameters) is invalid. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotAvailableError(MoekvError):
    """A feature that exists in the interface but is not available in this build or on this device."""


class KVCacheCorruptionError(MoekvError):
    """Non-finite keys or values reached the KV cache for some requests; those requests are ended.

    `seq_indices`: their positions in the step's batch; `request_ids`: their ids.
    """

    def __init__(self, message: str, seq_indices: list[int] | None = None, request_ids: list[str] | None = None):
        super().__init__(message)
        self.seq_indices = list(seq_indices or [])
        self.request_ids = list(request_ids or [])


class OutOfKVCacheError(MoekvError):
    """The KV page pool cannot hold a request even when it runs alone."""
