"""moekv's low-bit KV format inside other frameworks.

- `moekv.integrations.transformers.LowBitCache`: a drop-in Hugging Face transformers cache
  (`model.generate(..., past_key_values=LowBitCache(model.config, bits=3))`); needs transformers >= 4.56.
- `moekv.integrations.hf_accounting.stored_bytes`: the bytes transformers' own caches store, counted from
  their tensors (for side-by-side comparisons).

Nothing here is imported by `import moekv`; transformers loads only with `moekv.integrations.transformers`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LowBitCache"]


def __getattr__(name: str) -> Any:
    if name == "LowBitCache":
        from moekv.integrations.transformers import LowBitCache

        return LowBitCache
    raise AttributeError(f"module 'moekv.integrations' has no attribute {name!r}")
