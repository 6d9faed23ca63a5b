"""Where the bundled model lives (in a source checkout: <repo>/models/tiny-shakespeare-moe)."""

from __future__ import annotations

from pathlib import Path

from moekv import envs

BUNDLED_MODEL_NAME = "tiny-shakespeare-moe"


def default_model_dir() -> str:
    """The bundled tiny trained checkpoint; MOEKV_DEFAULT_MODEL overrides it."""
    override = envs.default_model()
    if override:
        return override
    return str(Path(__file__).resolve().parents[2] / "models" / BUNDLED_MODEL_NAME)
