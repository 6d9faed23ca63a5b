"""Compile a Triton kernel for an H100/H200 (sm_90) on a machine without a GPU and print its
resource usage (registers, spills, shared memory) and a histogram of its SASS instructions.

Triton ships ptxas/cuobjdump, so this needs no CUDA device. Use it to count instructions per
value of a kernel's inner loop before spending GPU time.

    from tools.sass_stats import compile_sm90, report
    kernel = compile_sm90(my_kernel, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128},
                          num_warps=4, num_stages=2)
    print(report(kernel))
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _bin(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 2):
    """signature: argument name -> type string ('*fp16', 'i32', 'fp32', 'constexpr'); constexprs: name -> value."""
    source = ASTSource(fn=fn, signature=signature, constexprs={k: v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resource_usage(kernel) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(kernel.asm["cubin"])
        handle.flush()
        text = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", handle.name],
                              capture_output=True, text=True, check=True).stdout
    usage = {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    return usage


def sass(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(kernel.asm["cubin"])
        handle.flush()
        return subprocess.run([_bin("cuobjdump"), "-sass", handle.name], capture_output=True, text=True,
                              check=True).stdout


def histogram(sass_text: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in sass_text.splitlines():
        match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
        if match:
            counts[match.group(1)] += 1
    return counts


def report(kernel, top: int = 25) -> str:
    usage = resource_usage(kernel)
    counts = histogram(sass(kernel))
    lines = [f"registers {usage.get('REG')}, local (spill) bytes {usage.get('LOCAL', 0)}, "
             f"stack {usage.get('STACK', 0)}, static shared {usage.get('SHARED', 0)} B, "
             f"dynamic shared {kernel.metadata.shared} B, {sum(counts.values())} SASS instructions"]
    lines += [f"  {name:10s} {count}" for name, count in counts.most_common(top)]
    return "\n".join(lines)


# ---------------------------------------------------------------- a wrapper's real launch, compiled for sm_90
def compile_launch(fn, args: tuple, kwargs: dict, capability: int = 90):
    """Compile `fn[grid](*args, **kwargs)` for sm_`capability` exactly as a launch on that GPU would:
    the same signature, constexprs and specialisation (ints equal to 1, 16-byte alignment of pointers
    and divisibility of ints by 16) -- computed from the arguments (CPU tensors are fine)."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=options.__dict__)


class capture_launch:
    """with capture_launch(module, "kernel_name") as launches: module.wrapper(...)  -- records the
    wrapper's kernel launches as (grid, args, kwargs) instead of running them (and disables the
    module's check_launchable, so CPU tensors pass without the interpreter). `skip`: other module
    globals to replace by no-ops for the duration (e.g. a second kernel's wrapper); `patch`: module
    globals to replace by the given objects (e.g. a function that would answer differently on a CPU)."""

    def __init__(self, module, name: str, skip: tuple = (), patch: dict | None = None):
        self.module, self.name, self.skip, self.launches = module, name, tuple(skip), []
        self.patch = dict(patch or {})

    def __enter__(self):
        names = (self.name, "check_launchable", *self.skip, *self.patch)
        self.saved = {n: getattr(self.module, n) for n in names if hasattr(self.module, n)}
        launches = self.launches

        class Recorder:
            def __getitem__(self, grid):
                return lambda *a, **k: launches.append((grid, a, k))
        setattr(self.module, self.name, Recorder())
        for n in ("check_launchable", *self.skip):
            if n in self.saved:
                setattr(self.module, n, lambda *a, **k: None)
        for n, v in self.patch.items():
            setattr(self.module, n, v)
        return self.launches

    def __exit__(self, *exc):
        for n, v in self.saved.items():
            setattr(self.module, n, v)


def instructions(sass_text: str) -> list[tuple[int, str, str]]:
    """(address, opcode, full text) of every SASS instruction, in order."""
    out = []
    for line in sass_text.splitlines():
        match = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?.*?);", line)
        if match:
            out.append((int(match.group(1), 16), match.group(3), match.group(2)))
    return out


def loops(instrs: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """Loops as (first, last) instruction indices: every backward branch (BRA to a lower address),
    widened to the farthest backward branch that targets the same head. Sorted by size, largest first."""
    index_of = {address: i for i, (address, _, _) in enumerate(instrs)}
    heads: dict[int, int] = {}
    for i, (_, op, text) in enumerate(instrs):
        if op != "BRA":
            continue
        match = re.search(r"BRA(?:\.\w+)*\s+(?:\S+,\s*)?`?\(?\.?L?_?x?_?(?:0x)?([0-9a-f]+)\)?", text)
        if not match:
            continue
        target = int(match.group(1), 16)
        if target in index_of and index_of[target] <= i:
            heads[index_of[target]] = max(heads.get(index_of[target], 0), i)
    return sorted(heads.items(), key=lambda item: item[0] - item[1])


def loop_counts(kernel) -> list[dict]:
    """Per loop of the kernel (largest first): its span, its own instructions (inner loops excluded),
    and a histogram of those."""
    instrs = instructions(sass(kernel))
    spans = loops(instrs)
    result = []
    for first, last in spans:
        inner = [(a, b) for a, b in spans if first <= a and b <= last and (a, b) != (first, last)]
        own = [i for i in range(first, last + 1) if not any(a <= i <= b for a, b in inner)]
        counts = collections.Counter(instrs[i][1] for i in own)
        result.append({"first": first, "last": last, "size": last - first + 1, "own": len(own),
                       "inner": len([s for s in inner if not any(o != s and o[0] <= s[0] and s[1] <= o[1]
                                                                 for o in inner)]),
                       "histogram": counts})
    return result


# ---------------------------------------------------------------- the decode-only low-bit kernel (lowbit_decode_tc)
SM90_REGS, SM90_SHARED, SM90_WARPS, SM90_BLOCKS = 65536, 233472, 64, 32


def programs_per_sm(registers: int, shared: int, num_warps: int) -> int:
    """Resident programs per sm_90 SM: registers (per thread rounded up to 8, per warp to 256),
    shared memory (228 KB per SM, 1 KB reserved per program), 64 warps, 32 programs."""
    per_warp = -(-(-(-registers // 8) * 8 * 32) // 256) * 256
    by_regs = SM90_REGS // per_warp // num_warps
    by_shared = SM90_SHARED // (shared + 1024)
    return min(by_regs, by_shared, SM90_WARPS // num_warps, SM90_BLOCKS)


def lowbit_tc_stats(bits: int, outliers_per_page: float = 39.0, dtype: str = "bfloat16", outlier_fraction: float = 0.01,
                    **cfg) -> dict:
    """Compile lowbit_decode_tc's kernel for sm_90 as the benchmark launches it (Hq 32, Hkv 8, D 128,
    page 128, bf16, channel-axis keys, 1% outlier capacity, 2 splits) with launch overrides `cfg`;
    return registers, spills, shared memory, programs per SM and SASS instructions of the page loop:
    its own (per K/V value: x threads / (2 x BLOCK_N x D)) and with ceil((outliers - outlier_pre * BLOCK_C) /
    BLOCK_C) passes of each outlier loop (keys, values) per block and page-head (the preloaded
    outlier_pre chunks count in the loop's own instructions, each once)."""
    import torch
    from moekv.ops.triton.lowbit import decode_tc as tc
    from moekv.testing.attention_cases import build_case

    torch_dtype = getattr(torch, dtype)
    case = build_case([300], [1], 8, 4, 128, bits, 128, dtype=torch_dtype, outlier_fraction=outlier_fraction, seed=0)
    gpu_modes = {"dot_modes": lambda q, d: (q.dtype == d and d in (torch.float16, torch.bfloat16),
                                            not (q.dtype == d and d in (torch.float16, torch.bfloat16)))}
    cfg.setdefault("num_splits", 2)
    with capture_launch(tc, "_decode_tc_kernel", skip=("combine_splits",), patch=gpu_modes) as launches:
        tc.paged_attention_lowbit_decode_tc(*case.args(), 0.125, **cfg)
    grid, args, kwargs = launches[0]
    kernel = compile_launch(tc._decode_tc_kernel, args, kwargs)
    usage = resource_usage(kernel)
    warps = kwargs["num_warps"]
    shared = kernel.metadata.shared + usage.get("SHARED", 0)
    loop_list = loop_counts(kernel)
    main = loop_list[0]
    inner = sorted([lp for lp in loop_list[1:] if main["first"] <= lp["first"] and lp["last"] <= main["last"]],
                   key=lambda lp: lp["first"])
    block_n, block_c = kwargs["BLOCK_N"], kwargs["BLOCK_C"]
    values = 2 * block_n * 128
    first = kwargs.get("PRE", 0) * kwargs["BLOCK_C"]                 # slots handled in the loop body itself
    passes = -(-max(outliers_per_page - first, 0) // block_c) * block_n / 128   # outlier loops: once per block
    with_outliers = main["own"] + passes * sum(lp["own"] for lp in inner)
    return {"registers": usage.get("REG"), "spill_bytes": usage.get("LOCAL", 0), "stack": usage.get("STACK", 0),
            "shared": shared, "num_warps": warps, "programs_per_sm": programs_per_sm(usage.get("REG"), shared, warps),
            "loop_instructions": main["own"], "outlier_loops": [lp["own"] for lp in inner],
            "per_value": main["own"] * 32 * warps / values, "per_value_outliers": with_outliers * 32 * warps / values,
            "histogram": main["histogram"], "kernel": kernel}


def _main(argv=None) -> None:
    import argparse
    import json
    parser = argparse.ArgumentParser(description="static sm_90 stats of lowbit_decode_tc launch variants")
    parser.add_argument("--bits", default="3,4,2")
    parser.add_argument("--configs", default='[{}]', help="JSON list of launch-override dicts")
    parser.add_argument("--top", type=int, default=0, help="also print the page loop's top opcodes")
    args = parser.parse_args(argv)
    print("| bits | config | regs | spill B | shared B | warps | programs/SM (warps/SM) | loop instr "
          "| outlier loops k/v | instr/value | with 39 outliers |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for bits in (int(b) for b in args.bits.split(",")):
        for cfg in json.loads(args.configs):
            try:
                r = lowbit_tc_stats(bits, **cfg)
            except Exception as exc:  # noqa: BLE001
                print(f"| int{bits} | `{json.dumps(cfg)}` | failed: {type(exc).__name__}: {str(exc)[:100]} |",
                      flush=True)
                continue
            print(f"| int{bits} | `{json.dumps(cfg)}` | {r['registers']} | {r['spill_bytes'] + r['stack']} | "
                  f"{r['shared']} | {r['num_warps']} | {r['programs_per_sm']} "
                  f"({r['programs_per_sm'] * r['num_warps']}) | "
                  f"{r['loop_instructions']} | {'/'.join(map(str, r['outlier_loops']))} | {r['per_value']:.2f} | "
                  f"{r['per_value_outliers']:.2f} |", flush=True)
            if args.top:
                print("    " + ", ".join(f"{k} {v}" for k, v in r["histogram"].most_common(args.top)), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    _main()
