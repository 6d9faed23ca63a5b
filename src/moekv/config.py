"""Frozen configuration dataclasses, one per concern, validated at construction.

Derived values are properties, so a config never holds two numbers that can disagree.
Every error names the field, the bad value and what is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from moekv import envs
from moekv.arch import ArchConfig  # noqa: F401  (re-exported: the architecture record lives in arch.py)
from moekv.errors import ConfigError
from moekv.offload_config import EVICTION_POLICIES, OffloadConfig, parse_expert_cache_size  # noqa: F401  (re-exported)
from moekv.cache_config import (KEY_AXIS_MODES, KV_CACHE_DTYPES, LOW_BIT_KV_DTYPES, OUTLIER_SELECTS,  # noqa: F401
                                CacheConfig, canonical_kv_cache_dtype, default_outlier_select)  # (re-exported)

MODEL_DTYPES = {
    "auto": "auto",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}
WEIGHT_QUANTIZATIONS = ("fp8",)      # ModelConfig.quantization / --quantization


def canonical_quantization(name: str | None) -> str | None:
    """None / "none" / "" -> None; "fp8" -> "fp8"; anything else a ConfigError."""
    if name is None or (isinstance(name, str) and name.lower() in ("", "none")):
        return None
    if not isinstance(name, str) or name.lower() not in WEIGHT_QUANTIZATIONS:
        raise ConfigError(f"unknown quantization {name!r}; accepted: none, {', '.join(WEIGHT_QUANTIZATIONS)}")
    return name.lower()


def canonical_model_dtype(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in MODEL_DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; accepted: auto, bf16, fp16, fp32")
    return MODEL_DTYPES[name.lower()]


def torch_dtype(name: str):
    """Canonical dtype name ('bf16', 'fp16', 'fp32') -> torch.dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how: the user's choices, not the checkpoint's architecture."""

    model: str                          # path to a Hugging Face checkpoint folder (ids: models.hub resolves them)
    dtype: str = "auto"                 # auto (the checkpoint's), bf16, fp16, fp32
    max_model_len: int | None = None    # None: the checkpoint's max_position_embeddings
    seed: int = 0
    quantization: str | None = None     # None: weights as the checkpoint holds them (an FP8 checkpoint stays FP8);
                                        # "fp8": 16-bit projections and experts quantized to FP8 at load time,
                                        # per output channel (W8A16; docs/weight-quantization.md)
    tokenizer: str | None = None        # the tokenizer's folder; None: the model folder
    generation_config: str = "auto"     # where generation_config.json is read: auto (the model folder),
                                        # "vllm"/"none" (not read), or a folder

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be a path to a Hugging Face checkpoint folder")
        object.__setattr__(self, "dtype", canonical_model_dtype(self.dtype))
        object.__setattr__(self, "quantization", canonical_quantization(self.quantization))
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ConfigError(f"max_model_len must be a positive integer or None, got {self.max_model_len!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError("generation_config must be auto, vllm or a folder")

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model

    @property
    def generation_config_dir(self) -> str | None:
        """The folder generation_config.json is read from, None when it is not read."""
        if self.generation_config in ("vllm", "none"):
            return None
        return self.model if self.generation_config == "auto" else self.generation_config


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256             # sequences running at once
    max_num_batched_tokens: int = 8192  # tokens (prefill chunks + decodes) in one step

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be a positive integer, got {self.max_num_batched_tokens!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence needs a token of the step's budget to decode; with fewer tokens than
            # sequences the last admitted ones would wait while the first ones decode (starvation)
            raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                              f"({self.max_num_seqs}): each running sequence decodes one token per step; raise "
                              "max_num_batched_tokens or lower max_num_seqs")


@dataclass(frozen=True)
class ParallelConfig:
    """Expert parallelism over torch.distributed (one process per rank, launched by torchrun).

    See docs/expert-parallel.md: experts sharded over ranks, attention data-parallel, steps in lockstep.
    """

    expert_parallel_size: int = 1
    num_redundant_experts: int = 0      # extra expert slots for replicas of hot experts (EPLB)
    expert_dispatch: str = "auto"       # "all_to_all" | "allgather" | "auto" (allgather for small steps)
    allgather_max_tokens: int | None = None   # auto: allgather while no rank has more tokens than this in a
                                        # step; None: the measured default of the backend (distributed.expert_parallel)
    rebalance_interval: int = 0         # re-place experts from the recorded load every N steps (0: only
                                        # when asked, LLM.rebalance())

    def __post_init__(self) -> None:
        if not isinstance(self.expert_parallel_size, int) or self.expert_parallel_size < 1:
            raise ConfigError(f"expert_parallel_size must be a positive integer, got {self.expert_parallel_size!r}")
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ConfigError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts!r}")
        if self.num_redundant_experts and self.expert_parallel_size == 1:
            raise ConfigError("num_redundant_experts needs expert_parallel_size > 1 (replicas live on other ranks)")
        if self.expert_dispatch not in ("auto", "all_to_all", "allgather"):
            raise ConfigError(f"expert_dispatch must be auto, all_to_all or allgather, got {self.expert_dispatch!r}")
        if self.allgather_max_tokens is not None and (not isinstance(self.allgather_max_tokens, int)
                                                      or self.allgather_max_tokens < 0):
            raise ConfigError(f"allgather_max_tokens must be >= 0 or None, got {self.allgather_max_tokens!r}")
        if not isinstance(self.rebalance_interval, int) or self.rebalance_interval < 0:
            raise ConfigError(f"rebalance_interval must be >= 0, got {self.rebalance_interval!r}")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"                # auto (cuda when available), cpu, cuda, cuda:N
    cpu_threads: int | None = None      # torch intra-op threads on the CPU; None: per step (engine/cpu_threads.py):
                                        # small models (hidden < 2048) 1 thread, every core for steps of
                                        # >= 1024 tokens (long prefill chunks); larger models torch's default
    cuda_graphs: bool = True            # decode-only steps replay CUDA graphs (per batch-size bucket) on CUDA;
                                        # False (--enforce-eager): every step runs eagerly
    cpu_kernel_cache_entries: int | None = 128   # CPU: entries of oneDNN's (and ideep's) caches of compiled
                                        # matmuls, keyed by shape, ~1 MB each: at their default 1024, batches of
                                        # ever-new shapes grew a server's RSS by ~1 GB (issue 20). None: theirs.
    overlap_decode: bool | None = None  # overlapped CUDA-graph decode steps (engine/overlap.py): the host plans and
                                        # launches step n+1 while the GPU runs step n, whose tokens it reads one
                                        # step later; outputs as with False. None: on, unless expert parallelism
                                        # (ranks agree on each step in lockstep) -- measured on the H200, session
                                        # 27: B=1 16k -0.19 / -0.40 ms per token (bf16 / int3 KV), B=64 -1.42 ms
                                        # (docs/decode-results.md); True with expert parallelism is an error

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ConfigError(f"cpu_threads must be a positive integer or None, got {self.cpu_threads!r}")
        if self.cpu_kernel_cache_entries is not None and (not isinstance(self.cpu_kernel_cache_entries, int)
                                                          or self.cpu_kernel_cache_entries < 1):
            raise ConfigError(f"cpu_kernel_cache_entries must be a positive integer or None (0 crashes oneDNN), "
                              f"got {self.cpu_kernel_cache_entries!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.overlap_decode is not None and not isinstance(self.overlap_decode, bool):
            raise ConfigError(f"overlap_decode must be True, False or None (auto), got {self.overlap_decode!r}")

    @property
    def resolved(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class ServerLimits:
    """What one HTTP client may hold of `moekv serve` (docs/serving.md, "Limits")."""

    max_connections: int = 1024         # open connections; one more gets a 503 and is closed
    header_timeout_s: float = 10.0      # from the first byte of a request to the end of its headers
    read_timeout_s: float = 30.0        # longest wait for the next piece of a request body (408)
    keep_alive_timeout_s: float = 5.0   # an idle keep-alive connection is closed after this

    def __post_init__(self) -> None:
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ConfigError(f"max_connections must be a positive integer, got {self.max_connections!r}")
        for name in ("header_timeout_s", "read_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels `ops.dispatch` runs; the engine installs it (`ops.dispatch.install`).

    `from_env()` (the EngineConfig default) applies the MOEKV_* overrides (see `envs.py`) to these
    defaults: MOEKV_OPS_BACKEND, MOEKV_LOWBIT_DECODE, MOEKV_FUSED_LAYER_OPS, MOEKV_FUSED_DECODE_LAYER,
    MOEKV_FUSED_ATTENTION_COMBINE, MOEKV_FUSED_MOE_COMBINE, MOEKV_FUSED_ROUTE_FOLD, MOEKV_SKINNY_GEMM, MOEKV_PDL,
    MOEKV_W8A8_MIN_TOKENS, MOEKV_BATCH_INVARIANT.
    """

    SKINNY_GEMM_MAX_ROWS = 64           # the skinny GEMM's largest M (class constant, not a field)
    FUSED_ROUTER_MAX_TOKENS = 64        # add + norm + router in one launch up to this many tokens (each program
                                        # reads the whole router weight; prefill keeps the GEMM)

    backend: str = "auto"               # auto (Triton on CUDA, the reference elsewhere) | reference | triton
                                        # (forced everywhere, CPU tensors through Triton's interpreter)
    lowbit_decode: str = "auto"         # the low-bit decode-only kernel: auto (ops.dispatch.DEFAULT_LOWBIT_DECODE)
                                        # or a name of ops.dispatch.LOWBIT_DECODE_KERNELS (checked there)
    fused_layer_ops: bool = True        # the fused per-layer Triton ops (norm, rotary, routing) on CUDA under
                                        # "auto" (the default since their H200 run, see ops.dispatch)
    skinny_gemm_rows: int = 0           # the opt-in skinny GEMM for linear layers of 1..N rows (N <= 64); 0: off
                                        # (no end-to-end gain measured, see ops.dispatch); MOEKV_SKINNY_GEMM=auto: 1,
                                        # =1: 16, =64: 64 (decode batches up to 64: BLOCK_M 32 / 64, not yet measured)
    fused_decode_layer: bool = True     # the cross-op fusions of a decoder layer, on top of fused_layer_ops:
                                        # add + RMSNorm + router GEMV + top-k in one launch, q/k norm + rotary +
                                        # the full-precision KV write in one (docs/moe-kernels.md,
                                        # "Kernels per decode layer"); MOEKV_FUSED_DECODE_LAYER=0 turns them off
    fused_attention_combine: bool = False  # full-precision decode attention merges its split-K partials inside the
                                        # decode launch (the last program of a (sequence, kv head) combines,
                                        # ops/triton/attention/split_k.combine_if_last) instead of a second launch;
                                        # off until measured on the GPU (gpu-runbook row 2b); MOEKV_FUSED_ATTENTION_COMBINE=1
    fused_moe_combine: bool = True      # on top of fused_decode_layer: the MoE decode kernels' combine summed by the
                                        # next residual add + RMSNorm (one launch fewer per MoE layer); measured
                                        # B=1 16k -3.3%, B=16 4k +0.3% (decode-h200-moecombine.md);
                                        # MOEKV_FUSED_MOE_COMBINE=0 turns it off
    fused_route_fold: bool = True       # on top of fused_decode_layer: a router of several programs per token (E=128)
                                        # routed by each token's last program to arrive (MoE block's counters) instead
                                        # of a second launch; exact (the same bits), not yet measured on a GPU
                                        # (docs/moe-kernels.md); MOEKV_FUSED_ROUTE_FOLD=0 turns it off
    pdl: bool = False                   # programmatic dependent launch for the decode step's Triton kernels on
                                        # compute capability >= 9.0 (ops/triton/pdl.py): each may be scheduled
                                        # while the kernel before it finishes; off until a GPU run measures it
                                        # (docs/gpu-runbook.md, session 28); MOEKV_PDL=1 turns it on
    w8a8_min_tokens: int = 0            # FP8 weights: from this many rows per MoE call / FP8 projection on, the
                                        # activations are quantized to e4m3 per row and the dots are fp8 x fp8 (W8A8:
                                        # the grouped MoE kernel, fp8_linear's dot kernel); 0: never (W8A16
                                        # everywhere, the default until a GPU run measures where it pays);
                                        # MOEKV_W8A8_MIN_TOKENS=N
    batch_invariant: bool = False       # every token row's result bit-identical whatever else shares its step (batch
                                        # size, prefill chunk, CUDA-graph bucket): one fixed-tile GEMM for every linear,
                                        # the grouped MoE path with one config, attention split at fixed token counts,
                                        # no size-dependent fusions (docs/serving.md, "Batch-invariant mode"); slower,
                                        # opt-in; MOEKV_BATCH_INVARIANT=1

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "reference", "triton"):
            raise ConfigError(f"kernel backend must be auto, reference or triton, got {self.backend!r}")
        if not isinstance(self.lowbit_decode, str) or not self.lowbit_decode:
            raise ConfigError(f"lowbit_decode must be a kernel name or auto, got {self.lowbit_decode!r}")
        for name in ("fused_layer_ops", "fused_decode_layer", "fused_attention_combine", "fused_moe_combine",
                     "fused_route_fold", "pdl", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.w8a8_min_tokens, int) or isinstance(self.w8a8_min_tokens, bool) \
                or self.w8a8_min_tokens < 0:
            raise ConfigError(f"w8a8_min_tokens must be an integer >= 0 (0: off), got {self.w8a8_min_tokens!r}")
        if (not isinstance(self.skinny_gemm_rows, int) or isinstance(self.skinny_gemm_rows, bool)
                or not 0 <= self.skinny_gemm_rows <= self.SKINNY_GEMM_MAX_ROWS):
            raise ConfigError(f"skinny_gemm_rows must be in 0..{self.SKINNY_GEMM_MAX_ROWS} (0: off), "
                              f"got {self.skinny_gemm_rows!r}")

    @classmethod
    def from_env(cls, **fields: Any) -> "KernelConfig":
        """`fields` (else the defaults) with the environment's overrides applied."""
        return cls(**{**fields, **envs.kernel_overrides()})


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, one field per concern."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig.from_env)

    def __post_init__(self) -> None:
        if self.device.overlap_decode and self.parallel.expert_parallel_size > 1:
            raise ConfigError("overlap_decode needs expert_parallel_size == 1 (expert-parallel ranks agree on each "
                              "step before it runs, in lockstep)")
        if self.kernels.batch_invariant:
            batch_invariant_limits(self)
        if self.device.overlap_decode is None:          # auto: on wherever it may run
            overlap = self.parallel.expert_parallel_size == 1
            object.__setattr__(self, "device", replace(self.device, overlap_decode=overlap))


def batch_invariant_limits(config: EngineConfig) -> None:
    """What KernelConfig.batch_invariant does not cover yet, refused by name (docs/serving.md, "Batch-invariant
    mode"): the low-bit KV formats (their CUDA decode kernel and Triton prefill kernel compute a token's attention
    differently), expert parallelism and expert offloading (their expert passes keep their own per-step tiles)."""
    if config.cache.is_low_bit:
        raise ConfigError(f"batch_invariant needs a full-precision KV cache (bf16, fp16, fp32), got kv_cache_dtype="
                          f"{config.cache.kv_cache_dtype!r}: the low-bit decode and prefill kernels differ")
    if config.parallel.expert_parallel_size > 1:
        raise ConfigError("batch_invariant does not cover expert parallelism yet (expert_parallel_size must be 1)")
    if config.offload.cpu_offload_experts:
        raise ConfigError("batch_invariant does not cover expert offloading yet (cpu_offload_experts must be off)")
