"""Quick A/B of LowBitCache settings on bench_hf_cache.py's protocol, moekv rows only (no quanto / HQQ needed).

    .venv/bin/python benchmarks/probe_hf_cache_moekv.py '{"bits": 4}' '{"bits": 4, "outlier_select": "deviation"}'
    .venv/bin/python benchmarks/probe_hf_cache_moekv.py --windows 9 --window-stride 4096 '{"bits": 4}'
    .venv/bin/python benchmarks/probe_hf_cache_moekv.py --exact value '{"bits": 4}'     # values kept exact

Each argument is a JSON dict of LowBitCache keyword arguments. The protocol is bench_hf_cache's (windows of
--context tokens, prefill 256, chunks of 16, residual_length 128, KL against DynamicCache); the reference
log-probabilities are computed once per (windows, stride, context) and kept under --cache-dir. Prints perplexity,
mean KL, KL per window and the low-bit bits per value of each row (docs/kv-fidelity.md, issue 23, used it to pick
int4's defaults); --exact key|value stores that half unquantized (its bytes still counted) to split the error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hf_cache as bench  # noqa: E402


class _Exact:
    """Stands in for one kind's QuantizedKV: dequantizes to the input itself (bytes of the real one)."""

    def __init__(self, x, quantized):
        self.x, self.quantized = x, quantized

    def dequantize(self):
        return self.x.clone()

    @property
    def nbytes(self):
        return self.quantized.nbytes


def keep_exact(kind: str) -> None:
    from moekv.integrations import lowbit_store

    quantize = lowbit_store.LowBitKVStore._quantize

    def patched(self, x, which):
        quantized = quantize(self, x, which)
        return _Exact(x, quantized) if which == kind else quantized

    lowbit_store.LowBitKVStore._quantize = patched


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="+", help="JSON dicts of LowBitCache keyword arguments")
    parser.add_argument("--model", default=str(bench.BUNDLED))
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--window-stride", type=int, default=8192)
    parser.add_argument("--exact", choices=("key", "value"), default=None)
    parser.add_argument("--cache-dir", default="/tmp/moekv-probe")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    protocol = argparse.Namespace(text=None, windows=args.windows, window_stride=args.window_stride,
                                  context=args.context, prefill=256, chunk=16)
    windows = bench.load_windows(protocol, tokenizer)
    cached = Path(args.cache_dir) / f"{Path(args.model).resolve().name}-{args.windows}x{args.context}-{args.window_stride}.pt"
    if cached.exists():
        references = torch.load(cached)
    else:
        metrics, references, _ = bench.evaluate_spec(bench.CacheSpec("reference", "dynamic", 16, ""), model, windows,
                                                     None, protocol)
        cached.parent.mkdir(parents=True, exist_ok=True)
        torch.save(references, cached)
        print(f"reference perplexity {metrics['perplexity']:.4f}", flush=True)
    if args.exact:
        keep_exact(args.exact)
    for text in args.settings:
        kwargs = json.loads(text)
        begin = time.perf_counter()
        spec = bench.CacheSpec(text, "moekv", kwargs.get("bits", 3), "", kwargs)
        metrics, logprobs, _ = bench.evaluate_spec(spec, model, windows, references, protocol)
        per_window = [float((r.exp() * (r - s)).sum(-1).mean()) for r, s in zip(references, logprobs)]
        print(f"{text:60s} ppl {metrics['perplexity']:.4f}  KL {metrics['mean_kl']:.6f}  per window "
              f"{' '.join(f'{k:.6f}' for k in per_window)}  low-bit bits {metrics['bits_per_value_lowbit']:.3f}  "
              f"({time.perf_counter() - begin:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
