"""Where the bundled model lives (in a source checkout: <repo>/models/tiny-shakespeare-moe)."""

from __future__ import annotations

import os
from pathlib import Path

BUNDLED_MODEL_NAME = "tiny-shakespeare-moe"


def default_model_dir() -> str:
    """The bundled tiny trained checkpoint; MOEKV_DEFAULT_MODEL overrides it."""
    override = os.environ.get("MOEKV_DEFAULT_MODEL")
    if override:
        return override
    return str(Path(__file__).resolve().parents[2] / "models" / BUNDLED_MODEL_NAME)
