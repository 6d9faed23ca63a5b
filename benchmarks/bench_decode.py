"""End-to-end decode of a random-weight named model: moekv's engine (bf16 and low-bit KV) side by side
with Hugging Face transformers on the same shape and the same weights, plus the MoE layer alone.

    PYTHONPATH=src:. python benchmarks/bench_decode.py --model mixtral-8x7b           # on the H200
    PYTHONPATH=src:. python benchmarks/bench_decode.py --scenarios 1x16384:bf16 --eager-too   # graphs on and off
    PYTHONPATH=src:. python benchmarks/bench_decode.py --enforce-eager --tag eager     # every step eager
    PYTHONPATH=src:. python benchmarks/bench_decode.py --scenarios 64x16384:int3 --no-hf --moe-tokens "" --tag b64
    PYTHONPATH=src:. python benchmarks/bench_decode.py --tiny                          # CPU: code paths only
    PYTHONPATH=src:. python benchmarks/bench_decode.py --quantization none,fp8 --scenarios 1x16384:bf16 --no-hf
    PYTHONPATH=src:. python benchmarks/bench_decode.py --model qwen3-30b-a3b --quantization none,fp8 --no-hf
    PYTHONPATH=src:. python benchmarks/bench_decode.py --scenarios 1x16384:bf16,int3 --synthetic-kv --no-hf \
        --moe-tokens "" --fusion on,off --layer-profile --tag fusion     # kernels of one layer, fusion on / off
    PYTHONPATH=src:. python benchmarks/bench_decode.py --scenarios "1x16384:bf16;16x4096:bf16" --synthetic-kv \
        --no-hf --moe-tokens "" --attention-combine on,off --layer-profile --tag combine   # split combine in-kernel
    PYTHONPATH=src:. python benchmarks/bench_decode.py --scenarios "1x16384:bf16;16x4096:bf16" --synthetic-kv \
        --no-hf --moe-tokens "" --moe-combine on,off --layer-profile --tag moecombine   # MoE combine in the next norm
    PYTHONPATH=src:. python benchmarks/bench_decode.py --scenarios "1x16384:bf16,int3" --synthetic-kv \
        --no-hf --moe-tokens "" --pdl off,on --tag pdl                # programmatic dependent launch
    PYTHONPATH=src:. python benchmarks/bench_decode.py --model qwen3-30b-a3b --scenarios "1x16384:bf16,int3" \
        --synthetic-kv --no-hf --moe-tokens "" --route-fold on,off --tag routefold   # E=128 routing in one launch

Sections (each in the JSON and the markdown written to --out, default benchmarks/results):
  decode      time per output token = wall time of one engine step with B running sequences of about
              `context` tokens (each step gives every sequence one token), after --warmup steps, mean
              of --steps; moekv through Engine.step() (scheduler, sampling and all), transformers as
              model(next_token, cache=DynamicCache) + argmax, experts_implementation
              "eager" and "grouped_mm" (bf16 cache only: transformers has no int3 cache).
              moekv replays a CUDA graph per decode step (system "moekv", the default) or runs every
              step eagerly (system "moekv-eager": --enforce-eager, or both with --eager-too).
  replay      CUDA-graph rows: the CUDA-event time of each timed step's graph replay, in the same
              --steps steps as the time per token (gpu_busy_replay = replay / wall), and what a step
              spends outside its replay (outside_graph_ms = ms/token - replay: host work, the step's
              copies, eager launches); per step kind (benchmarks/decode_steps.py): ordinary steps,
              steps that start a KV page and steps that fill one (the low-bit cache quantizes the page
              in that step's graph: --steps >= the page size, 128 low-bit, holds one per sequence).
  gpu_busy    torch.profiler over --profile-steps decode steps: union of GPU kernel intervals / the
              steps' wall time (the profiler's own CPU overhead makes this a lower bound; its trace
              also misses many kernels of replayed graphs).
  prefill     tokens per second of the prefill phase of each scenario (B x context prompt tokens, chunks
              of --prefill-chunk tokens per engine step); the B=1, 16k row is "prefill at 16k".
  moe_layer   layer 0's experts alone at --moe-tokens (benchmarks/bench_moe.py: achieved TB/s).
  parity      moekv vs transformers last-token logits on a short prompt (cosine, max |diff|): the
              weights really are shared. In bf16 a deep random-weight model drifts apart (near-tied
              router scores flip on last-bit differences: cosine 0.46 at 32 layers on the H200), so the
              correctness check is fp32: --parity-only --dtype fp32 --num-layers 8 (results/parity-h200.md).
The transformers model is built on the meta device and its parameters are views of moekv's (no copy:
Mixtral-8x7B twice would not fit one H200). Targets (reported, not asserted): MoE layer at 1 token
>= 80% of copy bandwidth; B=1 16k int3 <= 7.0 ms per token (Mixtral-8x7B).
--quantization none,fp8: the whole run once per weight format, one model after the other (the FP8 model is
the random bf16 one quantized per output channel, moekv.models.quantize; transformers only for bf16), rows
tagged with their `weights`.
"% of floor" per row: the time to read once every byte the step needs (the non-expert weights, the expected
distinct routed experts, the KV; benchmarks/decode_floor.py) at the read bandwidth measured at the start of the
run (benchmarks/timing.read_bandwidth: torch.sum over 2 GiB, cold L2), over the measured time per token. The
copy bandwidth (read + write) is measured too and reported beside it; only the MoE section's "% copy" uses it.
--fusion on,off: every moekv row with the fused decode layer (KernelConfig.fused_decode_layer) on and off, side by
side (rows tagged `fusion`); every per-row switch of benchmarks/decode_scenarios.SWITCHES takes the same form.
--layer-profile adds an eager run per row whose profile counts the kernels of one decoder layer and times each
(benchmarks/layer_profile.py: kernel count, GEMM / attention / small us per layer).

The pieces: decode_scenarios.py (scenarios, prompts, per-row switches), decode_moekv.py (engine rows),
decode_hf.py (transformers rows, parity), decode_steps.py (timed and profiled steps), decode_floor.py (bytes and
floors), decode_report.py (markdown, targets); this file runs them and writes the results.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import bench_moe  # noqa: E402  (also turns on the interpreter for --tiny)
from benchmarks import layer_profile  # noqa: E402
from benchmarks.decode_floor import floor_ms, pct_of_floor  # noqa: E402
from benchmarks.decode_hf import hf_model_sharing, parity, run_hf  # noqa: E402
from benchmarks.decode_moekv import run_moekv  # noqa: E402
from benchmarks.decode_report import markdown, row_summary, targets  # noqa: E402
from benchmarks.decode_scenarios import (DEFAULT_SCENARIOS, TINY_SCENARIOS, add_switch_flags,  # noqa: E402
                                         parse_scenarios, parse_switch_flags, switch_settings)
from benchmarks.decode_steps import free_memory  # noqa: E402
from benchmarks.timing import read_bandwidth  # noqa: E402

from moekv.models.loader import build_random_model  # noqa: E402
from moekv.ops import dispatch  # noqa: E402
from moekv.models.registry import NAMED_SHAPES, named_arch  # noqa: E402

TINY_ARCH = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, top_k=2,
                 expert_intermediate_size=48, vocab_size=256)


def run_weights(arch, quantization: str | None, scenarios, args, dtype, device, result: dict) -> None:
    """Every scenario (and the MoE-layer section) on one random model in one weight format; rows appended to
    result, tagged with `weights`; floors at result's read bandwidth, the MoE layer's "% copy" at its copy one."""
    label = quantization or args.dtype
    print(f"{result['env']['gpu']}: building random {args.model}{' (tiny)' if args.tiny else ''} "
          f"({arch.num_layers} layers) in {args.dtype}, weights {label} ...")
    model = build_random_model(arch, dtype=dtype, device=device, seed=0, quantization=quantization)
    if args.parity_only:
        scenarios, args.no_hf, args.moe_tokens, args.hf = [], False, "", args.hf or "eager"
    hf = None
    if not args.no_hf and args.hf and quantization is None:
        try:
            hf = hf_model_sharing(model)
            result["parity"] = parity(model, hf, args.parity_tokens)
            print("parity with transformers:", result["parity"])
        except Exception as exc:                                      # noqa: BLE001 (reported in the results)
            print(f"transformers side-by-side unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
            hf = None
    systems = (["moekv", "moekv-eager"] if args.eager_too else
               ["moekv-eager"] if args.enforce_eager else ["moekv"])
    if args.layer_profile and "moekv-eager" not in systems:
        systems.append("moekv-eager")
    # per-row switches (decode_scenarios.SWITCHES): every combination of the values given, moekv rows only
    settings = switch_settings(args.switches)
    runs = [(system, b, c, kv, setting) for b, c, kv in scenarios for setting in settings for system in systems]
    if hf is not None:
        pairs = sorted({(b, c) for b, c, kv in scenarios if kv == "bf16"})
        runs += [(f"transformers-{impl}", b, c, "bf16", {}) for b, c in pairs for impl in args.hf.split(",")]
    for system, batch, context, kv, setting in runs:
        print(f"{system} B={batch} L={context} kv={kv} weights={label}"
              + "".join(f" {name}={'on' if on else 'off'}" for name, on in setting.items()) + " ...", flush=True)
        try:
            if system.startswith("moekv"):
                row = run_moekv(model, batch, context, kv, args, device, graphs=system == "moekv", switches=setting)
            else:
                row = run_hf(hf, system.split("-", 1)[1], batch, context, args, device)
        except Exception as exc:                                      # noqa: BLE001 (e.g. out of memory)
            free_memory(device)
            print(f"  failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
            result["errors"].append({"system": system, "batch": batch, "context": context, "kv": kv, "weights": label,
                                     **{name: "on" if on else "off" for name, on in setting.items()},
                                     "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        row["weights"] = label
        row["floor_ms"] = floor_ms(model, batch, context, row["kv_bits_per_value"], result["read_bandwidth_tbps"])
        row["pct_of_floor"] = pct_of_floor(row["floor_ms"], row["tpot_ms"])
        print(row_summary(row))
        result["decode"].append(row)

    if args.switches.get("fusion") and len(args.switches["fusion"]) == 2 and quantization is None:   # a GPU check
        result["fusion_parity"] = layer_profile.fusion_parity(model)
        print("fusion on vs off, layer 0:", result["fusion_parity"])
    moe_tokens = [int(t) for t in args.moe_tokens.split(",") if t]
    if moe_tokens:
        layer = next(layer for layer in model.layers if layer.is_moe).mlp
        weights = (*layer.experts.weights(), layer.router.weight.data)
        shape = {"num_experts": arch.num_experts, "hidden_size": arch.hidden_size,
                 "expert_intermediate_size": arch.expert_intermediate_size, "top_k": arch.top_k}
        if args.tiny:
            from dataclasses import replace

            dispatch.install(replace(dispatch.kernel_config(), backend="triton"))
        rows = bench_moe.bench_layer(shape, moe_tokens, dtype, device, bench_moe.Timer(device),
                                     result["copy_bandwidth_tbps"], tiny=args.tiny, weights=weights)
        result["moe_layer"] += [{**row, "weights": label} for row in rows]
    del model, hf
    free_memory(device)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mixtral-8x7b", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--scenarios", help=f"BxL:kv,kv;... (default {DEFAULT_SCENARIOS!r})")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per scenario")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--synthetic-kv", action="store_true",
                        help="no prefill: contexts count as cached over synthetic pages (benchmarks/synthetic_kv.py); "
                             "contexts must be multiples of the page size")
    parser.add_argument("--prefill-chunk", type=int, default=16384, help="prompt tokens per engine step")
    parser.add_argument("--page-size", type=int, help="KV page size (default 16 bf16, 128 low-bit)")
    parser.add_argument("--staging-block", type=int, help="low-bit KV: staging blocks of this many tokens "
                        "(CacheConfig.staging_block_size; default whole pages)")
    parser.add_argument("--lazy-partial-page", action="store_true", help="low-bit KV: the partly filled page takes "
                        "its low-bit storage when it fills (CacheConfig.lazy_partial_page)")
    parser.add_argument("--hf", default="eager,grouped_mm", help="transformers experts implementations to run")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers entirely")
    parser.add_argument("--moe-tokens", default="1,8,128", help="token counts of the MoE-layer section ('' = skip)")
    parser.add_argument("--parity-tokens", type=int, default=256)
    parser.add_argument("--parity-only", action="store_true",
                        help="build the model, run the transformers parity check, write the results, stop")
    parser.add_argument("--num-layers", type=int, help="override the named shape's layer count (parity studies)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                        help="model dtype (fp32: parity studies; bf16 drift over 32 random layers is large)")
    parser.add_argument("--out", type=Path, help="result folder (default benchmarks/results; --tiny: a temp dir)")
    parser.add_argument("--tag", default="", help="appended to the result file names (split runs)")
    parser.add_argument("--tiny", action="store_true", help="tiny Mixtral-shaped model on the CPU (code paths)")
    parser.add_argument("--enforce-eager", action="store_true", help="moekv without CUDA graphs (every step eager)")
    parser.add_argument("--eager-too", action="store_true", help="run moekv both with CUDA graphs and eagerly")
    add_switch_flags(parser)                      # --fusion (and every other per-row switch): on, off or on,off
    parser.add_argument("--layer-profile", action="store_true",
                        help="also an eager run per moekv row, profiled: kernels of one decoder layer and their times")
    parser.add_argument("--quantization", default="none",
                        help="model weights: none (16-bit), fp8 (quantized per output channel, W8A16), or "
                             "none,fp8 (both, one after the other, in one result file)")
    args = parser.parse_args(argv)
    args.switches = parse_switch_flags(args, parser)            # {name: [values]} of the switches given
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        parser.error("no CUDA device: use --tiny to check the code paths on the CPU")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    overrides = {} if args.num_layers is None else {"num_layers": args.num_layers}
    if args.tiny:
        arch = named_arch(args.model, **{**TINY_ARCH, **overrides})
        args.scenarios = args.scenarios or TINY_SCENARIOS
        args.page_size = args.page_size or 16
        args.parity_tokens = min(args.parity_tokens, 40)
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    else:
        arch = named_arch(args.model, **overrides)
    scenarios = parse_scenarios(args.scenarios or DEFAULT_SCENARIOS)
    quantizations = [q.strip() for q in args.quantization.split(",") if q.strip()]
    if not quantizations or any(q not in ("none", "fp8") for q in quantizations):
        parser.error(f"--quantization takes none, fp8 or none,fp8; got {args.quantization!r}")
    env = bench_moe.environment(["benchmarks/bench_decode.py", *argv], device)
    read_tbps, copy_tbps = read_bandwidth(device), bench_moe.copy_bandwidth(device)
    if read_tbps:
        print(f"read bandwidth {read_tbps:.2f} TB/s (the floors'), copy bandwidth {copy_tbps:.2f} TB/s", flush=True)
    result = {"env": env, "model": args.model + ("-tiny" if args.tiny else ""), "dtype": args.dtype,
              "num_layers": arch.num_layers, "quantization": quantizations,
              "read_bandwidth_tbps": read_tbps, "copy_bandwidth_tbps": copy_tbps,
              "decode": [], "errors": [], "moe_layer": [], "parity": None}
    for quantization in quantizations:
        run_weights(arch, None if quantization == "none" else quantization, scenarios, args, dtype, device, result)
    result["targets"] = targets(result)
    out = args.out or (Path(tempfile.mkdtemp()) if args.tiny else Path("benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    gpu = env["gpu"].split(" (")[0].replace(" ", "_")
    weights = "" if quantizations == ["none"] else "-" + "+".join("bf16" if q == "none" else q for q in quantizations)
    stem = f"decode-bench-{result['model']}{weights}-{gpu}" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text("\n".join(markdown(result)) + "\n")
    print("\n".join(result["targets"]))
    print("wrote", out / f"{stem}.json", out / f"{stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
