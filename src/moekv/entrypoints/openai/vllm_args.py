"""`moekv serve`'s vLLM spellings: flags that mean what they mean in `vllm serve`, and the vLLM flags
moekv does not implement, which fail naming themselves (docs/serving.md, "Coming from vLLM").

`add_vllm_arguments(parser)` adds them; `engine_kwargs(args)` turns the parsed ones into the keyword
arguments of `make_engine_config` (ConfigError on a value moekv cannot honour).
"""

from __future__ import annotations

import argparse
import logging

from moekv import envs
from moekv.errors import ConfigError

logger = logging.getLogger("moekv.server")

# vLLM flags moekv does not implement -> why (the error names the flag and says this).
UNSUPPORTED_FLAGS: dict[str, str] = {
    "--pipeline-parallel-size": "no pipeline parallelism (experts shard with --enable-expert-parallel)",
    "--swap-space": "preempted requests are recomputed, never swapped to host memory",
    "--cpu-offload-gb": "use --cpu-offload-experts (routed experts in host memory with a device cache)",
    "--enable-lora": "no LoRA adapters", "--lora-modules": "no LoRA adapters",
    "--speculative-config": "no speculative decoding",
    "--tokenizer-mode": "the tokenizer is always tokenizer.json through `tokenizers`",
    "--kv-transfer-config": "no disaggregated prefill", "--kv-events-config": "no KV events",
    "--compilation-config": "no torch.compile; decode steps replay CUDA graphs (--enforce-eager turns that off)",
    "--cuda-graph-sizes": "graph buckets are powers of two up to --max-num-seqs",
    "--enable-sleep-mode": "no sleep mode", "--hf-overrides": "config.json is read as saved",
    "--rope-scaling": "config.json's rope settings are used as saved",
    "--max-num-partial-prefills": "one chunked prefill policy (--max-num-batched-tokens)",
    "--scheduling-policy": "first come, first served only",
    "--reasoning-parser": "no reasoning parsers", "--lora-extra-vocab-size": "no LoRA adapters",
    "--limit-mm-per-prompt": "text-only models", "--mm-processor-kwargs": "text-only models",
    "--distributed-executor-backend": "expert parallelism runs under torchrun",
    "--allowed-origins": "no CORS headers", "--root-path": "served at /", "--ssl-keyfile": "no TLS (use a proxy)",
    "--ssl-certfile": "no TLS (use a proxy)", "--response-role": "the assistant role is always `assistant`",
    "--kv-cache-memory": "size the KV pool with --gpu-memory-utilization or --num-gpu-blocks-override",
    "--num-lookahead-slots": "no speculative decoding", "--long-prefill-token-threshold": "one chunked prefill policy",
}


class _Unsupported(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is a vLLM flag moekv does not implement: {UNSUPPORTED_FLAGS[self.dest_flag]}")


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM spellings (same meaning as in `vllm serve`)")
    group.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id (default: the model's)")
    group.add_argument("--revision", default=None, help="with a Hub id: the branch, tag or commit of the cached "
                       "snapshot (default main)")
    group.add_argument("--tokenizer-revision", default=None, help="with a --tokenizer Hub id: its revision")
    group.add_argument("--download-dir", default=None, help="the Hugging Face cache folder to look model ids up "
                       "in (default: HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub); nothing is downloaded")
    group.add_argument("--generation-config", default="auto", help="auto (the model folder's "
                       "generation_config.json), vllm (do not read it) or a folder holding one")
    group.add_argument("--gpu-memory-utilization", type=float, default=None, help="share of the GPU's memory the "
                       "engine may use, weights + CUDA graphs + KV cache; the KV pool gets what is left (default "
                       "0.9; ignored on the CPU)")
    group.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV pages (= --num-pages)")
    group.add_argument("--enable-expert-parallel", action="store_true", help="shard experts over the ranks "
                       "(--data-parallel-size of them, default torchrun's WORLD_SIZE); = --expert-parallel-size")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=None, help="with --enable-expert-parallel: "
                       "the ranks (attention is data-parallel, experts sharded)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="only 1 (no tensor parallelism)")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="long prompts are always split under --max-num-batched-tokens; "
                            "--no-enable-chunked-prefill is an error")
    group.add_argument("--disable-log-requests", action="store_true", help="(the default) no line per request")
    group.add_argument("--enable-log-requests", action="store_true", help="log each request's arrival and end")
    group.add_argument("--disable-log-stats", action="store_true", help="(the default) no periodic stats lines; "
                       "scrape /metrics")
    group.add_argument("--max-logprobs", type=int, default=20, help="the most logprobs / top_logprobs a request "
                       "may ask for (default 20)")
    group.add_argument("--trust-remote-code", action="store_true", help="accepted; moekv never runs checkpoint "
                       "code (its architectures are built in)")
    group.add_argument("--enable-auto-tool-choice", action="store_true", help="accepted with --tool-call-parser, "
                       "which is what enables tool_choice auto in moekv")
    group.add_argument("--load-format", default="auto", help="auto or safetensors (the only format read)")
    group.add_argument("--uvicorn-log-level", default=None, choices=["debug", "info", "warning", "error"],
                       help="= --log-level")
    for flag in UNSUPPORTED_FLAGS:
        action = group.add_argument(flag, action=_Unsupported, nargs="?", help=argparse.SUPPRESS)
        action.dest_flag = flag


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The make_engine_config keyword arguments the vLLM spellings set (after the moekv ones)."""
    if args.tensor_parallel_size != 1:
        raise ConfigError(f"--tensor-parallel-size {args.tensor_parallel_size}: moekv has no tensor parallelism; "
                          "shard experts with --enable-expert-parallel --data-parallel-size N under torchrun")
    if args.enable_chunked_prefill is False:
        raise ConfigError("--no-enable-chunked-prefill: moekv always splits long prompts into chunks of at most "
                          "--max-num-batched-tokens tokens")
    if args.load_format not in ("auto", "safetensors"):
        raise ConfigError(f"--load-format {args.load_format!r}: moekv reads safetensors only (auto, safetensors)")
    if args.max_logprobs < 0:
        raise ConfigError("--max-logprobs must be >= 0")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (hermes, qwen or mistral)")
    if args.trust_remote_code:
        logger.info("--trust-remote-code: moekv runs no checkpoint code; its built-in architectures load as is")
    out: dict = {"tokenizer": args.tokenizer, "revision": args.revision, "tokenizer_revision": args.tokenizer_revision,
                 "download_dir": args.download_dir, "generation_config": args.generation_config}
    if args.gpu_memory_utilization is not None:
        out["memory_fraction"] = args.gpu_memory_utilization
    if args.num_gpu_blocks_override is not None:
        if args.num_pages is not None and args.num_pages != args.num_gpu_blocks_override:
            raise ConfigError("--num-pages and --num-gpu-blocks-override disagree; give one")
        out["num_pages"] = args.num_gpu_blocks_override
    if args.data_parallel_size is not None and not args.enable_expert_parallel and args.data_parallel_size != 1:
        raise ConfigError(f"--data-parallel-size {args.data_parallel_size} without --enable-expert-parallel: moekv "
                          "has no data parallelism of whole replicas; run one server per GPU behind a balancer, or "
                          "add --enable-expert-parallel")
    if args.enable_expert_parallel:
        size = args.data_parallel_size if args.data_parallel_size is not None else envs.torchrun_int("WORLD_SIZE", 1)
        if args.expert_parallel_size not in (1, size):
            raise ConfigError(f"--expert-parallel-size {args.expert_parallel_size} and --enable-expert-parallel "
                              f"over {size} ranks disagree; give one")
        if size < 2:
            raise ConfigError("--enable-expert-parallel needs 2 or more ranks: --data-parallel-size N, launched "
                              "with torchrun --nproc-per-node N -m moekv serve ...")
        out["expert_parallel_size"] = size
    return out
