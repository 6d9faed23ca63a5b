"""Prefix caching: time to first token with and without it, on two agentic workloads.

    PYTHONPATH=src:. python benchmarks/bench_prefix_cache.py                       # bundled model, CPU
    PYTHONPATH=src:. python benchmarks/bench_prefix_cache.py --model mixtral-8x7b --prefix 4096 \
        --kv-cache-dtype bf16,int3                                                  # GPU, synthetic weights
    PYTHONPATH=src:. python benchmarks/bench_prefix_cache.py --tiny                # CPU: code paths only

Workloads (each run with --enable-prefix-caching and without, per --kv-cache-dtype):
  agentic     --turns sequential turns of one conversation: turn i's prompt is the shared system+tools
              prefix (--prefix tokens) + every earlier user message and answer + user message i (--user
              tokens); the answer is --answer greedy tokens. TTFT per turn.
  concurrent  --concurrency requests submitted at once, each the shared prefix + its own --user tokens,
              --answer tokens each. TTFT per request.
TTFT = the request's first token time - its arrival (Engine.add_request), stepping the engine directly
(no HTTP). Hit rate = prefix-cache hits / queries (tokens) over the workload. `identical`: greedy outputs
equal with and without caching (`matching`: how many requests' answers are; agentic turns see the earlier
answers, so one difference carries on). Keys/values of a token are computed with a different batch shape
with and without a hit (a hit's prefix came from an earlier prefill or from decode steps), so with bf16
model compute, whose matmul rounding depends on the batch shape, near-tied greedy picks can flip; --dtype
fp32 with bf16 KV checks that the cache itself changes nothing; --batch-invariant (KernelConfig.batch_invariant:
fixed-tile kernels whose row results do not depend on the batch, docs/serving.md) is what makes bf16 compute on a
GPU give identical outputs, at its cost in TTFT and decode time. A low-bit cache reads a hit prefix from
quantized pages where a cold prefill attends to its own tokens in full precision: outputs may differ.
The bundled model (default, `--model bundled`) tokenizes its validation text; a named shape (`--model
mixtral-8x7b`, needs a GPU) gets random weights (moekv.models.loader.build_random_model) and random token
ids. Results: JSON + markdown in --out (default benchmarks/results), with machine, date, commit, command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from moekv.bench.serve import percentiles
from moekv.config import CacheConfig, DeviceConfig, EngineConfig, KernelConfig, ModelConfig, SchedulerConfig
from moekv.engine.engine import Engine
from moekv.models.loader import build_random_model
from moekv.models.registry import NAMED_SHAPES, named_arch
from moekv.paths import default_model_dir
from moekv.provenance import git_commit
from moekv.sampling import SamplingParams

TINY_ARCH = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, top_k=2,
                 expert_intermediate_size=48, vocab_size=256, max_position_embeddings=4096)


class Source:
    """The model under test and the token streams the workloads draw from."""

    def __init__(self, args, device: torch.device):
        self.name, self.device, self.model, self.tokens = args.model, device, None, []
        if args.model == "bundled":
            from moekv.tokenizer import Tokenizer

            folder = Path(default_model_dir())
            self.model_path = str(folder)
            self.tokens = Tokenizer(folder).encode((folder / "validation_slice.txt").read_text())
            self.max_position = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
        else:
            arch = named_arch(args.model, **(TINY_ARCH if args.tiny else {}))
            self.model_path = f"random:{args.model}"
            self.model = build_random_model(arch, dtype=torch.bfloat16, device=device, seed=0)
            self.max_position = arch.max_position_embeddings
            self.vocab = arch.vocab_size
        self._rng = random.Random(0)

    def take(self, count: int, offset: int) -> list[int]:
        """`count` token ids: a slice of the text from `offset` (wrapping), or random ids (synthetic)."""
        if self.tokens:
            return [self.tokens[(offset + i) % len(self.tokens)] for i in range(count)]
        rng = random.Random(offset)
        return [rng.randrange(1, self.vocab) for _ in range(count)]

    def engine(self, kv: str, caching: bool, max_model_len: int, max_num_seqs: int, args) -> Engine:
        page = 128 if kv.startswith("int") else 16
        num_pages = args.num_pages
        if num_pages is None and self.device.type == "cpu":   # every sequence at once without caching
            num_pages = max_num_seqs * -(-max_model_len // page) + 2
        cache = CacheConfig(kv_cache_dtype=kv, num_pages=num_pages, enable_prefix_caching=caching)
        budget = max(args.max_num_batched_tokens, max_num_seqs)
        dtype = args.dtype if self.model is None else "auto"        # a random model is built in bf16
        config = EngineConfig(model=ModelConfig(model=self.model_path, dtype=dtype, max_model_len=max_model_len),
                              cache=cache,
                              scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
                              device=DeviceConfig(str(self.device), cuda_graphs=not args.enforce_eager),
                              kernels=KernelConfig.from_env(**({"batch_invariant": True} if args.batch_invariant
                                                               else {})))
        return Engine(config, model=self.model)


def drive(engine: Engine, request_ids: list[str]) -> None:
    pending = set(request_ids)
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)


def ttft_ms(engine: Engine, request_id: str) -> float:
    request = engine.requests[request_id]
    return (request.first_token_time - request.arrival_time) * 1e3


def warm_up(engine: Engine, source: Source, args) -> None:
    """Compile and warm the step paths on tokens no workload uses (their pages may stay cached: harmless)."""
    rid = engine.add_request(source.take(args.user + 40, 10_000_003), SamplingParams(max_tokens=4, temperature=0))
    drive(engine, [rid])


def agentic(engine: Engine, source: Source, args) -> tuple[list[float], list[list[int]]]:
    params = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    conversation = source.take(args.prefix, 0)
    ttfts, answers = [], []
    for turn in range(args.turns):
        conversation += source.take(args.user, 50_000 + 997 * turn)
        rid = engine.add_request(list(conversation), params)
        drive(engine, [rid])
        answer = engine.requests[rid].output_token_ids
        ttfts.append(ttft_ms(engine, rid))
        answers.append(list(answer))
        conversation += answer
        engine.release(rid)
    return ttfts, answers


def concurrent(engine: Engine, source: Source, args) -> tuple[list[float], list[list[int]]]:
    params = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    prefix = source.take(args.prefix, 0)
    ids = [engine.add_request(prefix + source.take(args.user, 200_000 + 991 * i), params)
           for i in range(args.concurrency)]
    drive(engine, ids)
    ttfts = [ttft_ms(engine, rid) for rid in ids]
    answers = [list(engine.requests[rid].output_token_ids) for rid in ids]
    return ttfts, answers


WORKLOADS = {"agentic": agentic, "concurrent": concurrent}


def run(source: Source, workload: str, kv: str, caching: bool, args) -> dict:
    turns = args.turns if workload == "agentic" else 1
    max_model_len = min(source.max_position, args.prefix + turns * (args.user + args.answer) + 64)
    seqs = args.concurrency if workload == "concurrent" else 1
    engine = source.engine(kv, caching, max_model_len, seqs, args)
    warm_up(engine, source, args)
    before = engine.prefix_cache_stats()
    started = time.perf_counter()
    ttfts, answers = WORKLOADS[workload](engine, source, args)
    seconds = time.perf_counter() - started
    after = engine.prefix_cache_stats()
    queries = after.get("prefix_cache_queries", 0.0) - before.get("prefix_cache_queries", 0.0)
    hits = after.get("prefix_cache_hits", 0.0) - before.get("prefix_cache_hits", 0.0)
    stats = percentiles(ttfts)
    row = {"workload": workload, "kv_cache_dtype": engine.cache_config.kv_cache_dtype, "prefix_caching": caching,
           "requests": len(ttfts), "ttft_p50_ms": stats["p50"], "ttft_p90_ms": stats["p90"],
           "ttft_mean_ms": stats["mean"], "wall_s": seconds, "prefix_cache_queries": queries,
           "prefix_cache_hits": hits, "hit_rate": hits / queries if queries else None,
           "kv_usage_after": engine.kv_manager.usage, "ttfts_ms": ttfts, "answers": answers}
    del engine
    return row


def environment(argv: list[str], device: torch.device) -> dict:
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"
    return {"machine": machine, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit() or "unknown", "torch": torch.__version__,
            "command": "PYTHONPATH=src:. python " + " ".join(argv)}


def summarise(rows: list[dict]) -> list[dict]:
    """Per workload and dtype: the TTFT speed-up of caching and whether greedy outputs matched."""
    out = []
    for row in rows:
        if not row["prefix_caching"]:
            continue
        base = next((r for r in rows if not r["prefix_caching"] and r["workload"] == row["workload"]
                     and r["kv_cache_dtype"] == row["kv_cache_dtype"]), None)
        if base is None:
            continue
        out.append({"workload": row["workload"], "kv_cache_dtype": row["kv_cache_dtype"],
                    "ttft_p50_speedup": base["ttft_p50_ms"] / row["ttft_p50_ms"], "hit_rate": row["hit_rate"],
                    "identical": base["answers"] == row["answers"],
                    "matching": sum(a == b for a, b in zip(base["answers"], row["answers"])),
                    "requests": len(row["answers"])})
    return out


def write_results(out_dir: Path, stem: str, result: dict) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    env, cfg = result["env"], result["config"]
    lines = [f"# Prefix caching: TTFT with and without ({result['model']})", "",
             f"{env['machine']}, {env['date']}, commit {env['commit']}, torch {env['torch']}",
             f"Command: `{env['command']}`", "",
             f"Shared prefix {cfg['prefix']} tokens; agentic: {cfg['turns']} turns of +{cfg['user']} user tokens "
             f"and {cfg['answer']}-token answers; concurrent: {cfg['concurrency']} requests of prefix + "
             f"{cfg['user']} own tokens, {cfg['answer']}-token answers. TTFT from add_request to the first token. "
             f"Batch-invariant kernels: {'on' if cfg.get('batch_invariant') else 'off'}.",
             "", "| workload | kv | prefix caching | requests | TTFT p50 ms | TTFT p90 ms | hit rate | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        rate = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        lines.append(f"| {r['workload']} | {r['kv_cache_dtype']} | {'on' if r['prefix_caching'] else 'off'} | "
                     f"{r['requests']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {rate} | {r['wall_s']:.1f} |")
    lines += ["", "| workload | kv | TTFT p50 speed-up | hit rate | greedy outputs identical |", "|---|---|---|---|---|"]
    for s in result["summary"]:
        lines.append(f"| {s['workload']} | {s['kv_cache_dtype']} | {s['ttft_p50_speedup']:.1f}x | "
                     f"{100 * s['hit_rate']:.1f}% | {'yes' if s['identical'] else 'no'} "
                     f"({s['matching']} of {s['requests']} answers equal) |")
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bundled", choices=["bundled", *sorted(NAMED_SHAPES)],
                        help="bundled (tiny-shakespeare-moe) or a named shape with random weights (GPU)")
    parser.add_argument("--kv-cache-dtype", default="bf16", help="comma-separated, e.g. bf16,int3")
    parser.add_argument("--dtype", default="auto", help="the bundled model's weights/compute dtype (auto: bf16); "
                        "fp32 compute with bf16 KV takes the batch-shape rounding of bf16 matmuls out of the "
                        "identical-outputs check")
    parser.add_argument("--workloads", default="agentic,concurrent")
    parser.add_argument("--prefix", type=int, default=2048, help="shared system+tools prefix tokens")
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument("--user", type=int, default=24, help="new user tokens per turn / per request")
    parser.add_argument("--answer", type=int, default=24, help="generated tokens per turn / per request")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="KernelConfig.batch_invariant: row results independent of the batch (slower; what "
                        "identical greedy outputs with bf16 compute on a GPU need)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pages (default: all sequences at full length on the CPU, sized from memory on a GPU)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random shape on the CPU (code paths only)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default=None, help="result file stem (default prefix-cache-<machine>-<model>)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.model != "bundled" and device.type == "cpu" and not args.tiny:
        parser.error(f"{args.model} with random weights needs a GPU (or --tiny for the code paths)")
    source = Source(args, device)
    result = {"env": environment(["benchmarks/bench_prefix_cache.py", *argv], device),
              "model": args.model + ("-tiny" if args.tiny else "") + ("" if args.dtype == "auto" else f"-{args.dtype}"),
              "config": {**{k: getattr(args, k) for k in ("prefix", "turns", "user", "answer", "concurrency")},
                         "batch_invariant": args.batch_invariant or KernelConfig.from_env().batch_invariant},
              "runs": []}
    for workload in args.workloads.split(","):
        for kv in args.kv_cache_dtype.split(","):
            for caching in (False, True):
                print(f"{workload} kv={kv} prefix caching {'on' if caching else 'off'} ...", flush=True)
                row = run(source, workload, kv, caching, args)
                rate = "-" if row["hit_rate"] is None else f"{100 * row['hit_rate']:.1f}%"
                print(f"  TTFT p50 {row['ttft_p50_ms']:.1f} ms, p90 {row['ttft_p90_ms']:.1f} ms, hit rate {rate}, "
                      f"{row['wall_s']:.1f} s", flush=True)
                result["runs"].append(row)
    result["summary"] = summarise(result["runs"])
    for s in result["summary"]:
        print(f"{s['workload']} {s['kv_cache_dtype']}: TTFT p50 {s['ttft_p50_speedup']:.1f}x lower with caching, "
              f"hit rate {100 * s['hit_rate']:.1f}%, greedy outputs identical: {s['identical']}")
    machine = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).split()[-1].lower()
    stem = args.tag or f"prefix-cache-{machine}-{result['model']}"   # bundled-fp32: --dtype fp32
    paths = write_results(args.out, stem, result)
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
