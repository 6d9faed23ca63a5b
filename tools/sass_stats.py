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


# ---------------------------------------------------------------- occupancy
SM90_REGS, SM90_SHARED, SM90_WARPS, SM90_BLOCKS = 65536, 233472, 64, 32


def programs_per_sm(registers: int, shared: int, num_warps: int) -> int:
    """Resident programs per sm_90 SM: registers (per thread rounded up to 8, per warp to 256),
    shared memory (228 KB per SM, 1 KB reserved per program), 64 warps, 32 programs."""
    per_warp = -(-(-(-registers // 8) * 8 * 32) // 256) * 256
    by_regs = SM90_REGS // per_warp // num_warps
    by_shared = SM90_SHARED // (shared + 1024)
    return min(by_regs, by_shared, SM90_WARPS // num_warps, SM90_BLOCKS)
