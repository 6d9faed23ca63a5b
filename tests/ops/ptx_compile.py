"""Compile the full-precision decode kernel for sm_90 without a GPU (Triton's bundled ptxas) and print its PTX:
how the in-kernel split combine's ordering is lowered can be read on any machine.

    PYTHONPATH=src:. python -m tests.ops.ptx_compile --combine 1 > decode.ptx

Run without TRITON_INTERPRET (an interpreted kernel has no compiler). The launch is specialised as the JIT
would for contiguous bf16 tensors (pointers and row strides divisible by 16), Mixtral's decode shape by default.
"""

from __future__ import annotations

import argparse
import sys

PTRS = ("q_ptr", "k_ptr", "v_ptr", "block_tables_ptr", "seq_lens_ptr", "out_ptr", "partial_ptr", "lse_ptr",
        "counters_ptr")
STRIDES = ("stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp", "stride_vt", "stride_vh",
           "stride_bt", "stride_ob", "stride_oh", "stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh")
ALIGNED = {"stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp", "stride_vt", "stride_vh",
           "stride_ob", "stride_oh", "stride_pb", "stride_ph", "stride_ps"}


def compile_decode(combine: bool, group: int = 4, head_dim: int = 128, num_splits: int = 64, arch: int = 90):
    """-> the CompiledKernel of _fp_decode_kernel (split mode, device splits) for a CUDA target of `arch`."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekv.ops.triton.attention.decode import _fp_decode_kernel, default_config
    from moekv.ops.triton.attention.split_k import combine_chunk
    from moekv.ops.triton.common import pow2

    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "block_tables_ptr": "*i32",
             "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "partial_ptr": "*fp32", "lse_ptr": "*fp32",
             "counters_ptr": "*i32", "qk_scale": "fp32", "tokens_per_split": "i32", "num_splits": "i32"}
    types.update({name: "i32" for name in STRIDES})
    cfg = default_config(head_dim, torch.bfloat16)
    consts = dict(PAGE_SIZE=16, GROUP=group, BLOCK_H=pow2(group), HEAD_DIM=head_dim, BLOCK_D=pow2(head_dim),
                  BLOCK_N=cfg["BLOCK_N"], HALF=True, UPCAST=False, SPLIT=True, DEVICE_SPLITS=True, COMBINE=combine,
                  BLOCK_SC=combine_chunk(head_dim, num_splits) if combine else 1, INVARIANT=False)
    signature = dict(types, **{name: "constexpr" for name in consts})
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*PTRS, *ALIGNED)}
    source = ASTSource(_fp_decode_kernel, signature, consts, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--combine", type=int, default=1)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    sys.stdout.write(compile_decode(bool(args.combine), args.group, args.head_dim).asm["ptx"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
