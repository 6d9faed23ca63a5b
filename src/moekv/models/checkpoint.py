"""Reading tensors out of a checkpoint folder's safetensors files (never pickle).

Finds the files (`model.safetensors.index.json` -> shards, else `model.safetensors`, else every
`*.safetensors`), opens them memory-mapped, and hands out tensors by name with the shape checked.
Every failure is a ModelLoadError naming the file and tensor. FP8 tensors (float8_e4m3fn, with a
`<name>_scale_inv` block scale or a `<name>_scale` per-tensor / per-channel scale next to them) come out
as moekv.core.fp8.Fp8Weight records (`get_fp8`), or dequantized when a 16-bit tensor is asked for (`get`).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moekv.core.fp8 import Fp8Weight, per_channel_scale, scale_shape
from moekv.errors import ConfigError, ModelLoadError

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

    def __init__(self, model_dir: str | Path, fp8_block: tuple[int, int] | None = None):
        """fp8_block: config.json's weight_block_size (the block of every `_scale_inv` scale), if any."""
        self.model_dir = Path(model_dir)
        self.fp8_block = fp8_block
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

    def is_fp8(self, key: str) -> bool:
        return self.has(key) and self._handles[self._file_of[key]].get_slice(key).get_dtype() == "F8_E4M3"

    def get(self, key: str, expected_shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `key` (on the CPU, in the file's dtype; an FP8 one dequantized to fp32), after checking
        its shape."""
        if self.is_fp8(key):
            return self.get_fp8(key, expected_shape).dequantize(torch.float32)
        return self._read(key, expected_shape)

    def get_fp8(self, key: str, expected_shape: tuple[int, ...]) -> Fp8Weight:
        """The FP8 tensor `key` with its scales: `key + "_scale_inv"` (block scales of config.json's
        weight_block_size) or `key + "_scale"` (one per tensor, per expert or per output channel). A static
        activation scale (`input_scale`) is read past: moekv keeps activations in 16 bits (W8A16)."""
        codes = self._read(key, expected_shape)
        input_scale = key.removesuffix("weight") + "input_scale"
        if self.has(input_scale):
            self._used.add(input_scale)
        try:
            if self.has(key + "_scale_inv"):
                if self.fp8_block is None:
                    raise ModelLoadError(f"FP8 tensor {key!r} has block scales ({key}_scale_inv) but config.json's "
                                         "quantization_config gives no weight_block_size")
                scale = self._read(key + "_scale_inv", scale_shape(tuple(expected_shape), self.fp8_block))
                return Fp8Weight(codes, scale.float(), self.fp8_block)
            if self.has(key + "_scale"):
                scale = per_channel_scale(self._read(key + "_scale", None), tuple(expected_shape))
                return Fp8Weight(codes, scale, (1, expected_shape[-1]))
        except ConfigError as exc:
            raise ModelLoadError(f"FP8 tensor {key!r} in {str(self.model_dir)!r}: {exc}") from exc
        raise ModelLoadError(f"FP8 tensor {key!r} in {str(self.model_dir)!r} has no scale ({key}_scale_inv or "
                             f"{key}_scale)")

    def _read(self, key: str, expected_shape: tuple[int, ...] | None) -> torch.Tensor:
        """The tensor `key` as stored, its shape checked against expected_shape (None: any shape)."""
        path = self._file_of.get(key)
        if path is None:
            raise ModelLoadError(f"checkpoint {str(self.model_dir)!r} is missing tensor {key!r} "
                                 f"(expected shape {list(expected_shape or [])})")
        actual = self.shape(key)
        if expected_shape is not None and actual != tuple(expected_shape):
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
