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
