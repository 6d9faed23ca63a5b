"""Reading tensors out of a checkpoint folder's safetensors files (never pickle).

Finds the files (`model.safetensors.index.json` -> shards, else `model.safetensors`, else every
`*.safetensors`), opens them memory-mapped, and hands out tensors by name with the shape checked.
Every failure is a ModelLoadError naming the file and tensor.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moekv.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def find_weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in a stable order."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index_path} is not a valid safetensors index (needs a 'weight_map' "
                                 f"object): {exc!r}") from exc
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise ModelLoadError(f"{index_path} names shard(s) that are not in the folder: {', '.join(missing)}")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    hint = (f" (found {', '.join(pickles[:3])}: moekv never loads pickled weights; convert them to "
            f"safetensors first)") if pickles else ""
    raise ModelLoadError(f"no safetensors weights in {str(model_dir)!r}{hint}")


class CheckpointReader:
    """Tensors by name across all weight files of a checkpoint; use as a context manager."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.files = find_weight_files(self.model_dir)
        self.total_bytes = sum(path.stat().st_size for path in self.files)
        self._stack = ExitStack()
        self._handles = {}
        self._file_of: dict[str, Path] = {}
        self._used: set[str] = set()
        try:
            for path in self.files:
                try:
                    handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                except (SafetensorError, OSError, ValueError) as exc:
                    raise ModelLoadError(f"corrupt or unreadable safetensors file {path}: {exc}") from exc
                self._handles[path] = handle
                for key in handle.keys():
                    self._file_of[key] = path
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def keys(self) -> list[str]:
        return list(self._file_of)

    def has(self, key: str) -> bool:
        return key in self._file_of

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[key]].get_slice(key).get_shape())

    def get(self, key: str, expected_shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `key` (on the CPU, in the file's dtype), after checking its shape."""
        path = self._file_of.get(key)
        if path is None:
            raise ModelLoadError(f"checkpoint {str(self.model_dir)!r} is missing tensor {key!r} "
                                 f"(expected shape {list(expected_shape)})")
        actual = self.shape(key)
        if actual != tuple(expected_shape):
            raise ModelLoadError(f"tensor {key!r} in {path.name} has shape {list(actual)}, expected "
                                 f"{list(expected_shape)}; does config.json match the weights?")
        try:
            tensor = self._handles[path].get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read tensor {key!r} from {path}: {exc}") from exc
        self._used.add(key)
        return tensor

    def unused_keys(self) -> list[str]:
        """Tensors in the files that no get() asked for, sorted."""
        return sorted(set(self._file_of) - self._used)
