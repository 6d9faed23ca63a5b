"""The expert-offload flags that `moekv generate` and `moekv serve` share (OffloadConfig, docs/expert-offload.md)."""

from __future__ import annotations

import argparse

from moekv.offload_config import OFFLOAD_FLAGS_HELP, parse_prefetch_threshold


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-offload-experts", action="store_true", help="keep routed experts in host memory "
                        "with a device cache of expert slots per MoE layer (docs/expert-offload.md)")
    parser.add_argument("--expert-cache-size", default=None, help="with --cpu-offload-experts: slots per MoE "
                        "layer (4), a share of each layer's experts (50%%) or device memory for all slots (12GB); "
                        "default 50%%")
    parser.add_argument("--no-prefetch", action="store_true", help="with --cpu-offload-experts: load experts on "
                        "demand only (no prediction-driven prefetch)")
    parser.add_argument("--prefetch-threshold", default=None, help=OFFLOAD_FLAGS_HELP["prefetch_threshold"])
    parser.add_argument("--prefetch-guard", action=argparse.BooleanOptionalAction, default=True,
                        help=OFFLOAD_FLAGS_HELP["prefetch_guard"])
    parser.add_argument("--host-format", default="native", choices=("native", "fp8"),
                        help=OFFLOAD_FLAGS_HELP["host_format"])
    parser.add_argument("--expert-staging", default="host", choices=("host", "device"),
                        help=OFFLOAD_FLAGS_HELP["expert_staging"])
    parser.add_argument("--cpu-compute-fraction", type=float, default=0.0,
                        help=OFFLOAD_FLAGS_HELP["cpu_compute_fraction"])


def offload_kwargs(args: argparse.Namespace) -> dict:
    """The parsed flags above as LLM / EngineConfig keyword arguments (expert_cache_size only when given)."""
    kwargs = dict(cpu_offload_experts=args.cpu_offload_experts, prefetch=not args.no_prefetch,
                  prefetch_threshold=parse_prefetch_threshold(args.prefetch_threshold),
                  prefetch_guard=args.prefetch_guard, host_format=args.host_format, staging=args.expert_staging,
                  cpu_compute_fraction=args.cpu_compute_fraction)
    if args.expert_cache_size is not None:
        kwargs["expert_cache_size"] = args.expert_cache_size
    return kwargs
