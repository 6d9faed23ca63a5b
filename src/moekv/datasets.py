"""Validation text for the bundled model (stdlib only, import-light).

The bundled checkpoint ``models/tiny-shakespeare-moe`` was trained on the tinyshakespeare corpus with a fixed split:
the first 90% of the characters are training text, the last 10% (``text[int(len(text) * 0.9):]``) are validation
text. Everything that measures quality (perplexity, KV-cache fidelity, expert-routing statistics) should use the
validation split, never the training split.

- :func:`validation_text` returns the whole validation split (~111 k characters) computed from the corpus file when
  it is available, else the committed slice.
- :func:`validation_slice` returns the committed copy ``models/tiny-shakespeare-moe/validation_slice.txt``: the first
  ~64 kB of the validation split, cut at a line end (always available in a checkout, also in CI).

Corpus resolution order: the ``path`` argument, then the ``MOEKV_TRAIN_TEXT`` environment variable, then
``<repo>/../shared/data/tinyshakespeare.txt``.
"""

from __future__ import annotations

import os
from pathlib import Path

from moekv import envs

VALIDATION_FRACTION = 0.1            # the last 10% of the characters are validation text
SLICE_BYTES = 64 * 1024              # the committed slice: first <= 64 kB of the validation split, cut at a line end
MODEL_DIRNAME = "tiny-shakespeare-moe"
SLICE_FILENAME = "validation_slice.txt"
CORPUS_ENV = "MOEKV_TRAIN_TEXT"   # read by envs.train_text

_REPO_ROOT = Path(__file__).resolve().parents[2]   # src/moekv/datasets.py -> repo root (in a source checkout)


def split_text(text: str) -> tuple[str, str]:
    """Split a corpus into (train, validation) by characters: validation is the last 10%."""
    cut = int(len(text) * (1.0 - VALIDATION_FRACTION))
    return text[:cut], text[cut:]


def make_slice(validation: str, max_bytes: int = SLICE_BYTES) -> str:
    """The committed slice of a validation split: its first ``max_bytes`` UTF-8 bytes, cut after the last newline."""
    head = validation.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    end = head.rfind("\n")
    return head[: end + 1] if end >= 0 else head


def default_corpus_path() -> Path:
    """Where the training corpus is expected: ``$MOEKV_TRAIN_TEXT`` or ``<repo>/../shared/data/tinyshakespeare.txt``."""
    env = envs.train_text()
    if env:
        return Path(env)
    return _REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def bundled_model_dir() -> Path:
    """The bundled checkpoint folder (source checkout: ``<repo>/models/tiny-shakespeare-moe``).

    Raises FileNotFoundError with the places searched when it cannot be found (e.g. an installed wheel without the
    ``models/`` folder); set ``MOEKV_MODEL_DIR`` to point at a copy.
    """
    candidates = []
    env = envs.model_dir()
    if env:
        candidates.append(Path(env))
    candidates.append(_REPO_ROOT / "models" / MODEL_DIRNAME)
    candidates.append(Path.cwd() / "models" / MODEL_DIRNAME)
    for c in candidates:
        if (c / "config.json").is_file() or (c / SLICE_FILENAME).is_file():
            return c
    raise FileNotFoundError(
        "bundled model folder not found; looked in: " + ", ".join(str(c) for c in candidates)
        + " (run from a source checkout of moekv or set MOEKV_MODEL_DIR)"
    )


def validation_slice() -> str:
    """The committed validation slice (first ~64 kB of the validation split), as text."""
    path = bundled_model_dir() / SLICE_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"committed validation slice missing: {path}")
    return path.read_text(encoding="utf-8")


def validation_text(path: str | os.PathLike | None = None) -> str:
    """The validation split (last 10% of the characters) of the training corpus.

    ``path`` (or ``$MOEKV_TRAIN_TEXT``, or ``<repo>/../shared/data/tinyshakespeare.txt``) names the corpus. If an
    explicitly given ``path`` does not exist that is an error; if the default corpus is absent, the committed slice
    (:func:`validation_slice`) is returned instead.
    """
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"training corpus not found: {p}")
        return split_text(p.read_text(encoding="utf-8"))[1]
    p = default_corpus_path()
    if p.is_file():
        return split_text(p.read_text(encoding="utf-8"))[1]
    try:
        return validation_slice()
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"no validation text: corpus {p} not found (set {CORPUS_ENV} or pass path=) and {e}"
        ) from None
