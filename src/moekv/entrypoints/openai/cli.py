"""`moekv serve`: load a checkpoint and serve it over an OpenAI-compatible HTTP API (uvicorn).

SIGINT and SIGTERM shut down gracefully: no new connections; running requests get `--shutdown-timeout`
seconds to finish; then each open stream ends with an error event and `data: [DONE]` (a pending
non-streamed answer with a 503), one log line per request ended; the process exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
import time
from pathlib import Path

from moekv.config import ServerLimits
from moekv.entrypoints.openai.vllm_args import add_vllm_arguments, engine_kwargs
from moekv.errors import ConfigError
from moekv.entrypoints.offload_args import add_offload_arguments, offload_kwargs
from moekv.paths import default_model_dir

logger = logging.getLogger("moekv.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint folder or Hugging Face id in the local cache (= --model)")
    parser.add_argument("--model", default=None, help="checkpoint folder, or a Hugging Face id already in the local "
                        "cache (default: the bundled tiny-shakespeare-moe model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine "
                        "only; 0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--served-model-name", nargs="+", default=None, help="the model name(s) clients may send; "
                        "the first is reported (default: the model id, or the checkpoint folder's name)")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* "
                        "(/health and /metrics stay open)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file overriding the tokenizer's")
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes", "qwen", "mistral"],
                        help="how tool calls are read from the output for tool_choice auto (hermes/qwen: "
                             "<tool_call>{json}</tool_call>; mistral: [TOOL_CALLS]); default none: auto is a 400")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (model dtype), bf16, fp16, fp32, int4, int3, int2 (default auto)")
    parser.add_argument("--dtype", default="auto", help="model weights dtype: auto, bf16, fp16, fp32")
    parser.add_argument("--quantization", default=None, choices=("none", "fp8"),
                        help="fp8: quantize the projections and experts to FP8 at load time (W8A16, per output "
                             "channel); FP8 checkpoints load as FP8 without it")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    parser.add_argument("--num-pages", type=int, default=None, help="KV cache pages (default: sized from memory)")
    parser.add_argument("--page-size", "--block-size", type=int, default=None, help="tokens per KV page")
    parser.add_argument("--staging-block-size", type=int, default=None, help="low-bit KV: hold a partly filled page's "
                        "full-precision rows in blocks of this many tokens (default: whole pages; docs/kv-format.md)")
    parser.add_argument("--lazy-partial-page", action="store_true", help="low-bit KV: a partly filled page takes "
                        "its low-bit storage only when it fills (docs/kv-format.md)")
    parser.add_argument("--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs "
                        "for decode steps)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse cached KV pages of prompt prefixes shared across requests (default on; "
                        "--no-enable-prefix-caching turns it off)")
    add_offload_arguments(parser)
    parser.add_argument("--no-expert-prediction-stats", action="store_true",
                        help="do not run the next-layer expert predictor for the recall metrics")
    parser.add_argument("--expert-parallel-size", type=int, default=1,
                        help="shard experts over N ranks; launch with torchrun --nproc-per-node N -m moekv serve "
                             "(rank 0 serves HTTP; docs/expert-parallel.md)")
    parser.add_argument("--num-redundant-experts", type=int, default=0,
                        help="with --expert-parallel-size: replicas of the hottest experts on other ranks")
    parser.add_argument("--expert-dispatch", default="auto", choices=["auto", "all_to_all", "allgather"],
                        help="with --expert-parallel-size: how tokens reach their experts' ranks")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests that give none (default 0)")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20,
                        help="largest accepted request body in bytes (default 1 MiB; larger -> 413)")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds open streams may run after SIGINT/SIGTERM (default 5)")
    parser.add_argument("--max-tokens-default", type=int, default=None, metavar="N",
                        help="chat requests without max_tokens generate at most N tokens (default: the rest of the "
                             "context, as vLLM does)")
    defaults = ServerLimits()
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help=f"most open HTTP connections; one more gets a 503 (default {defaults.max_connections})")
    parser.add_argument("--header-timeout", type=float, default=defaults.header_timeout_s, metavar="S",
                        help=f"close a connection whose request headers take longer (408; default "
                             f"{defaults.header_timeout_s:g})")
    parser.add_argument("--read-timeout", type=float, default=defaults.read_timeout_s, metavar="S",
                        help=f"longest wait for the next piece of a request body (408; default "
                             f"{defaults.read_timeout_s:g})")
    parser.add_argument("--keep-alive-timeout", type=float, default=defaults.keep_alive_timeout_s, metavar="S",
                        help=f"close idle keep-alive connections after S seconds (default "
                             f"{defaults.keep_alive_timeout_s:g})")
    parser.add_argument("--metrics-prefix", default="moekv", choices=["moekv", "vllm"],
                        help="prefix of the /metrics series vLLM also has (vllm: a vLLM dashboard reads them "
                             "unchanged); moekv-only series stay moekv: (default moekv)")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_vllm_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.uvicorn_log_level is not None:
        args.log_level = args.uvicorn_log_level
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from moekv.engine.async_engine import AsyncEngine
    from moekv.engine.factory import build_serving_engine
    from moekv.entrypoints.openai.http_limits import uvicorn_options
    from moekv.entrypoints.openai.server import build_app
    from moekv.entrypoints.openai.serving import ServerConfig
    from moekv.metrics import ServerMetrics

    config, model = engine_config_from_args(args)
    chat_template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            raise ConfigError(f"--chat-template: no such file: {path}")
        chat_template = path.read_text()
    if args.max_request_bytes < 1:
        raise ConfigError("--max-request-bytes must be positive")
    if args.max_tokens_default is not None and args.max_tokens_default < 1:
        raise ConfigError("--max-tokens-default must be positive")
    limits = ServerLimits(max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                          read_timeout_s=args.read_timeout, keep_alive_timeout_s=args.keep_alive_timeout)
    engine = build_serving_engine(config)   # expert parallel: rank 0's LeaderEngine; ranks > 0 step with it
    if engine is None:                      # inside, until it stops them
        return 0
    capacity = engine.kv_manager.capacity_tokens
    logger.info("KV cache capacity: %d tokens (%s); max concurrency at max_model_len=%d: %.2f requests",
                capacity, engine.cache_config.kv_cache_dtype, engine.max_model_len, capacity / engine.max_model_len)
    names = args.served_model_name or [model if not Path(model).exists() else Path(model).resolve().name]
    name = names[0]
    metrics = ServerMetrics(name, prefix=args.metrics_prefix, max_model_len=engine.max_model_len)
    async_engine = AsyncEngine(engine, metrics)
    app = build_app(async_engine, ServerConfig(
        served_model_name=name, model_path=config.model.model, api_key=args.api_key,
        max_request_bytes=args.max_request_bytes, chat_template=chat_template,
        tool_call_parser=args.tool_call_parser, limits=limits,
        default_max_tokens=args.max_tokens_default, served_model_aliases=tuple(names[1:]),
        max_logprobs=args.max_logprobs, log_requests=args.enable_log_requests and not args.disable_log_requests))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("serving on %s without --api-key: anyone who can reach this address can use it", args.host)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout,
                            lifespan="on", **uvicorn_options(limits))
    server = _graceful_server(config, async_engine)
    logger.info("serving %s as %r on http://%s:%d/v1", model, name, args.host, args.port)
    try:
        server.run()
    finally:
        engine.stop_followers()             # expert parallel: ranks > 0 leave their loop (else a no-op)
    return 0 if server.started else 1


def engine_config_from_args(args: argparse.Namespace):
    """(the EngineConfig the parsed flags ask for, the model as named); ConfigError on a bad combination."""
    from moekv.entrypoints.llm import make_engine_config, resolve_model_names

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ConfigError(f"two models given: {args.model_tag!r} (positional) and --model {args.model!r}")
    model = args.model_tag or args.model or default_model_dir()
    extra = {key: value for key, value in (("max_num_seqs", args.max_num_seqs),
                                           ("max_num_batched_tokens", args.max_num_batched_tokens),
                                           ("num_pages", args.num_pages), ("page_size", args.page_size),
                                           ("staging_block_size", args.staging_block_size))
             if value is not None}
    if args.lazy_partial_page:
        extra["lazy_partial_page"] = True
    extra.update(offload_kwargs(args), track_prediction=not args.no_expert_prediction_stats,
                 cuda_graphs=not args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching)
    extra.update(engine_kwargs(args))       # the vLLM spellings (--enable-expert-parallel sets the size)
    size = extra.get("expert_parallel_size", args.expert_parallel_size)
    if size > 1:
        extra.update(expert_parallel_size=size, num_redundant_experts=args.num_redundant_experts,
                     expert_dispatch=args.expert_dispatch)
    folder, extra = resolve_model_names(model, extra)
    config = make_engine_config(folder, args.dtype, args.kv_cache_dtype, args.device, args.max_model_len,
                                args.seed, quantization=args.quantization, **extra)
    return config, model


FINAL_GRACE_S = 5.0   # after --shutdown-timeout: time for the aborted streams to send their last events


def _graceful_server(config, async_engine):
    """uvicorn's server with moekv's shutdown: stop accepting, let running requests finish within
    --shutdown-timeout, then end the rest through the engine (a stream gets an error event and
    `data: [DONE]`, a pending answer a 503 `aborted`, one log line each) instead of cancelling their tasks
    mid-body; and no re-raising of the captured signal afterwards (uvicorn does that so the process dies by
    the signal; a clean stop exits with status 0)."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets=None) -> None:
            timeout = self.config.timeout_graceful_shutdown or 0.0
            logger.info("shutting down: no new connections; running requests get %.1f s (--shutdown-timeout)",
                        timeout)
            for server in self.servers:
                server.close()
            for sock in sockets or []:
                sock.close()
            for connection in list(self.server_state.connections):
                connection.shutdown()   # idle keep-alive connections close now, busy ones after their response
            if not await self._drain(timeout):
                logger.warning("shutdown timeout reached: ending %d open request(s)", len(self.server_state.tasks))
                await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
                if not await self._drain(FINAL_GRACE_S):
                    for task in self.server_state.tasks:
                        task.cancel(msg="the shutdown timeout was exceeded")
            if not self.force_exit:
                await self.lifespan.shutdown()

        async def _drain(self, timeout_s: float) -> bool:
            """Wait until no connection is open and no request task runs; False at the timeout."""
            deadline = time.monotonic() + timeout_s
            while (self.server_state.connections or self.server_state.tasks) and not self.force_exit:
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(0.05)
            return True

    return GracefulServer(config)
