"""Model names -> checkpoint folders: a folder as given, or a Hugging Face Hub id from the local cache.

A Hub id (`org/name`) is looked up in the local Hugging Face cache only, through huggingface_hub's
`snapshot_download(..., local_files_only=True)`: nothing is ever downloaded. The cache folder is
`--download-dir` when given, else the one huggingface_hub would use (HF_HUB_CACHE, $HF_HOME/hub,
~/.cache/huggingface/hub; read in `envs.hf_hub_cache`). `revision` is a branch, tag or commit hash
(default `main`), resolved through the cache's `refs/`.
"""

from __future__ import annotations

import re
from pathlib import Path

from moekv import envs
from moekv.errors import ConfigError, ModelLoadError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def hub_cache_dirs(download_dir: str | None = None) -> list[tuple[str, str]]:
    """The cache folders searched for a Hub id, with what chose each: [(folder, reason)]."""
    if download_dir is not None:
        return [(str(Path(download_dir).expanduser()), "--download-dir")]
    folder, reason = envs.hf_hub_cache()
    return [(folder, reason)]


def resolve_model_dir(name: str, revision: str | None = None, download_dir: str | None = None,
                      what: str = "model") -> str:
    """The checkpoint folder `name` means: an existing folder as given, else a Hub id's cached snapshot.

    Raises ModelLoadError naming the folders searched when `name` is neither.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{what} must be a checkpoint folder or a Hugging Face model id")
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ConfigError(f"--revision {revision!r} applies to a Hugging Face model id, but {what} {name!r} "
                              "is a local folder")
        return str(path)
    if path.exists():
        raise ModelLoadError(f"{what} {name!r} is a file, not a checkpoint folder")
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or not _HUB_ID.match(name):
        raise ModelLoadError(f"{what} {name!r} does not exist: no such folder (and not a Hugging Face model id, "
                             "org/name)")
    searched = []
    for folder, reason in hub_cache_dirs(download_dir):
        found = _cached_snapshot(name, revision, folder)
        if found is not None:
            return found
        searched.append(f"{folder} ({reason})")
    offline = " (HF_HUB_OFFLINE is set)" if envs.hf_hub_offline() else ""
    rev = f" at revision {revision!r}" if revision else ""
    raise ModelLoadError(
        f"{what} {name!r}{rev} is not a local folder and not in the Hugging Face cache; searched: "
        f"{', '.join(searched)}. moekv never downloads{offline}: fetch it first, e.g. "
        f"`huggingface-cli download {name}`{' --revision ' + revision if revision else ''}, or pass the folder "
        "(set HF_HUB_CACHE / HF_HOME or --download-dir to point at another cache)")


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir: str) -> str | None:
    if not Path(cache_dir).is_dir():
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ModuleNotFoundError:   # pragma: no cover - huggingface_hub is a dependency
        raise ConfigError(f"resolving the model id {repo_id!r} needs huggingface_hub: pip install huggingface_hub") \
            from None
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None
    except ValueError as exc:     # e.g. a malformed repo id
        raise ConfigError(f"model id {repo_id!r}: {exc}") from None
    return folder if Path(folder).is_dir() else None
