"""Kernels of one decode layer: how many, which, and how long each runs on the GPU (torch.profiler).

bench_decode --layer-profile runs this over eager decode steps (a replayed CUDA graph's kernels cannot be told
apart by layer; their durations are the same, the launch gaps are not). Each decoder layer's
`forward_residual` is wrapped, for the profiled steps only, in a `record_function("moekv_layer_<i>")` range (an
instance attribute, not a hook: hooks would switch the model to its unfused path). Every GPU kernel is then
assigned to the layer whose CPU range contains its launch (the trace's `correlation` id links a kernel to the
cudaLaunchKernel / cuLaunchKernel call that queued it); kernels launched outside every layer (embedding, final
norm, logits, sampling, the cache's step hooks) are reported per step.

Kernel classes: "GEMM" (weight-streaming matmuls: cuBLAS / cuBLASLt / CUTLASS, the skinny GEMM, the FP8 linear,
the fused MoE's gate_up and down launches), "attention" (the paged attention kernels themselves), and "small"
(everything else: norms, rotary, routing, KV writes / staging / quantize, split-K reduces and combines, copies).
"Per-layer non-GEMM time" (issue 19's < 10 us at B=1) is the small kernels' GPU time per layer.
"""

from __future__ import annotations

import bisect
import json
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

LAYER_RANGE = "moekv_layer_"
GEMM_KEYS = ("nvjet", "gemm", "gemv", "cutlass", "sm90_xmma", "_skinny_dot", "_skinny_fma", "_fp8_linear",
             "_decode_gate_up", "_decode_down", "_grouped_gate_up", "_grouped_down")
ATTENTION_KEYS = ("_fp_decode_kernel", "_fp_prefill", "_paged", "decode_kernel", "_decode_tc_kernel", "lowbit_attention",
                  "flash", "fmha")
SMALL_FIRST = ("splitkreduce", "reduce_kernel", "combine")    # cuBLAS's split-K reduce is a small kernel


def kernel_class(name: str) -> str:
    lowered = name.lower()
    if any(key in lowered for key in SMALL_FIRST):
        return "small"
    if any(key.lower() in lowered for key in GEMM_KEYS):
        return "GEMM"
    if any(key.lower() in lowered for key in ATTENTION_KEYS):
        return "attention"
    return "small"


def short_name(name: str, width: int = 80) -> str:
    """A kernel name without template arguments (`void at::native::foo<...>(...)` -> `at::native::foo`)."""
    name = re.sub(r"^void\s+", "", name)
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip()[:width] or name[:width]


def attribute(events: list[dict], num_layers: int, num_steps: int) -> dict:
    """Kernel statistics per decode layer from a Chrome trace's complete ("X") events.

    -> {"kernels_per_layer", "us_per_layer": {class: us}, "kernels": [{name, class, launches_per_layer,
    us_per_layer, us_per_launch}] in launch order within a layer, "outside": {launches_per_step, us_per_step},
    "layers_seen"}. Launches and times are means over the layers and steps profiled."""
    windows = sorted((e["ts"], e["ts"] + e["dur"], int(e["name"][len(LAYER_RANGE):])) for e in events
                     if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(LAYER_RANGE))
    starts = [w[0] for w in windows]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    per_kernel: dict[str, dict] = {}
    outside_count, outside_us = 0, 0.0
    for e in sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"]):
        launched = launches.get(e.get("args", {}).get("correlation"))
        index = bisect.bisect_right(starts, launched) - 1 if launched is not None else -1
        if index < 0 or launched > windows[index][1]:
            outside_count += 1
            outside_us += e["dur"]
            continue
        stats = per_kernel.setdefault(e["name"], {"count": 0, "us": 0.0, "order": len(per_kernel)})
        stats["count"] += 1
        stats["us"] += e["dur"]
    layer_steps = max(1, num_layers * num_steps)
    kernels = [{"name": short_name(name), "class": kernel_class(name), "launches_per_layer": s["count"] / layer_steps,
                "us_per_layer": s["us"] / layer_steps, "us_per_launch": s["us"] / s["count"]}
               for name, s in sorted(per_kernel.items(), key=lambda kv: kv[1]["order"])]
    by_class = {c: sum(k["us_per_layer"] for k in kernels if k["class"] == c) for c in ("GEMM", "attention", "small")}
    return {"kernels_per_layer": sum(k["launches_per_layer"] for k in kernels), "us_per_layer": by_class,
            "small_kernels_per_layer": sum(k["launches_per_layer"] for k in kernels if k["class"] == "small"),
            "kernels": kernels, "layers_seen": len({w[2] for w in windows}),
            "outside": {"launches_per_step": outside_count / max(1, num_steps),
                        "us_per_step": outside_us / max(1, num_steps)}}


@contextmanager
def layer_ranges(model):
    """Inside: each decoder layer's forward_residual runs in record_function("moekv_layer_<i>") (an instance
    attribute shadowing the method; removed on exit)."""
    from torch.profiler import record_function

    def ranged(layer):
        inner = type(layer).forward_residual.__get__(layer)

        def forward_residual(*args, **kwargs):
            with record_function(f"{LAYER_RANGE}{layer.layer_idx}"):
                return inner(*args, **kwargs)
        return forward_residual

    for layer in model.layers:
        layer.forward_residual = ranged(layer)
    try:
        yield
    finally:
        for layer in model.layers:
            del layer.forward_residual


def trace_events(prof) -> list[dict]:
    """A finished torch.profiler's complete ("X") events, from its Chrome trace (a documented, stable format)."""
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]


def profile_layers(step, model, num_steps: int, device: torch.device) -> dict | None:
    """Run step() num_steps times under torch.profiler with the per-layer ranges installed; -> attribute()'s
    dict (None off CUDA: no kernels to see)."""
    if device.type != "cuda" or num_steps <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile

    with layer_ranges(model):
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(num_steps):
                step()
            torch.cuda.synchronize(device)
    return attribute(trace_events(prof), len(model.layers), num_steps)


@torch.inference_mode()
def fusion_parity(model, num_tokens: int = 8, seed: int = 0) -> dict:
    """Layer 0 of `model` on the same `num_tokens` tokens (a prefill into a fresh full-precision cache, within
    FUSED_ROUTER_MAX_TOKENS, so both fused kernels run) with the fused decode layer on and off: the residual after
    attention (same math and rounding points: expected bit-equal), the MoE output (max |diff| / max |off|; the
    router logits' fp32 summation order may flip a near-tied expert) and the expert-load counts."""
    from moekv.config import CacheConfig
    from moekv.core.attention_metadata import AttentionMetadata
    from moekv.kvcache import KVCacheSpec, create_kv_cache
    from moekv.ops import dispatch

    arch, device, page = model.arch, model.device, 16
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[model.dtype]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, arch.vocab_size, (num_tokens,), generator=gen).to(device)
    pages = -(-num_tokens // page)
    layer = model.layers[0]
    runs = {}
    for fused in (True, False):
        spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, page, model.dtype)
        cache = create_kv_cache(CacheConfig(kv_cache_dtype=name), spec, pages + 1, device)
        meta = AttentionMetadata.build([num_tokens], [0], [list(range(1, pages + 1))], page, device)
        load = torch.zeros(arch.num_experts, dtype=torch.int64, device=device)
        with dispatch.override(fused_decode_layer=fused):
            hidden = model.embed_tokens(ids)
            cos, sin = model.rotary(torch.arange(num_tokens, device=device), hidden.dtype)
            out, residual = layer.forward_residual(hidden, None, cos, sin, cache, meta, load)
        runs[fused] = (out.float(), residual, load)
    (out_on, res_on, load_on), (out_off, res_off, load_off) = runs[True], runs[False]
    return {"tokens": num_tokens, "residual_bit_equal": bool(torch.equal(res_on, res_off)),
            "residual_max_abs_diff": (res_on.float() - res_off.float()).abs().max().item(),
            "moe_out_max_rel_diff": ((out_on - out_off).abs().max() / out_off.abs().max().clamp_min(1e-30)).item(),
            "expert_load_equal": bool(torch.equal(load_on, load_off))}


def markdown(profile: dict, title: str) -> list[str]:
    us = profile["us_per_layer"]
    lines = [f"### Kernels of one decode layer: {title}", "",
             f"{profile['kernels_per_layer']:.1f} kernels per layer ({profile['small_kernels_per_layer']:.1f} small); "
             f"GPU us per layer: GEMM {us['GEMM']:.1f}, attention {us['attention']:.1f}, small (non-GEMM) "
             f"**{us['small']:.1f}** (issue 19 target < 10 us at B=1); outside the layers "
             f"{profile['outside']['launches_per_step']:.0f} launches, {profile['outside']['us_per_step']:.1f} us "
             f"per step ({profile['layers_seen']} layers seen).", "",
             "| # | kernel | class | launches / layer | us / layer | us / launch |", "|---|---|---|---|---|---|"]
    lines += [f"| {i} | `{k['name']}` | {k['class']} | {k['launches_per_layer']:.2f} | {k['us_per_layer']:.2f} | "
              f"{k['us_per_launch']:.2f} |" for i, k in enumerate(profile["kernels"], 1)]
    return lines
