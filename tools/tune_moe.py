#!/usr/bin/env python3
"""Tune the launch configurations of the fused MoE kernels for one expert shape on this GPU.

Writes (merging with an existing file) src/moekv/ops/triton/moe/configs/
E={E},H={H},I={I},dtype={dtype},device={GPU name}.json -- the table ops.triton.moe.configs reads.

For every token count T of --tokens:
  * decode path (T <= 64), its "dot" kernels (an entry's "VARIANT" and "fma" tiles are kept as they are:
    benchmarks/bench_moe.py --variants dot,fma --fma-sweep measures the fma variant): coordinate descent --
    the gate_up launch alone over (BLOCK_N, BLOCK_K) at 4 warps / 3 stages, then over (num_warps,
    num_stages); then the down launch (timed as the whole decode call with the best gate_up) over
    (BLOCK_N, BLOCK_K, SPLIT_K), then (num_warps, num_stages).
  * grouped path: for each BLOCK_M, the same descent for gate_up (timed after a fixed align) and for
    down (timed as the whole grouped call: align + gate_up + down + combine); the fastest BLOCK_M wins.
  * every winner is checked against the reference (a fast wrong config is an error, not a result).
Then decode_max_tokens = the largest tuned T up to which the decode path beats the grouped one.
Routing is uniform random top-k (distinct experts per token), seeded. Timing: the median of CUDA-graph replays with
the L2 flushed before each call (graph_ms; do_bench, --rep-ms, only for a call that cannot be captured: do_bench's
host-launched calls timed the launches at decode sizes, 0.089 ms for a 0.034 ms kernel pair at T=1); on the CPU
interpreter (--tiny) one timed call.

    python tools/tune_moe.py --model mixtral-8x7b                      # on the H200
    python tools/tune_moe.py --model qwen3-30b-a3b --tokens 1,4,16,64,256,1024
    python tools/tune_moe.py --shape 8,4096,14336 --top-k 2 --max-minutes 8
    python tools/tune_moe.py --tiny                                   # CPU: checks the logic in ~1 minute
    python tools/tune_moe.py --model mixtral-8x7b --quantization fp8   # FP8 experts (W8A16): their own file

A run writes the file after every T, so a run cut short (--max-minutes, or killed) keeps what it
measured; run it again to fill in the rest (tuned T are skipped unless --overwrite).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]
if not torch.cuda.is_available():                    # before moekv.ops.triton decorates its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from moekv.core.fp8 import Fp8Weight, quantize_per_expert  # noqa: E402
from moekv.models.registry import NAMED_SHAPES  # noqa: E402
from moekv.ops.reference.moe import moe_experts_reference  # noqa: E402
from moekv.ops.triton.moe import configs as moe_configs  # noqa: E402
from moekv.ops.triton.moe import decode as moe_decode  # noqa: E402
from moekv.ops.triton.moe import grouped as moe_grouped  # noqa: E402
from moekv.ops.triton.moe.align import moe_align  # noqa: E402
from moekv.provenance import git_commit  # noqa: E402

FULL_SPACE = {
    "decode_gate_up": {"BLOCK_N": [16, 32, 64, 128], "BLOCK_K": [64, 128, 256]},
    "decode_down": {"BLOCK_N": [16, 32, 64, 128], "BLOCK_K": [64, 128, 256], "SPLIT_K": [1, 2, 4, 8, 16]},
    "grouped_block_m": [16, 32, 64, 128],
    "grouped": {"BLOCK_N": [64, 128, 256], "BLOCK_K": [64, 128], "GROUP_M": [8]},
    "launch": {"num_warps": [4, 8], "num_stages": [2, 3, 4, 5]},
    "decode_launch": {"num_warps": [2, 4, 8], "num_stages": [2, 3, 4, 5]},
}
TINY_SPACE = {
    "decode_gate_up": {"BLOCK_N": [16, 32], "BLOCK_K": [32, 64]},
    "decode_down": {"BLOCK_N": [16], "BLOCK_K": [32], "SPLIT_K": [1, 2]},
    "grouped_block_m": [16, 32],
    "grouped": {"BLOCK_N": [16, 32], "BLOCK_K": [32], "GROUP_M": [4]},
    "launch": {"num_warps": [4], "num_stages": [2]},
    "decode_launch": {"num_warps": [4], "num_stages": [2]},
}
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192]
TINY = dict(shape=(4, 64, 64), top_k=2, tokens=[1, 3, 24])
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(NAMED_SHAPES), help="take E, H, I and top-k of a named shape")
    parser.add_argument("--shape", help="E,H,I (instead of --model)")
    parser.add_argument("--top-k", type=int, help="routed experts per token (default: the model's, else 2)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none",
                        help="fp8: tune the W8A16 path on FP8 experts (per output channel scales; written to the "
                             "weights=fp8 file)")
    parser.add_argument("--tokens", help=f"comma-separated token counts (default {DEFAULT_TOKENS})")
    parser.add_argument("--rep-ms", type=int, default=20, help="do_bench measuring time per config")
    parser.add_argument("--max-minutes", type=float, default=9.0, help="stop after this long (writes what is done)")
    parser.add_argument("--out-dir", type=Path, help="default: the package's moe_configs (CUDA), a temp dir (CPU)")
    parser.add_argument("--overwrite", action="store_true", help="re-tune token counts the file already has")
    parser.add_argument("--tiny", action="store_true", help="tiny shape and search space (CPU interpreter check)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tiny:
        args.shape = args.shape or ",".join(map(str, TINY["shape"]))
        args.top_k = args.top_k or TINY["top_k"]
        args.tokens = args.tokens or ",".join(map(str, TINY["tokens"]))
    if args.model:
        shape = NAMED_SHAPES[args.model]
        args.experts, args.hidden, args.inter = shape["num_experts"], shape["hidden_size"], shape["expert_intermediate_size"]
        args.top_k = args.top_k or shape["top_k"]
    elif args.shape:
        args.experts, args.hidden, args.inter = (int(v) for v in args.shape.split(","))
        args.top_k = args.top_k or 2
    else:
        parser.error("give --model, --shape or --tiny")
    args.token_counts = [int(v) for v in args.tokens.split(",")] if args.tokens else DEFAULT_TOKENS
    return args


class Problem:
    """The weights of one MoE layer and a routing per token count, on the tuning device."""

    def __init__(self, args, device: torch.device):
        self.args = args
        self.device = device
        self.dtype = DTYPES[args.dtype]
        gen = torch.Generator(device=device).manual_seed(args.seed)
        E, H, I = args.experts, args.hidden, args.inter
        self.w_gate_up = (torch.randn(E, 2 * I, H, generator=gen, device=device) / H ** 0.5).to(self.dtype)
        self.w_down = (torch.randn(E, H, I, generator=gen, device=device) / I ** 0.5).to(self.dtype)
        self.weights = None if args.quantization == "none" else args.quantization    # the config file's key
        if self.weights == "fp8":                 # per output channel, as --quantization fp8 loads them
            self.w_gate_up, self.w_down = quantize_per_expert(self.w_gate_up), quantize_per_expert(self.w_down)
        self.seed = args.seed

    def inputs(self, num_tokens: int):
        gen = torch.Generator(device=self.device).manual_seed(self.seed + num_tokens)
        hidden = torch.randn(num_tokens, self.args.hidden, generator=gen, device=self.device).to(self.dtype)
        scores = torch.rand(num_tokens, self.args.experts, generator=gen, device=self.device)
        weights, ids = torch.topk(scores, self.args.top_k, dim=-1)           # distinct experts per token
        weights = weights / weights.sum(-1, keepdim=True)
        return hidden, self.w_gate_up, self.w_down, ids, weights


_FLUSH: dict = {}


def graph_ms(fn, device: torch.device) -> float:
    """GPU milliseconds of one fn() call with a cold L2: CUDA-graph replays of (zero a 256 MiB buffer, fn) minus the
    zeroing alone (benchmarks.timing.cuda_graph_ms). Unlike do_bench's host-launched calls, the launches' host cost
    does not count: at decode sizes (~30 us of kernels in 2-3 launches) do_bench timed the host, not the kernels."""
    from benchmarks.timing import cuda_graph_ms

    if device not in _FLUSH:
        flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
        _FLUSH[device] = (flush, cuda_graph_ms(flush.zero_, 10, 5))
    flush, flush_ms = _FLUSH[device]

    def body():
        flush.zero_()
        fn()
    return max(cuda_graph_ms(body, 10, 5) - flush_ms, 1e-4)


def measure(fn, device: torch.device, rep_ms: int) -> float:
    """Milliseconds per call (inf when the config does not compile or run, e.g. too much shared memory). CUDA:
    graph_ms where the call can be captured in a CUDA graph, else triton's do_bench."""
    try:
        if device.type == "cuda":
            fn()                                                              # compile outside the capture
            try:
                return graph_ms(fn, device)
            except RuntimeError as exc:                                       # not capturable (a host sync)
                if "captur" not in str(exc).lower():
                    raise
                torch.cuda.synchronize()
            return float(triton.testing.do_bench(fn, warmup=max(2, rep_ms // 4), rep=rep_ms, return_mode="median"))
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    except Exception as exc:                                                  # noqa: BLE001
        if "out of resource" not in str(exc).lower() and "OutOfResources" not in type(exc).__name__:
            print(f"    config failed: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
        return math.inf


def grid(space: dict[str, list]) -> list[dict]:
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def descend(base: dict, tile_space: dict, launch_space: dict, run, log: str) -> tuple[dict, float]:
    """Best tile sizes at the base launch, then the best launch at those tiles. run(cfg) -> ms."""
    best, best_ms = None, math.inf
    for tiles in grid(tile_space):
        cfg = {**base, **tiles}
        ms = run(cfg)
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"{log}: no configuration ran")
    for launch in grid(launch_space):
        cfg = {**best, **launch}
        ms = run(cfg)
        if ms < best_ms:
            best, best_ms = cfg, ms
    print(f"    {log}: {best_ms:.4f} ms {best}")
    return best, best_ms


def tune_decode(problem: Problem, num_tokens: int, space: dict, rep_ms: int) -> tuple[dict, float]:
    inputs = problem.inputs(num_tokens)
    hidden, w_gate_up, _, ids, _ = inputs
    device = problem.device
    base = {"num_warps": 4, "num_stages": 3} if device.type == "cuda" else {"num_warps": 4, "num_stages": 2}
    inter, hidden_size = problem.args.inter, problem.args.hidden
    fit = lambda space_, n, k: {"BLOCK_N": [b for b in space_["BLOCK_N"] if b <= max(16, triton.next_power_of_2(n))],
                                "BLOCK_K": [b for b in space_["BLOCK_K"] if b <= max(16, triton.next_power_of_2(k))]}
    gate_up_space = fit(space["decode_gate_up"], inter, hidden_size)
    gate_up, _ = descend(base, gate_up_space, space["decode_launch"],
                         lambda cfg: measure(lambda: moe_decode.decode_activation(hidden, w_gate_up, ids, {
                             "VARIANT": "dot", "gate_up": cfg}), device, rep_ms),
                         f"decode T={num_tokens} gate_up")
    down_space = {**fit(space["decode_down"], hidden_size, inter), "SPLIT_K": space["decode_down"]["SPLIT_K"]}
    down_space["SPLIT_K"] = [s for s in down_space["SPLIT_K"] if s == 1 or inter // s >= min(down_space["BLOCK_K"])]
    down, total = descend(base, down_space, space["decode_launch"],
                          lambda cfg: measure(lambda: moe_decode.moe_experts_decode(*inputs, config={
                              "VARIANT": "dot", "gate_up": gate_up, "down": cfg}), device, rep_ms),
                          f"decode T={num_tokens} total")
    entry = {"gate_up": gate_up, "down": down}
    check(problem, num_tokens, lambda: moe_decode.moe_experts_decode(*inputs, config=dict(entry, VARIANT="dot")))
    return entry, total


def tune_grouped(problem: Problem, num_tokens: int, space: dict, rep_ms: int) -> tuple[dict, float]:
    inputs = problem.inputs(num_tokens)
    hidden, w_gate_up, _, ids, _ = inputs
    device = problem.device
    base = {"num_warps": 4, "num_stages": 3} if device.type == "cuda" else {"num_warps": 4, "num_stages": 2}
    best_entry, best_ms = None, math.inf
    for block_m in space["grouped_block_m"]:
        aligned = moe_align(ids, problem.args.experts, block_m)
        gate_up, _ = descend(base, space["grouped"], space["launch"],
                             lambda cfg: measure(lambda: moe_grouped.grouped_activation(
                                 hidden, w_gate_up, ids, {"BLOCK_M": block_m, "gate_up": cfg}, aligned), device, rep_ms),
                             f"grouped T={num_tokens} BLOCK_M={block_m} gate_up")
        down, total = descend(base, space["grouped"], space["launch"],
                              lambda cfg: measure(lambda: moe_grouped.moe_experts_grouped(*inputs, config={
                                  "BLOCK_M": block_m, "gate_up": gate_up, "down": cfg}), device, rep_ms),
                              f"grouped T={num_tokens} BLOCK_M={block_m} total")
        if total < best_ms:
            best_entry, best_ms = {"BLOCK_M": block_m, "gate_up": gate_up, "down": down}, total
    check(problem, num_tokens, lambda: moe_grouped.moe_experts_grouped(*inputs, config=best_entry))
    return best_entry, best_ms


def check(problem: Problem, num_tokens: int, run) -> None:
    hidden, w_gate_up, w_down, ids, weights = problem.inputs(num_tokens)
    widen = lambda w: w.dequantize() if isinstance(w, Fp8Weight) else w.float()
    expected = moe_experts_reference(hidden.float(), widen(w_gate_up), widen(w_down), ids, weights)
    error = (run().float() - expected).abs().max().item()
    tolerance = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[problem.dtype]
    scale = expected.abs().max().item()
    if not error <= tolerance * max(scale, 1e-6):
        raise AssertionError(f"T={num_tokens}: tuned kernel differs from the reference by {error:.3e} "
                             f"(max |ref| {scale:.3e})")


def crossover(decode_ms: dict[int, float], grouped_ms: dict[int, float]) -> int:
    """Largest T such that the decode path is no slower than the grouped one at every tuned T <= it."""
    limit = 0
    for t in sorted(decode_ms):
        if t in grouped_ms and decode_ms[t] > grouped_ms[t]:
            break
        limit = t
    return min(limit, moe_decode.MAX_DECODE_TOKENS)


def main(argv=None) -> Path:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        print("no CUDA device: use --tiny to check the logic under the interpreter", file=sys.stderr)
        raise SystemExit(2)
    space = TINY_SPACE if args.tiny else FULL_SPACE
    out_dir = args.out_dir or (moe_configs.CONFIG_DIR if device.type == "cuda" else Path(tempfile.mkdtemp()))
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[args.dtype]
    name = moe_configs.device_name(device)
    weights = None if args.quantization == "none" else args.quantization
    path = out_dir / moe_configs.config_filename(args.experts, args.hidden, args.inter, dtype, name, weights)
    table = json.loads(path.read_text()) if path.is_file() else {}
    table.setdefault("decode", {})
    table.setdefault("grouped", {})
    meta = table.setdefault("meta", {})
    times = meta.setdefault("times_ms", {})
    times.setdefault("decode", {})
    times.setdefault("grouped", {})        # a file tuned for the decode path only has no grouped times yet
    problem = Problem(args, device)
    deadline = time.monotonic() + args.max_minutes * 60
    print(f"tuning E={args.experts} H={args.hidden} I={args.inter} top_k={args.top_k} {args.dtype} on {name} -> {path}")

    for num_tokens in args.token_counts:
        if time.monotonic() > deadline:
            print(f"time budget of {args.max_minutes} min spent; stopping before T={num_tokens}")
            break
        key = str(num_tokens)
        if num_tokens <= moe_decode.MAX_DECODE_TOKENS and (args.overwrite or key not in table["decode"]):
            entry, times["decode"][key] = tune_decode(problem, num_tokens, space, args.rep_ms)
            kept = {k: v for k, v in table["decode"].get(key, {}).items() if k in ("VARIANT", "fma")}
            table["decode"][key] = {**entry, **kept}      # the dot tiles re-tuned; the variant choice kept
        if args.overwrite or key not in table["grouped"]:
            table["grouped"][key], times["grouped"][key] = tune_grouped(problem, num_tokens, space, args.rep_ms)
        table["decode_max_tokens"] = crossover({int(k): v for k, v in times["decode"].items()},
                                               {int(k): v for k, v in times["grouped"].items()})
        meta.update(device=name, dtype=args.dtype, weights=weights or "16-bit", num_experts=args.experts, hidden=args.hidden, inter=args.inter,
                    top_k=args.top_k, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    commit=git_commit(), command=" ".join(["python", "tools/tune_moe.py", *(argv or sys.argv[1:])]),
                    torch=torch.__version__, triton=triton.__version__, python=platform.python_version())
        table["decode"] = dict(sorted(table["decode"].items(), key=lambda kv: int(kv[0])))
        table["grouped"] = dict(sorted(table["grouped"].items(), key=lambda kv: int(kv[0])))
        for kind in ("decode", "grouped"):
            times[kind] = dict(sorted(times[kind].items(), key=lambda kv: int(kv[0])))
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"  T={num_tokens}: decode {times['decode'].get(key, float('nan')):.4f} ms, grouped "
              f"{times['grouped'][key]:.4f} ms; decode_max_tokens={table['decode_max_tokens']}")
    print(f"wrote {path}")
    read_back(out_dir, args, dtype, device, table)
    return path


def read_back(out_dir: Path, args, dtype: torch.dtype, device: torch.device, table: dict) -> None:
    """The kernels' config lookup finds what was written (the folder swapped in for the check)."""
    saved = moe_configs.CONFIG_DIR
    moe_configs.CONFIG_DIR = out_dir
    moe_configs.load_tuned.cache_clear()
    moe_configs._cached_config.cache_clear()
    try:
        shape = (args.experts, args.hidden, args.inter)
        weights = None if args.quantization == "none" else args.quantization
        assert moe_configs.decode_max_tokens(*shape, dtype, device, weights) == table["decode_max_tokens"]
        for num_tokens, entry in table["grouped"].items():
            assert moe_configs.get_config("grouped", *shape, int(num_tokens), dtype, device, weights=weights) == entry
        for num_tokens, entry in table["decode"].items():
            assert moe_configs.get_config("decode", *shape, int(num_tokens), dtype, device, weights=weights) == entry
    finally:
        moe_configs.CONFIG_DIR = saved
        moe_configs.load_tuned.cache_clear()
        moe_configs._cached_config.cache_clear()
    print("read back through moe_configs.get_config: ok")


if __name__ == "__main__":
    main()
