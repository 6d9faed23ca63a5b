"""`moekv generate`: stream a completion to the terminal, then print a stats table."""

from __future__ import annotations

import argparse
import sys
import time

from moekv.entrypoints.offload_args import add_offload_arguments, offload_kwargs
from moekv.paths import default_model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face checkpoint folder (default: the bundled "
                        "tiny-shakespeare-moe model)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    parser.add_argument("--top-k", type=int, default=-1, help="sample from the k most likely tokens (-1: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (model dtype), bf16, fp16, fp32, int4, int3, int2 (default auto)")
    parser.add_argument("--dtype", default="auto", help="model weights dtype: auto, bf16, fp16, fp32")
    parser.add_argument("--quantization", default=None, choices=("none", "fp8"),
                        help="fp8: quantize the projections and experts to FP8 at load time (W8A16, per output "
                             "channel); FP8 checkpoints load as FP8 without it")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    parser.add_argument("--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs "
                        "for decode steps)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the "
                        "model's chat template")
    add_offload_arguments(parser)
    parser.add_argument("--expert-parallel-size", type=int, default=1, help="shard experts over N ranks; launch "
                        "with `torchrun --nproc-per-node N -m moekv generate ...` (see docs/expert-parallel.md)")
    parser.add_argument("--num-redundant-experts", type=int, default=0, help="with --expert-parallel-size: extra "
                        "expert slots for replicas of hot experts (default 0)")
    parser.add_argument("--expert-dispatch", default="auto", choices=("auto", "all_to_all", "allgather"),
                        help="with --expert-parallel-size: how tokens reach their experts' ranks (default auto)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse cached KV pages of a shared prompt prefix (default on)")


def run(args: argparse.Namespace) -> int:
    from moekv.entrypoints.llm import LLM
    from moekv.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    started = time.perf_counter()
    llm = LLM(model=args.model or default_model_dir(), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              device=args.device, max_model_len=args.max_model_len, quantization=args.quantization,
              track_prediction=True, **offload_kwargs(args),
              expert_parallel_size=args.expert_parallel_size, num_redundant_experts=args.num_redundant_experts,
              expert_dispatch=args.expert_dispatch, cuda_graphs=not args.enforce_eager,
              enable_prefix_caching=args.enable_prefix_caching)
    load_seconds = time.perf_counter() - started
    engine = llm.engine
    prompt = args.prompt
    if args.chat:
        if engine.tokenizer is None:
            print("error: --chat needs a tokenizer", file=sys.stderr)
            return 2
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    if engine.rank != 0:                   # expert parallel: rank 0 runs the prompt, the others join its steps
        while engine.has_unfinished():     # collective: every rank leaves together
            engine.step()
        return 0
    request_id = engine.add_request(prompt, params)
    request = engine.requests[request_id]
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    t0 = time.perf_counter()
    first_token_at = None
    peak_pages = 0
    bits = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first_token_at is None:
                first_token_at = time.perf_counter()
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
        if not request.status.is_finished:
            peak_pages = max(peak_pages, len(engine.kv_manager.block_table(request_id)))
            bits = engine.kv_cache.bits_per_value([request.num_computed_tokens])
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n\n")
    if request.error:
        print(f"error: {request.error}", file=sys.stderr)
    print_stats(engine, request, load_seconds, elapsed, first_token_at - t0 if first_token_at else None, bits)
    engine.release(request_id)
    return 0 if request.finish_reason != "error" else 1


# The low-bit format's counters worth a row here (all of them are in /metrics and kv_cache.stats()).
_KV_STAT_ROWS = (("format_bits_per_value", "KV bits per value, full pages only"),
                 ("pages_quantized", "KV pages quantized"),
                 ("value_budget_hit_rate", "KV outlier budget hit rate (values)"),
                 ("value_outliers_per_page_head", "KV outliers per page-head (values)"))


def print_stats(engine, request, load_seconds, elapsed, ttft, bits) -> None:
    from rich.console import Console
    from rich.table import Table

    arch = engine.arch
    num_tokens = request.num_tokens
    values = num_tokens * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    bits = bits if bits is not None else engine.kv_cache.bits_per_value([num_tokens])
    generated = len(request.output_token_ids)
    decode_time = elapsed - (ttft or 0.0)
    table = Table(title="moekv generate", show_header=False)
    table.add_column("stat")
    table.add_column("value", justify="right")
    table.add_row("model", f"{arch.architecture}, {arch.num_layers} layers, {arch.num_experts} experts top-{arch.top_k}")
    table.add_row("device / dtype", f"{engine.device} / {engine.model_dtype}".replace("torch.", ""))
    from moekv.models.quantize import is_quantized

    if is_quantized(engine.model):
        table.add_row("weights", "fp8 (W8A16: e4m3 projections and experts)")
    table.add_row("load time", f"{load_seconds:.2f} s")
    table.add_row("prompt tokens", str(request.num_prompt_tokens))
    table.add_row("generated tokens", f"{generated} (finish: {request.finish_reason})")
    if ttft is not None:
        table.add_row("time to first token", f"{ttft * 1000:.1f} ms")
    if generated > 1 and decode_time > 0:
        table.add_row("decode speed", f"{(generated - 1) / decode_time:.1f} tokens/s")
    table.add_row("KV cache dtype", engine.cache_config.kv_cache_dtype)
    table.add_row("KV bytes (this sequence)", f"{values * bits / 8 / 1024:.1f} KiB for {num_tokens} tokens")
    table.add_row("KV bits per value", f"{bits:.3f}")
    kv_stats = engine.kv_cache.stats()
    for key, label in _KV_STAT_ROWS:
        if key in kv_stats:
            value = kv_stats[key]
            table.add_row(label, f"{value:.3f}" if isinstance(value, float) and not value.is_integer() else
                          f"{value:g}")
    console = Console()
    _add_routing_rows(table, engine.routing_stats())
    console.print(table)
    load = engine.expert_load().float()
    share = load / load.sum(dim=1, keepdim=True).clamp_min(1)
    experts = Table(title="expert load (% of routed tokens)")
    experts.add_column("layer")
    for e in range(share.shape[1]):
        experts.add_column(f"e{e}", justify="right")
    for layer in range(share.shape[0]):
        experts.add_row(str(layer), *[f"{100 * v:.0f}" for v in share[layer].tolist()])
    console.print(experts)


def _add_routing_rows(table, stats: dict) -> None:
    """Prediction recall and expert-cache rows of the stats table (engine.routing_stats())."""
    prediction = stats.get("prediction")
    if prediction:
        for distance, recall in prediction["overall"].items():
            if recall is not None:
                table.add_row(f"expert prediction recall ({distance} layer{'s' if distance > 1 else ''} ahead)",
                              f"{100 * recall:.1f}% (top-{prediction['experts_predicted_per_token']} "
                              f"predicted, top-{prediction['top_k']} routed)")
    offload = stats.get("offload")
    if offload:
        table.add_row("expert cache", f"{offload['slots_per_layer']}/{offload['experts_per_layer']} experts per "
                      f"layer on device{', prefetch' if offload['prefetch'] else ', on demand'}")
        table.add_row("expert cache hit rate", f"{100 * offload['hit_rate']:.1f}% ({offload['hits']} hits, "
                      f"{offload['misses']} misses)")
        table.add_row("experts copied to device", f"{offload['copies']} ({offload['bytes_copied'] / 2**20:.1f} MiB; "
                      f"{offload['prefetches']} prefetched, {offload['wasted_prefetches']} unused)")
    guard = stats.get("prefetch_guard")
    for batch, regime in sorted((guard or {}).get("regimes", {}).items()):
        kept = {True: "prefetch kept", False: "prefetch off (on demand faster)",
                None: "still measuring"}[regime["prefetch"]]
        timings = "" if regime["median_ms_on"] is None or regime["median_ms_off"] is None else \
            f": {regime['median_ms_on']:.1f} ms/step with, {regime['median_ms_off']:.1f} without"
        table.add_row(f"prefetch guard (batch {batch})", f"{kept}{timings}")
