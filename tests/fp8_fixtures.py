"""Tiny FP8 checkpoints, written by hand with safetensors the way their authors save them.

From a 16-bit tiny checkpoint (tests.hf_fixtures.make_checkpoint) every projection and expert weight
(`*_proj.weight`, Mixtral's `w1/w2/w3.weight`) becomes float8_e4m3fn codes plus its scales:

  layout "block"   (DeepSeek-V3 / Qwen3 FP8): `<name>.weight_scale_inv` [ceil(N/bn), ceil(K/bk)] fp32,
                   config.json quantization_config {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
                   weight_block_size: [bn, bk]};
  layout "tensor"  (FP8 Mixtral, AutoFP8): one `<name>.weight_scale` per tensor plus a static `input_scale`,
                   quantization_config {quant_method: fp8, activation_scheme: static};
  layout "channel" (per-channel weight_scale [N, 1]), quantization_config {quant_method: fp8}.

The router, embedding, norms and lm_head stay 16-bit, as in those checkpoints. `dequantized_checkpoint`
writes the reference: the same folder with every FP8 tensor replaced by codes * scale in a float dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moekv.core.fp8 import Fp8Weight, quantize_fp8

_QUANTIZED_SUFFIXES = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def _quantizable(key: str) -> bool:
    return key.endswith(_QUANTIZED_SUFFIXES) and ".mlp.gate." not in key and "shared_expert_gate" not in key


def _write(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    for path in list(folder.glob("*.safetensors")) + list(folder.glob("*.index.json")):
        path.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def fp8_checkpoint(source: Path, dest: Path, layout: str = "block", block: tuple[int, int] = (128, 128),
                   spike: float | None = None) -> Path:
    """Copy the checkpoint folder `source` to `dest` with its projections and experts in FP8 (see above).
    spike: write one weight of every quantized tensor as this value before quantizing (an outlier)."""
    dest = Path(dest)
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    tensors = _read_all(dest)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if not _quantizable(key):
            out[key] = tensor
            continue
        weight = tensor.float().clone()
        if spike is not None:
            weight[0, -1] = spike
        if layout == "block":
            quantized = quantize_fp8(weight, block)
            out[key], out[key + "_scale_inv"] = quantized.codes, quantized.scale
        elif layout == "tensor":
            scale = weight.abs().max().clamp_min(1e-12) / 448.0
            out[key] = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[key + "_scale"] = scale.reshape(())
            out[key.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)
        elif layout == "channel":
            quantized = quantize_fp8(weight)
            out[key], out[key + "_scale"] = quantized.codes, quantized.scale
        else:
            raise ValueError(layout)
    quant = {"quant_method": "fp8", "fmt": "e4m3",
             "activation_scheme": "static" if layout == "tensor" else "dynamic"}
    if layout == "block":
        quant["weight_block_size"] = list(block)
    config["quantization_config"] = quant
    return _write(dest, out, config)


def dequantized_checkpoint(source: Path, dest: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The FP8 checkpoint `source` with every FP8 tensor replaced by its dequantized value in `dtype` (the
    reference the FP8 loader must match), quantization_config removed."""
    dest = Path(dest)
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    block = tuple(config["quantization_config"].get("weight_block_size") or (0, 0))
    tensors = _read_all(dest)
    out = {}
    for key, tensor in tensors.items():
        if key.endswith(("_scale_inv", "_scale")) or key.endswith("input_scale"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            if key + "_scale_inv" in tensors:
                value = Fp8Weight(tensor, tensors[key + "_scale_inv"].float(), block).dequantize()
            else:
                value = tensor.float() * tensors[key + "_scale"].float().reshape(-1, 1)
            out[key] = value.to(dtype)
        else:
            out[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    config.pop("quantization_config")
    config["dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    config.pop("torch_dtype", None)
    return _write(dest, out, config)
