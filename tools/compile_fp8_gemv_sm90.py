"""Compile fp8_linear's GEMV ("fma") kernel (ops.triton.layer.fp8_gemv) for Hopper (sm_90) without a GPU, exactly as
fp8_gemv's launch on an H200 would specialise it (tools/sass_stats.compile_launch on a captured launch with CPU
tensors): what the interpreter accepts and the compiler refuses shows here. Run it with the device's triton (3.6):

    PYTHONPATH=/tmp/t36/lib/python3.11/site-packages:src:.:.venv/lib/python3.11/site-packages \
        /tmp/t36/bin/python tools/compile_fp8_gemv_sm90.py

Cases: Mixtral's o / qkv at one row, per-channel scales (default tiles; split-K with UNROLL 2), 128 x 128 block
scales (BLOCK_K capped at 128), 4 rows with a K tail and bias. Prints registers, local memory (spills), shared
memory and the SASS global loads, 128-bit or narrower (cuobjdump, tools/sass_stats.py).
"""
import time

import torch

from moekv.core.fp8 import FP8_DTYPE, Fp8Weight, scale_shape
from moekv.ops.triton.layer import fp8_gemv
from tools.sass_stats import capture_launch, compile_launch, resource_usage, sass

# (label, rows, N, K, block (None: per channel), bias, fma config (None: default_config))
CASES = [
    ("o, per channel, default tiles", 1, 4096, 4096, None, False, None),
    ("o, per channel, split-K 4, UNROLL 2", 1, 4096, 4096, None, False,
     {"BLOCK_N": 4, "BLOCK_K": 512, "SPLIT_K": 4, "UNROLL": 2, "num_warps": 4}),
    ("qkv, per channel, default tiles", 1, 6144, 4096, None, False, None),
    ("qkv, 128 x 128 blocks, default tiles", 1, 6144, 4096, (128, 128), False, None),
    ("o, 4 rows, K tail, bias", 4, 4096, 4000, None, True, {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 2}),
]


def weight(n: int, k: int, block) -> Fp8Weight:
    block = (1, k) if block is None else block
    return Fp8Weight(torch.empty((n, k), dtype=FP8_DTYPE), torch.ones(scale_shape((n, k), block)), block)


for label, rows, n, k, block, bias, cfg in CASES:
    x = torch.empty((rows, k), dtype=torch.bfloat16)
    w = weight(n, k, block)
    out = torch.empty((rows, n), dtype=torch.bfloat16)
    with capture_launch(fp8_gemv, "_fp8_gemv_kernel", skip=("reduce_splits",)) as launches:
        fp8_gemv.fp8_gemv(x, w, torch.empty(n, dtype=torch.bfloat16) if bias else None, out, cfg)
    grid, args, kwargs = launches[0]
    kwargs = dict(kwargs, EMULATE_BF16=False)                     # as on CUDA
    t0 = time.time()
    compiled = compile_launch(fp8_gemv._fp8_gemv_kernel, args, kwargs)
    usage = resource_usage(compiled)
    text = sass(compiled)
    wide = sum(1 for line in text.splitlines() if "LDG" in line and ".128" in line)
    narrow = sum(1 for line in text.splitlines() if "LDG" in line and ".128" not in line and "LDGDEPBAR" not in line)
    tiles = {key: kwargs[key] for key in ("BLOCK_N", "BLOCK_K", "UNROLL", "num_warps") if key in kwargs}
    print(f"ok {label}: grid {grid} {tiles} {time.time() - t0:.1f} s, regs {usage.get('REG')}, local "
          f"{usage.get('LOCAL', 0)}, shared {compiled.metadata.shared}, global loads 128-bit / narrower {wide} / "
          f"{narrow}", flush=True)
