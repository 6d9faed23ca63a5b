"""Compile the grouped MoE kernels (ops.triton.moe.grouped) for Hopper (sm_90) without a GPU, W8A8 (fp8 x fp8 dots)
next to W8A16 (e4m3 widened to bf16 in registers) at the same tiles, as a launch on an H200 would specialise them
(tools/sass_stats.compile_launch on captured launches with CPU tensors). Run it with the device's triton (3.6):

    PYTHONPATH=/tmp/t36/lib/python3.11/site-packages:src:.:.venv/lib/python3.11/site-packages \
        /tmp/t36/bin/python tools/compile_moe_w8a8_sm90.py

Cases: Mixtral-8x7B's experts at 128 tokens (top-2), per-channel scales and 128 x 128 blocks; Qwen3-30B-A3B's at
256 tokens (top-8); then the dense fp8_linear "dot" kernel at 128 rows (Mixtral's qkv, its default 64 x 64 x 64 tiles). Prints registers, spills, shared memory, and the SASS tensor-core instructions (HGMMA: 16-bit
operands, QGMMA: fp8) and conversions (F2FP / HADD2.F32 / PRMT, the widening W8A16 pays per weight).
"""
import collections
import time

import torch

from moekv.core.fp8 import FP8_DTYPE, Fp8Weight, scale_shape
from moekv.ops.triton.layer import fp8_linear
from moekv.ops.triton.moe import grouped
from tools.sass_stats import capture_launch, compile_launch, instructions, resource_usage, sass

CONFIG = {"BLOCK_M": 64, "gate_up": {"BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
          "down": {"BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}}
# (label, T, top_k, E, H, I, block (None: per channel))
CASES = [
    ("mixtral, 128 tokens, per channel", 128, 2, 8, 4096, 14336, None),
    ("mixtral, 128 tokens, 128 x 128 blocks", 128, 2, 8, 4096, 14336, (128, 128)),
    ("qwen3-30b-a3b, 256 tokens, 128 x 128 blocks", 256, 8, 128, 2048, 768, (128, 128)),
]


def weight(shape, block) -> Fp8Weight:
    block = (1, shape[-1]) if block is None else block
    return Fp8Weight(torch.empty(shape, dtype=FP8_DTYPE), torch.ones(scale_shape(shape, block)), block)


def counts(text: str) -> dict:
    ops = collections.Counter(op for _, op, _ in instructions(text))
    return {op: ops[op] for op in ("HGMMA", "QGMMA", "HMMA", "F2FP", "HADD2", "PRMT", "I2FP", "F2F") if ops[op]}


for label, tokens, top_k, experts, hidden, inter, block in CASES:
    x = torch.empty((tokens, hidden), dtype=torch.bfloat16)
    w_gate_up, w_down = weight((experts, 2 * inter, hidden), block), weight((experts, hidden, inter), block)
    ids = torch.zeros((tokens, top_k), dtype=torch.int64)
    for a8 in (False, True):
        aligned = (torch.zeros(4096, dtype=torch.int32), torch.zeros(64, dtype=torch.int32),
                   torch.zeros(1, dtype=torch.int32))
        patch = {"moe_align": lambda *a: aligned, "combine": lambda *a, **k: None}
        with capture_launch(grouped, "_grouped_gate_up_kernel", patch=patch) as gate_up, \
                capture_launch(grouped, "_grouped_down_kernel") as down:
            grouped.moe_experts_grouped(x, w_gate_up, w_down, ids, torch.ones(tokens, top_k), config=CONFIG,
                                        act_fp8=a8)
        for name, fn, launches in (("gate_up", grouped._grouped_gate_up_kernel, gate_up),
                                   ("down", grouped._grouped_down_kernel, down)):
            _, args, kwargs = launches[0]
            kwargs = dict(kwargs, UPCAST=False)                   # as on CUDA for bf16 (the CPU widens to fp32)
            t0 = time.time()
            compiled = compile_launch(fn, args, kwargs)
            usage = resource_usage(compiled)
            print(f"ok {label} {'W8A8' if a8 else 'W8A16'} {name}: {time.time() - t0:.1f} s, regs {usage.get('REG')}, "
                  f"local {usage.get('LOCAL', 0)}, shared {compiled.metadata.shared}, {counts(sass(compiled))}",
                  flush=True)


for block in (None, (128, 128)):
    x = torch.empty((128, 4096), dtype=torch.bfloat16)
    w = weight((6144, 4096), block)
    for a8 in (False, True):
        with capture_launch(fp8_linear, "_fp8_linear_kernel") as launches:
            fp8_linear.fp8_linear(x, w, act_fp8=a8, config={"VARIANT": "dot"})
        _, args, kwargs = launches[0]
        kwargs = dict(kwargs, UPCAST=False, EMULATE_BF16=False)
        compiled = compile_launch(fp8_linear._fp8_linear_kernel, args, kwargs)
        usage = resource_usage(compiled)
        print(f"ok qkv 128 rows, {'per channel' if block is None else '128 x 128 blocks'} {'W8A8' if a8 else 'W8A16'}: "
              f"regs {usage.get('REG')}, local {usage.get('LOCAL', 0)}, shared {compiled.metadata.shared}, "
              f"{counts(sass(compiled))}", flush=True)
