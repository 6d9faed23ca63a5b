"""The MoE decode path's two kernel variants side by side, and a small sweep of the fma variant's tiles: the
pieces of `benchmarks/bench_moe.py --variants dot,fma --fma-sweep` (issue 19: FP8 experts at the weight-bandwidth
floor; ops.triton.moe.decode_config picks the variant, ops.triton.moe.decode_fma is the GEMV one).

The sweep (one token, the layer bench_moe built, its timer: CUDA-graph replays with L2 flushed) is a coordinate
descent over a few dozen launches per layer:
  gate_up, timed alone (decode.decode_activation):
    1. BLOCK_N x BLOCK_K (3 x 3: 1 / 2 / 4 rows, the 3 largest powers of two <= the reduced size and the FP8 scale
       block), num_warps covering the tile with one 16-byte load per thread and row;
    2. num_warps halved and quartered (more loads in flight per thread);
    3. UNROLL 2 (where the loop has >= 2 steps);
  down, timed as the whole decode call with the best gate_up: the same three stages, then 4. SPLIT_K 1 / 2 / 4
  (stages 1-3 with SPLIT_K None: decode.default_split_k).
num_stages stays 1: the fma loop has no tl.dot, so Triton's pipeliner leaves it alone (sm_90 compiles at 1 and 3
stages are the same code). Every measured whole call is checked against the fp32 reference (error in the row).
"""

from __future__ import annotations

import triton

from moekv.core.fp8 import k_tile_cap
from moekv.ops.triton.moe import decode as moe_decode
from moekv.ops.triton.moe import decode_fma

VARIANTS = moe_decode.VARIANTS
ROW_FACTORS = (1, 2, 4)
BLOCK_KS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _elem_bytes(w) -> int:
    return getattr(w, "codes", w).element_size()


def variant_fns(w_gate_up, w_down, num_tokens: int, variants: list[str], swept: dict | None = None) -> dict:
    """name -> fn(hidden, ids, weights) of each variant that runs at this token count ("decode-dot",
    "decode-fma": its tuned or default tiles; "decode-fma-swept": the sweep's best tiles)."""
    configs = {f"decode-{variant}": {"VARIANT": variant} for variant in variants
               if variant == "dot" or decode_fma.applies(num_tokens, w_gate_up, w_down)}
    if swept and "fma" in variants and decode_fma.applies(num_tokens, w_gate_up, w_down):
        configs["decode-fma-swept"] = {"VARIANT": "fma", "gate_up": swept["gate_up"], "down": swept["down"]}
    return {name: (lambda h, i, w, _c=config: moe_decode.moe_experts_decode(h, w_gate_up, w_down, i, w, config=_c))
            for name, config in configs.items()}


def variant_config(name: str, hidden, w_gate_up, w_down, swept: dict | None = None) -> dict | None:
    """The resolved launch configuration an implementation of variant_fns runs (None: not a variant row)."""
    if not name.startswith("decode-"):
        return None
    variant = name.split("-")[1]
    if variant not in VARIANTS:
        return None
    config = {"VARIANT": variant}
    if name == "decode-fma-swept":
        config.update(gate_up=swept["gate_up"], down=swept["down"])
    return moe_decode._resolve_config(hidden, w_gate_up, config, w_down)


def _tiles(reduced: int, w, cap: int | None) -> list[dict]:
    per_warp = 32 * max(1, 16 // _elem_bytes(w))              # K elements of one 16-byte load per lane
    limit = max(16, triton.next_power_of_2(reduced)) if cap is None else min(cap, triton.next_power_of_2(reduced))
    block_ks = [k for k in BLOCK_KS if k <= limit][-3:]
    base = max(1, per_warp // block_ks[-1])                    # narrow K tiles (scale blocks): more rows
    return [{"BLOCK_N": base * rows, "BLOCK_K": k, "num_warps": max(1, min(8, base * rows * k // per_warp)),
             "num_stages": 1, "UNROLL": 1} for rows in ROW_FACTORS for k in block_ks]


def _refinements(best: dict, reduced: int) -> list[list[dict]]:
    warps = [dict(best, num_warps=w) for w in (best["num_warps"] // 2, best["num_warps"] // 4) if w >= 1]
    unroll = [dict(best, UNROLL=2)] if reduced >= 2 * best["BLOCK_K"] else []
    return [warps, unroll]


def fma_sweep(layer: tuple, inputs: tuple, expected, timer, moved: int, log=print) -> tuple[list[dict], dict]:
    """(rows, best {"gate_up", "down", "ms"}) of the fma variant at these inputs (hidden [1, H], ids, weights)."""
    w_gate_up, w_down = layer
    hidden, ids, weights = inputs
    hidden_size, inter = w_gate_up.shape[2], w_down.shape[2]
    rows = []

    def run_gate_up(cfg):
        return moe_decode.decode_activation(hidden, w_gate_up, ids, {"VARIANT": "fma", "gate_up": cfg})

    def run_all(gate_up, down):
        return moe_decode.moe_experts_decode(hidden, w_gate_up, w_down, ids, weights,
                                             config={"VARIANT": "fma", "gate_up": gate_up, "down": down})

    def measure(part, cfg, fn, check):
        try:
            error = None
            if check:
                error = ((fn().float() - expected).abs().max() / expected.abs().max()).item()
            ms, _ = timer(fn)
        except Exception as exc:                                       # noqa: BLE001 (reported, not fatal)
            log(f"    fma {part} {cfg}: failed: {type(exc).__name__}: {str(exc)[:160]}")
            return float("inf")
        row = {"part": part, "config": cfg, "ms": ms, "max_rel_err": error,
               "tbps": moved / ms / 1e9 if part == "down" else None}
        rows.append(row)
        log(f"    fma {part:7s} {ms:8.4f} ms {'' if error is None else f'err {error:.1e} '}{cfg}")
        return ms

    def descend(part, stages, fn, check):
        best, best_ms = None, float("inf")
        for stage in stages:
            candidates = stage(best) if callable(stage) else stage
            for cfg in candidates:
                ms = measure(part, cfg, lambda: fn(cfg), check)
                if ms < best_ms:
                    best, best_ms = cfg, ms
        return best, best_ms

    def refine(index, reduced):
        return lambda best: _refinements(best, reduced)[index]

    cap = k_tile_cap(w_gate_up, hidden_size)
    gate_up, _ = descend("gate_up", [_tiles(hidden_size, w_gate_up, cap), refine(0, hidden_size),
                                     refine(1, hidden_size)], run_gate_up, False)
    cap = k_tile_cap(w_down, inter)
    down_tiles = [dict(t, SPLIT_K=None) for t in _tiles(inter, w_down, cap)]
    down, best_ms = descend("down", [down_tiles, refine(0, inter), refine(1, inter),
                                     lambda best: [dict(best, SPLIT_K=s) for s in (1, 2, 4)]],
                            lambda cfg: run_all(gate_up, cfg), True)
    return rows, {"gate_up": gate_up, "down": down, "ms": best_ms}


def tables(result: dict) -> list[str]:
    """Markdown: the variant rows (ms, TB/s, % of the read bandwidth), the sweep, the best tiles as JSON."""
    import json

    read = result.get("read_bandwidth_tbps")
    lines = ["", "## Decode variants", "",
             f"Read bandwidth {read:.2f} TB/s (torch.sum, cold L2); target: FP8 at 1 token >= 85% of 4.3 TB/s "
             "(3.66 TB/s)." if read else "No GPU: timings are the interpreter's.", "",
             "| model | weights | tokens | implementation | ms | TB/s | % read | max rel err | config |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["moe_layer"]:
        if r.get("config") is None:
            continue
        pct = f"{100 * r['tbps'] / read:.1f}%" if read else "-"
        lines.append(f"| {r['model']} | {r['weights']} | {r['tokens']} | {r['impl']} | {r['ms']:.4f} | {r['tbps']:.3f} "
                     f"| {pct} | {r['max_rel_err']:.1e} | `{json.dumps(r['config'])}` |")
    for key, sweep in result.get("fma_sweep", {}).items():
        lines += ["", f"## fma sweep, {key}, 1 token (gate_up timed alone; down: the whole decode call)", "",
                  "| part | ms | TB/s (whole call) | max rel err | config |", "|---|---|---|---|---|"]
        for r in sweep["rows"]:
            tbps = "-" if r["tbps"] is None else f"{r['tbps']:.3f}"
            err = "-" if r["max_rel_err"] is None else f"{r['max_rel_err']:.1e}"
            lines.append(f"| {r['part']} | {r['ms']:.4f} | {tbps} | {err} | `{json.dumps(r['config'])}` |")
        best = {"gate_up": sweep["best"]["gate_up"], "down": sweep["best"]["down"]}
        lines += ["", f"Best ({sweep['best']['ms']:.4f} ms for the layer): as the tuned entry's \"fma\" "
                  f"(`\"VARIANT\": \"fma\"` then switches to it):", "", "```json", json.dumps({"fma": best}), "```"]
    return lines
