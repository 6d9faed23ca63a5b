"""Which code a measurement ran: the git commit, with an override for machines whose checkout lies.

`MOEKV_COMMIT` wins when set: the GPU machines get a copy of the working tree whose `.git` may be
older than the tree itself (seen on 2026-11-30: every run reported the session's first commit), so
a GPU command should start with `MOEKV_COMMIT=<sha>` taken from the machine that sent the tree.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from moekv import envs

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str, cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(short: bool = True, dirty_paths: list[str] | None = None, cwd: Path | str | None = None) -> str | None:
    """The commit (short or full), "+uncommitted" appended when the tree differs (only under
    `dirty_paths` when given); `MOEKV_COMMIT` when set; None outside a git checkout."""
    override = envs.commit()
    if override:
        return override
    where = Path(cwd) if cwd is not None else REPO
    head = _git("rev-parse", *(["--short"] if short else []), "HEAD", cwd=where)
    if head is None:
        return None
    dirty = _git("status", "--porcelain", *(["--", *dirty_paths] if dirty_paths else []), cwd=where)
    return head + ("+uncommitted" if dirty else "")
