"""Compile the full-precision decode kernel for sm_90 without a GPU (Triton's bundled ptxas) and print its PTX:
how the in-kernel split combine's ordering is lowered can be read on any machine (and, for their tests, the
batch-invariant kernels, the add + norm + route kernel with its routing fold and the routing kernel).

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


def compile_decode(combine: bool, group: int = 4, head_dim: int = 128, num_splits: int = 64, arch: int = 90,
                   use_pdl: bool = False):
    """-> the CompiledKernel of _fp_decode_kernel (split mode, device splits) for a CUDA target of `arch`;
    use_pdl: as launched with programmatic dependent launch (ops/triton/pdl.py)."""
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
                  BLOCK_SC=combine_chunk(head_dim, num_splits) if combine else 1, INVARIANT=False, USE_PDL=use_pdl)
    signature = dict(types, **{name: "constexpr" for name in consts})
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*PTRS, *ALIGNED)}
    source = ASTSource(_fp_decode_kernel, signature, consts, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
                                   **({"launch_pdl": True} if use_pdl else {})})


def compile_batch_invariant(group: int = 4, head_dim: int = 128, arch: int = 90) -> dict[str, str]:
    """The batch-invariant mode's kernels (KernelConfig.batch_invariant) compiled for a CUDA target, bf16, as their
    launches specialise them: {"decode", "prefill", "merge", "linear", "linear_fp8"} -> PTX."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekv.ops.triton.attention import invariant
    from moekv.ops.triton.attention.decode import _fp_decode_kernel
    from moekv.ops.triton.attention.prefill import _fp_prefill_kernel
    from moekv.ops.triton.common import pow2
    from moekv.ops.triton.layer.invariant_linear import FIXED_CONFIG, _invariant_linear_kernel

    def build(kernel, types, consts, options):
        signature = {name: "constexpr" if name in consts else types.get(name, "i32")
                     for name in inspect.signature(kernel.fn).parameters}
        return triton.compile(ASTSource(kernel, signature, consts, {}), target=GPUTarget("cuda", arch, 32),
                              options=options).asm["ptx"]

    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "block_tables_ptr": "*i32",
                "query_start_loc_ptr": "*i32", "context_lens_ptr": "*i32", "seq_lens_ptr": "*i32",
                "partial_ptr": "*fp32", "lse_ptr": "*fp32", "counters_ptr": "*i32", "qk_scale": "fp32",
                "x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "b_ptr": "*bf16"}
    rows, attention = invariant.block_rows(group), {"num_warps": invariant.NUM_WARPS, "num_stages": 2,
                                                    "enable_fp_fusion": False}
    shared = dict(PAGE_SIZE=16, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=pow2(head_dim), BLOCK_N=invariant.BLOCK_N,
                  HALF=True, UPCAST=False)
    linear = dict(HAS_BIAS=True, FP8=False, SCALE_BN=1, UPCAST=False, EMULATE_BF16=False,
                  **{k: v for k, v in FIXED_CONFIG.items() if k.startswith("BLOCK")})
    options = {k: v for k, v in FIXED_CONFIG.items() if not k.startswith("BLOCK")}
    return {
        "decode": build(_fp_decode_kernel, pointers, dict(shared, BLOCK_H=rows, SPLIT=True, DEVICE_SPLITS=False,
                                                          COMBINE=False, BLOCK_SC=1, INVARIANT=True, USE_PDL=False),
                         attention),
        "prefill": build(_fp_prefill_kernel, pointers, dict(shared, BLOCK_Q=rows // group, BLOCK_M=rows,
                                                            INVARIANT=True, SPLIT_TOKENS=invariant.SPLIT_TOKENS),
                         attention),
        "merge": build(invariant._merge_splits_kernel, pointers, dict(GROUP=group, BLOCK_H=rows, HEAD_DIM=head_dim,
                                                                      BLOCK_D=pow2(head_dim),
                                                                      SPLIT_LEN=invariant.SPLIT_TOKENS),
                       {"num_warps": invariant.NUM_WARPS, "enable_fp_fusion": False}),
        "linear": build(_invariant_linear_kernel, pointers, linear, options),
        "linear_fp8": build(_invariant_linear_kernel, dict(pointers, w_ptr="*fp8e4nv"), dict(linear, FP8=True),
                            options),
    }


def compile_norm_route(fold: bool, hidden: int = 2048, num_experts: int = 128, top_k: int = 8, arch: int = 90,
                       ir: str = "ptx") -> str:
    """The add + norm + route kernel as add_rms_norm_route launches it for a router of several blocks (Qwen3-30B-A3B's
    [128, 2048] bf16 by default) with the expert-load count and token_valid: fold (the last program of a token routes
    after an arrival count) or not (the routing kernel would follow) -> its `ir` ("ptx", "ttgir") for sm_`arch`."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekv.ops.triton.layer.norm_route import _add_norm_route_kernel, launch_config

    cfg = launch_config(hidden, num_experts, 2)
    num_warps = cfg.pop("num_warps")
    types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "rw_ptr": "*bf16", "normed_ptr": "*bf16",
             "new_res_ptr": "*bf16", "logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64",
             "load_ptr": "*i64", "valid_ptr": "*i64", "counters_ptr": "*i32", "eps": "fp32"}
    consts = dict(TOP_K=top_k, RENORMALIZE=True, HAS_LOAD=True, HAS_VALID=True, FUSE_TOPK=False,
                  E_PAD=triton.next_power_of_2(num_experts), K_PAD=triton.next_power_of_2(max(top_k, 2)),
                  LIBDEVICE_EXP=True, EMULATE_BF16=False, FOLD=fold, USE_PDL=False, **cfg)
    names = list(inspect.signature(_add_norm_route_kernel.fn).parameters)
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    aligned = [n for n in names if n.endswith("_ptr") or n in ("hidden", "num_experts", "stride_xt", "stride_rt",
                                                                 "stride_we")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(_add_norm_route_kernel, signature, consts, attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False}).asm[ir]


def compile_route_topk(num_warps: int, num_experts: int = 128, top_k: int = 8, arch: int = 90,
                       ir: str = "ttgir") -> str:
    """The routing kernel as norm_route's second launch specialises it (bf16 logits, load count, token_valid)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekv.ops.triton.layer.routing import _route_topk_kernel

    types = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64", "load_ptr": "*i64", "valid_ptr": "*i64"}
    consts = dict(TOP_K=top_k, RENORMALIZE=True, HAS_LOAD=True, HAS_VALID=True,
                  E_PAD=triton.next_power_of_2(num_experts), K_PAD=triton.next_power_of_2(max(top_k, 2)),
                  LIBDEVICE_EXP=True, USE_PDL=False)
    names = list(inspect.signature(_route_topk_kernel.fn).parameters)
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n.endswith("_ptr") or n in ("num_experts", "stride_t")}
    return triton.compile(ASTSource(_route_topk_kernel, signature, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False}).asm[ir]


def assert_last_arrival_order(ptx: str) -> None:
    """The last-arrival pattern of a compiled kernel (the split combine, the routing fold): the partial stores are
    fenced off by a CTA barrier before the one gpu-scope acq_rel add on the counter, a barrier follows it, the last
    program's first read goes to L2 (.cg) after that, and only then is the counter stored back to zero."""
    import re

    lines = [line.strip() for line in ptx.splitlines()]
    lines = [line for line in lines if line and not line.startswith((".loc", "//"))]
    atoms = [i for i, line in enumerate(lines) if "atom." in line]
    assert len(atoms) == 1 and "atom.global.gpu.acq_rel.add" in lines[atoms[0]], [lines[i] for i in atoms]
    at = atoms[0]
    counter = re.search(r"\[ (%rd\d+) \+ 0 \]", lines[at]).group(1)
    last_store = max(i for i, line in enumerate(lines[:at]) if "st.global" in line)
    assert any(line.startswith("bar.sync") for line in lines[last_store:at])
    first_read = next(i for i, line in enumerate(lines) if i > at and "ld.global" in line)
    assert ".cg" in lines[first_read] and any(line.startswith("bar.sync") for line in lines[at:first_read])
    resets = [i for i, line in enumerate(lines) if "st.global" in line and f"[ {counter} + 0 ]" in line]
    assert resets and min(resets) > first_read


def ptx_in_child(expression: str) -> list[str]:
    """PTX texts from a child Python without TRITON_INTERPRET (the suite sets it; an interpreted kernel has no
    compiler): `expression` is evaluated there with this module's names and must give a list of PTX strings."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import sys; from tests.ops.ptx_compile import *; sys.stdout.write(chr(0).join({expression}))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split(chr(0))


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
