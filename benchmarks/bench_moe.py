"""The routed-experts layer alone: moekv's fused Triton kernels (the dispatch choice, the decode path,
the grouped path) vs the pure-PyTorch reference and transformers' experts implementations (grouped_mm,
eager) on one layer of a named shape with random weights.

    PYTHONPATH=src:. python benchmarks/bench_moe.py --model mixtral-8x7b --tokens 1,8,128
    PYTHONPATH=src:. python benchmarks/bench_moe.py --model qwen3-30b-a3b --tokens 1,8,128,1024
    PYTHONPATH=src:. python benchmarks/bench_moe.py --tiny      # CPU: the code paths under the interpreter
    PYTHONPATH=src:. python benchmarks/bench_moe.py --model mixtral-8x7b,qwen3-30b-a3b --quantization none,fp8
    PYTHONPATH=src:. python benchmarks/bench_moe.py --quantization fp8 --fp8-block 128x128   # checkpoints' blocks
    PYTHONPATH=src:. python benchmarks/bench_moe.py --model mixtral-8x7b,qwen3-30b-a3b --quantization fp8,none \
        --tokens 1,2,4 --variants dot,fma --fma-sweep --impl decode-dot,decode-fma,decode-fma-swept --out DIR

Timing (CUDA): median of CUDA-graph replays with L2 flushed (a 256 MiB buffer zeroed) before every
call, the flush timed alone and subtracted; a path that cannot be captured (the reference syncs with
the host) is timed eagerly with CUDA events, flush likewise subtracted. Achieved TB/s = bytes the
layer must read (the weights of the distinct routed experts + the input) plus the output it writes,
over the time; "% copy" compares that with the measured device-to-device copy bandwidth
((read + write) / time of a 2 GiB copy). Every implementation's output is compared with the fp32
reference (max error relative to max |ref|). Writes moe-bench-<model>-<gpu>.{json,md}; asserts
nothing about speed. --quantization fp8: the same layer's experts quantized to FP8 (per output channel, or
--fp8-block BNxBK block scales as FP8 checkpoints hold them); the W8A16 kernels read the e4m3 codes and their
fp32 scales (counted in the bytes), the oracle is the fp32 reference on the dequantized weights; transformers'
experts take 16-bit weights only. Several --model / --quantization values run one after the other, into one
result file.

--variants dot,fma adds the decode path's two kernel variants (ops.triton.moe.decode_config's "VARIANT"; "fma"
at T <= 4) as rows decode-dot / decode-fma, with their resolved tiles and the share of the read bandwidth
(benchmarks/timing.read_bandwidth); --fma-sweep first sweeps the fma tiles of each FP8 layer at one token
(benchmarks/moe_variants.py: a few dozen launches) and adds decode-fma-swept, the best tiles, at every T <= 4.
With either, the files are moe-bench-<model>-<weights>-<gpu>-variants.{json,md}; the markdown ends with the
variant table, the sweep and the best tiles as the tuned file's "fma" entry.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "--tiny" in sys.argv:                     # the Triton paths on a CPU: the interpreter, tiny shapes
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from benchmarks import moe_variants  # noqa: E402
from benchmarks.timing import cuda_graph_ms, read_bandwidth  # noqa: E402

from moekv.core.fp8 import Fp8Weight, quantize_per_expert  # noqa: E402
from moekv.models.registry import NAMED_SHAPES  # noqa: E402
from moekv.ops import dispatch  # noqa: E402
from moekv.ops.reference.moe import moe_experts_reference  # noqa: E402
from moekv.provenance import git_commit  # noqa: E402

TINY_SHAPE = dict(num_experts=8, hidden_size=64, expert_intermediate_size=48, top_k=2)
FLUSH_BYTES = 256 * 2**20
HOST_SYNCING = {"reference", "hf-eager"}     # bincount(...).tolist() / nonzero(): not graph-capturable


# ---------------------------------------------------------------- timing
class Timer:
    """Milliseconds per call: CUDA-graph replays (eager CUDA events as a fallback), L2 flushed before each
    call and the flush subtracted; on a CPU the wall clock of one call after a warm-up call."""

    def __init__(self, device: torch.device, reps: int = 10, trials: int = 5, cold: bool = True):
        self.device, self.reps, self.trials = device, reps, trials
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if cold and device.type == "cuda" else None
        self._flush = None

    def __call__(self, fn, capturable: bool = True) -> tuple[float, bool]:
        """(ms, whether a CUDA graph was replayed). capturable=False: paths that sync with the host."""
        if self.device.type != "cuda":
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3, False
        if self.flush is None:
            return self._measure(fn, capturable)
        flush = self._flush_ms(capturable)

        def body():
            self.flush.zero_()
            fn()
        ms, graph = self._measure(body, capturable)
        return max(ms - (flush if graph else self._flush_ms(False)), 1e-4), graph

    def _flush_ms(self, graph: bool) -> float:
        if self._flush is None:
            self._flush = {}
        if graph not in self._flush:
            self._flush[graph] = self._measure(self.flush.zero_, graph)[0]
        return self._flush[graph]

    def _measure(self, body, capturable: bool) -> tuple[float, bool]:
        if capturable:
            try:
                return self._graph_ms(body), True
            except Exception as exc:                                   # noqa: BLE001
                print(f"    (CUDA-graph capture failed, timing eagerly: {type(exc).__name__})", file=sys.stderr)
                torch.cuda.synchronize()
        return self._eager_ms(body), False

    def _graph_ms(self, body) -> float:
        return cuda_graph_ms(body, self.reps, self.trials)

    def _eager_ms(self, body) -> float:
        body()
        times = []
        for _ in range(self.trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.reps):
                body()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / self.reps)
        return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in TB/s ((read + write) bytes / time); None on a CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms, _ = Timer(device, reps=5, cold=False)(lambda: dst.copy_(src))
    del src, dst
    return 2 * 2 * 2**30 / ms / 1e9


# ---------------------------------------------------------------- the layer
def random_layer(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(w_gate_up [E, 2I, H], w_down [E, H, I], router [E, H]) ~ N(0, 0.02) like build_random_model."""
    gen = torch.Generator(device=device).manual_seed(seed)
    E, H, I = shape["num_experts"], shape["hidden_size"], shape["expert_intermediate_size"]
    make = lambda *size: torch.empty(size, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
    return make(E, 2 * I, H), make(E, H, I), make(E, H)


def routed_inputs(num_tokens: int, router: torch.Tensor, top_k: int, dtype: torch.dtype, seed: int = 1):
    """Random hidden states routed by the router as the model routes (softmax, top-k, renormalised)."""
    from moekv.layers.router import route

    gen = torch.Generator(device=router.device).manual_seed(seed + num_tokens)
    hidden = torch.randn(num_tokens, router.shape[1], generator=gen, device=router.device).to(dtype)
    weights, ids = route(torch.nn.functional.linear(hidden, router), top_k, renormalize=True)
    return hidden, ids, weights


def quantize_layer(w_gate_up: torch.Tensor, w_down: torch.Tensor, block: tuple[int, int] | None):
    """The layer's experts as FP8 (moekv.core.fp8), one expert at a time: per output channel, or block scales."""
    return quantize_per_expert(w_gate_up, block), quantize_per_expert(w_down, block)


def _expert_bytes(weight) -> int:
    if isinstance(weight, Fp8Weight):
        return weight.codes[0].numel() * weight.codes.element_size() + weight.scale[0].numel() * 4
    return weight[0].numel() * weight.element_size()


def _dequantized(weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, Fp8Weight) else weight.float()


def layer_bytes(w_gate_up, w_down, hidden: torch.Tensor, topk_ids: torch.Tensor) -> int:
    """Bytes the layer cannot avoid moving: every distinct routed expert's weights once (FP8: codes and
    scales), input, output."""
    experts = torch.unique(topk_ids).numel()
    per_expert = _expert_bytes(w_gate_up) + _expert_bytes(w_down)
    return experts * per_expert + 2 * hidden.numel() * hidden.element_size()


def hf_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, implementation: str):
    """transformers' MixtralExperts sharing (not copying) the weights, with the given
    experts_implementation ("eager" | "grouped_mm" | ...); None when transformers is missing."""
    try:
        import transformers
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    except ImportError:
        return None
    E, two_inter, H = w_gate_up.shape
    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=two_inter // 2, num_local_experts=E)
    config._experts_implementation = implementation
    with torch.device("meta"):
        experts = MixtralExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(w_gate_up, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(w_down, requires_grad=False)
    return experts.eval()


def implementations(w_gate_up, w_down, num_tokens: int, variants: list[str] | None = None,
                    swept: dict | None = None) -> dict:
    """name -> fn(hidden, ids, weights) for every implementation that applies at this token count (variants:
    also the decode kernel variants, benchmarks/moe_variants.variant_fns)."""
    from moekv.ops.triton.moe import decode as moe_decode
    from moekv.ops.triton.moe import grouped as moe_grouped

    def moekv(hidden, ids, weights):
        return dispatch.moe_experts(hidden, w_gate_up, w_down, ids, weights)

    fns = {"moekv": moekv}
    if num_tokens <= moe_decode.MAX_DECODE_TOKENS:
        fns["moekv-decode"] = lambda h, i, w: moe_decode.moe_experts_decode(h, w_gate_up, w_down, i, w)
    if variants:
        fns.update(moe_variants.variant_fns(w_gate_up, w_down, num_tokens, variants, swept))
    fns["moekv-grouped"] = lambda h, i, w: moe_grouped.moe_experts_grouped(h, w_gate_up, w_down, i, w)
    fns["reference"] = lambda h, i, w: moe_experts_reference(h, w_gate_up, w_down, i, w)
    if isinstance(w_gate_up, Fp8Weight):         # transformers' experts take 16-bit tensors
        # W8A8 (KernelConfig.w8a8_min_tokens): the rows' e4m3 quantization included; its error column is mostly that
        fns["moekv-grouped-w8a8"] = lambda h, i, w: moe_grouped.moe_experts_grouped(h, w_gate_up, w_down, i, w,
                                                                                   act_fp8=True)
        return fns
    for implementation in ("grouped_mm", "eager"):
        experts = hf_experts(w_gate_up, w_down, implementation)
        if experts is not None:
            fns[f"hf-{implementation}"] = lambda h, i, w, _m=experts: _m(h, i, w)
    return fns


@torch.inference_mode()
def bench_layer(shape: dict, token_counts: list[int], dtype: torch.dtype, device: torch.device, timer: Timer,
                copy_tbps: float | None, tiny: bool = False, weights=None, only: set[str] | None = None,
                quantization: str | None = None, fp8_block: tuple[int, int] | None = None,
                variants: list[str] | None = None, swept: dict | None = None) -> list[dict]:
    """One row per (token count, implementation). `weights`: (w_gate_up, w_down, router) of a model layer
    to reuse (bench_decode passes its model's, FP8 ones as Fp8Weight); else random ones, quantized to FP8
    when `quantization` is "fp8" (per output channel, or fp8_block scales). variants / swept: the decode kernel
    variants' rows (moe_variants.variant_fns)."""
    w_gate_up, w_down, router = weights or random_layer(shape, dtype, device)
    if quantization == "fp8" and not isinstance(w_gate_up, Fp8Weight):
        w_gate_up, w_down = quantize_layer(w_gate_up, w_down, fp8_block)
    reference_weights = (_dequantized(w_gate_up), _dequantized(w_down))
    label = "fp8" if isinstance(w_gate_up, Fp8Weight) else {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype))
    rows = []
    for num_tokens in token_counts:
        hidden, ids, weights_ = routed_inputs(num_tokens, router, shape["top_k"], dtype)
        expected = moe_experts_reference(hidden.float(), *reference_weights, ids, weights_)
        moved = layer_bytes(w_gate_up, w_down, hidden, ids)
        for name, fn in implementations(w_gate_up, w_down, num_tokens, variants, swept).items():
            if only and name not in only:
                continue
            try:
                error = ((fn(hidden, ids, weights_).float() - expected).abs().max() / expected.abs().max()).item()
                ms, graph = timer(lambda: fn(hidden, ids, weights_), capturable=name not in HOST_SYNCING)
            except Exception as exc:                                   # noqa: BLE001 (reported, not fatal)
                print(f"  {name} T={num_tokens}: failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                continue
            tbps = moved / ms / 1e9
            rows.append({"impl": name, "weights": label, "tokens": num_tokens, "ms": ms, "bytes": moved, "tbps": tbps,
                         "pct_copy": None if copy_tbps is None else 100 * tbps / copy_tbps, "cuda_graph": graph,
                         "experts_touched": int(torch.unique(ids).numel()), "max_rel_err": error,
                         "config": moe_variants.variant_config(name, hidden, w_gate_up, w_down, swept)})
            print(f"  T={num_tokens:5d} {label:5s} {name:15s} {ms:9.4f} ms  {tbps:6.3f} TB/s  err {error:.1e}"
                  + ("" if graph or device.type != "cuda" else "  (eager timing)"))
    return rows


# ---------------------------------------------------------------- outputs
def environment(argv: list[str], device: torch.device) -> dict:
    commit = git_commit() or "unknown"
    import triton
    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (tiny, interpreter)",
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit,
            "torch": torch.__version__, "triton": triton.__version__, "transformers": hf_version,
            "command": "PYTHONPATH=src:. python " + " ".join(argv)}


def layer_table(rows: list[dict]) -> list[str]:
    lines = ["| model | weights | tokens | implementation | ms | experts read | MB moved | TB/s | % copy | max rel err "
             "| timing |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pct = "-" if r["pct_copy"] is None else f"{r['pct_copy']:.1f}%"
        lines.append(f"| {r.get('model', '-')} | {r.get('weights', 'bf16')} | {r['tokens']} | {r['impl']} | {r['ms']:.4f} | {r['experts_touched']} | {r['bytes'] / 1e6:.1f} "
                     f"| {r['tbps']:.3f} | {pct} | {r['max_rel_err']:.1e} | {'graph' if r['cuda_graph'] else 'eager'} |")
    return lines


def write_results(out_dir: Path, stem: str, result: dict, title: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = result["env"]
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    copy = result.get("copy_bandwidth_tbps")
    lines = [f"# {title}", "", f"GPU {env['gpu']}, {env['date']}, commit {env['commit']}, torch {env['torch']}, "
             f"triton {env['triton']}, transformers {env['transformers']}", f"Command: `{env['command']}`", "",
             f"Measured copy bandwidth: {copy:.2f} TB/s." if copy else "No GPU: timings are the CPU interpreter's "
             "(meaningless as speed; this run checks the code paths).", ""]
    lines += layer_table(result["moe_layer"])
    if result.get("variants") or result.get("fma_sweep"):
        lines += moe_variants.tables(result)
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def tiny_shape() -> dict:
    return dict(TINY_SHAPE)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mixtral-8x7b",
                        help=f"named shape(s), comma-separated: {', '.join(sorted(NAMED_SHAPES))}")
    parser.add_argument("--tokens", default="1,8,128", help="comma-separated token counts")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--quantization", default="none", help="expert weights: none (16-bit), fp8 or none,fp8")
    parser.add_argument("--fp8-block", default="channel",
                        help="FP8 scales: channel (per output channel, as --quantization fp8 loads) or BNxBK "
                             "blocks, e.g. 128x128 (DeepSeek-V3 / Qwen3 FP8 checkpoints)")
    parser.add_argument("--impl", help="comma-separated subset of implementations to run")
    parser.add_argument("--out", type=Path, help="result folder (default benchmarks/results; --tiny: a temp dir)")
    parser.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (Triton interpreter)")
    parser.add_argument("--variants", default="", help="decode kernel variants to time side by side: dot,fma")
    parser.add_argument("--fma-sweep", action="store_true",
                        help="sweep the fma variant's tiles of each FP8 layer at one token first (decode-fma-swept)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    unknown = [m for m in models if m not in NAMED_SHAPES]
    if unknown or not models:
        parser.error(f"unknown model shape(s) {unknown}; known: {', '.join(sorted(NAMED_SHAPES))}")
    quantizations = [q.strip() for q in args.quantization.split(",") if q.strip()]
    if not quantizations or any(q not in ("none", "fp8") for q in quantizations):
        parser.error(f"--quantization takes none, fp8 or none,fp8; got {args.quantization!r}")
    fp8_block = parse_block(parser, args.fp8_block)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if any(v not in moe_variants.VARIANTS for v in variants) or (args.fma_sweep and "fma" not in variants):
        parser.error(f"--variants takes {','.join(moe_variants.VARIANTS)} (--fma-sweep needs fma); "
                     f"got {args.variants!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        parser.error("no CUDA device: use --tiny to check the code paths on the CPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.tiny:
        dispatch.install(dataclasses.replace(dispatch.kernel_config(), backend="triton"))   # the kernels behind "moekv"
    env = environment(["benchmarks/bench_moe.py", *argv], device)
    copy_tbps = copy_bandwidth(device)
    rows, shapes, sweeps = [], {}, {}
    read_tbps = read_bandwidth(device) if variants else None
    for model in models:
        shape = tiny_shape() if args.tiny else NAMED_SHAPES[model]
        shapes[model] = {k: shape[k] for k in TINY_SHAPE}
        layer16 = random_layer(shape, dtype, device)
        for quantization in quantizations:
            print(f"{env['gpu']}: copy bandwidth {copy_tbps or float('nan'):.2f} TB/s; {model}: E={shape['num_experts']} "
                  f"H={shape['hidden_size']} I={shape['expert_intermediate_size']} top-{shape['top_k']}, "
                  f"weights {args.dtype if quantization == 'none' else quantization}")
            layer = layer16 if quantization == "none" else (*quantize_layer(*layer16[:2], fp8_block), layer16[2])
            swept = None
            if args.fma_sweep and quantization == "fp8":
                key = f"{model} fp8" + ("" if fp8_block is None else f" {args.fp8_block}")
                sweep_rows, swept = sweep_layer(layer, shape["top_k"], dtype, Timer(device))
                sweeps[key] = {"rows": sweep_rows, "best": swept}
            layer_rows = bench_layer(shape, tokens, dtype, device, Timer(device), copy_tbps, tiny=args.tiny,
                                     weights=layer, only=set(args.impl.split(",")) if args.impl else None,
                                     quantization=None if quantization == "none" else quantization,
                                     fp8_block=fp8_block, variants=variants, swept=swept)
            rows += [{**row, "model": model} for row in layer_rows]
            del layer
        del layer16
    name = "tiny" if args.tiny else "+".join(models)
    weights = "" if quantizations == ["none"] else "-" + "+".join(args.dtype if q == "none" else q for q in quantizations)
    gpu = env["gpu"].split(" (")[0].replace(" ", "_")
    result = {"env": env, "model": name, "shape": shapes, "dtype": args.dtype, "quantization": quantizations,
              "fp8_block": args.fp8_block, "copy_bandwidth_tbps": copy_tbps, "read_bandwidth_tbps": read_tbps,
              "variants": variants, "fma_sweep": sweeps, "moe_layer": rows}
    out = args.out or (Path(tempfile.mkdtemp()) if args.tiny else Path("benchmarks/results"))
    suffix = "-variants" if variants else ""
    paths = write_results(out, f"moe-bench-{name}{weights}-{gpu}{suffix}", result,
                          f"MoE layer alone: {name}, {args.dtype}"
                          + (f", weights {' and '.join(quantizations)}" if weights else ""))
    print("wrote", *paths)
    return 0


@torch.inference_mode()
def sweep_layer(layer, top_k: int, dtype: torch.dtype, timer: Timer) -> tuple[list[dict], dict]:
    """moe_variants.fma_sweep of one layer at one token (its routed inputs as bench_layer builds them)."""
    w_gate_up, w_down, router = layer
    hidden, ids, weights = routed_inputs(1, router, top_k, dtype)
    expected = moe_experts_reference(hidden.float(), _dequantized(w_gate_up), _dequantized(w_down), ids, weights)
    print(f"  fma sweep, 1 token ({torch.unique(ids).numel()} experts)")
    return moe_variants.fma_sweep((w_gate_up, w_down), (hidden, ids, weights), expected, timer,
                                  layer_bytes(w_gate_up, w_down, hidden, ids))


def parse_block(parser, text: str) -> tuple[int, int] | None:
    """"channel" -> None; "128x128" -> (128, 128)."""
    if text == "channel":
        return None
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
        if rows < 1 or cols < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--fp8-block takes channel or BNxBK (e.g. 128x128), got {text!r}")
    return rows, cols


if __name__ == "__main__":
    raise SystemExit(main())
