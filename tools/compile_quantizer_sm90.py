"""Compile the Triton page quantizer for Hopper (sm_90) on a machine without a GPU: catches what the interpreter
accepts and the compiler refuses (session 18: a constexpr re-declared inside tl.static_range passed
TRITON_INTERPRET=1 and failed on the H200). Run it with the device's triton version (3.6) in a side venv:

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    PYTHONPATH=/tmp/t36/lib/python3.11/site-packages:src:.:.venv/lib/python3.11/site-packages \
        /tmp/t36/bin/python tools/compile_quantizer_sm90.py

(the value quantizer with the default range search + refinement: ~200 s on 2 cores, ~10 MB of PTX). Cases: int3
values (range search 8 + ends 2, outliers by deviation), int3 keys (min/max), then int4's defaults (issue 23):
values with the same search and outliers chosen by range (OUTLIER_RANGE: one runtime loop body), and keys with
outliers by range (a key outlier budget is not the cache's default). `... compile_quantizer_sm90.py 2` compiles
case 2 alone; cases 4-7 (int3 values, int2 values and keys, int4 values, without the search: seconds) check the fragment-order
stores alone.
"""
import time, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from moekv.ops.triton.lowbit.quantize import _quantize_kernel as k
import inspect
names = list(inspect.signature(k.fn).parameters)
ptr = {"x_ptr": "*bf16", "codes_ptr": "*i32", "scale_ptr": "*u8", "zero_ptr": "*u8", "base_ptr": "*fp16",
       "outlier_vals_ptr": "*fp16", "outlier_idx_ptr": "*i16", "outlier_count_ptr": "*i16", "qualifying_ptr": "*i32",
       "pages_ptr": "*i32", "slots_ptr": "*i32", "counters_ptr": "*i32"}
CASES = ((3, False, 8, 2, 1, False), (3, True, 0, 0, 1, False), (4, False, 8, 2, 1, True), (4, True, 0, 0, 1, True),
         (3, False, 0, 0, 1, False), (2, False, 0, 0, 1, False), (2, True, 0, 0, 1, False),
         (4, False, 0, 0, 1, False))
only = [int(a) for a in __import__("sys").argv[1:]]       # optional: case numbers to compile
for case, (bits, axis_channel, clip, refine, G, by_range) in enumerate(CASES):
    if only and case not in only:
        continue
    cexpr = dict(COUNT=False, CNT_BUDGET=0, CNT_OUTLIERS=0, CNT_QUALIFYING=0, CNT_PAGES=0, STAGED=True, NUM_HEADS=8,
                 P=128, D=128, G=G, BITS=bits, AXIS_CHANNEL=axis_channel, GROUP_LEN=128, CAPACITY=41, BLOCK_C=64,
                 WORDS=12 if bits == 3 else 128 * bits // 32, CLIP_STEPS=clip, CLIP_REFINE=refine,
                 OUTLIER_RANGE=by_range)
    sig = {}
    for n in names:
        if n in cexpr: sig[n] = "constexpr"
        elif n in ptr: sig[n] = ptr[n]
        elif n == "tau": sig[n] = "fp32"
        else: sig[n] = "i32"
    t0 = time.time()
    src = ASTSource(fn=k, signature=sig, constexprs={(names.index(n),): v for n, v in cexpr.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    print("ok", f"int{bits}", "channel" if axis_channel else "token", clip, refine, "range" if by_range else "deviation",
          round(time.time() - t0, 1), "s", len(c.asm.get("ptx", "")))
