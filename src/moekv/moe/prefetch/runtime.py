"""install_routing(): what the engine calls once after building the model.

It always attaches the expert-load tracker (a decayed window over model.expert_load), and, as
OffloadConfig asks, the expert predictor (recall statistics, prefetch hints) and expert offloading.
`RoutingRuntime.stats()` is what `Engine.routing_stats()` returns.
"""

from __future__ import annotations

import torch

from moekv.config import OffloadConfig
from moekv.errors import ConfigError
from moekv.moe.load_stats import ExpertLoadTracker
from moekv.moe.prefetch.guard import PrefetchGuard
from moekv.moe.prefetch.manager import ExpertOffload, expert_bytes, resolve_cache_slots
from moekv.moe.prefetch.predictor import ExpertPredictor, moe_layer_ids

DEFAULT_PREDICTOR_SOURCE = "attn"    # see docs/expert-offload.md for the measured alternatives


class RoutingRuntime:
    """The routing add-ons of one model: load tracker, predictor, offload (each optional)."""

    def __init__(self, model: torch.nn.Module, load: ExpertLoadTracker | None,
                 predictor: ExpertPredictor | None, offload: ExpertOffload | None,
                 guard: PrefetchGuard | None = None):
        """guard: keeps prefetch (the predictor's guesses) on only while decode steps measure faster with it."""
        self.model = model
        self.load = load
        self.predictor = predictor
        self.offload = offload
        self.guard = guard if predictor is not None else None
        self._hook = model.register_forward_pre_hook(self._begin_step)

    def _begin_step(self, module, args) -> None:
        """The model's forward pre-hook (eager steps): both halves below, and the prefetch guard's choice."""
        if self.load is not None:
            self.load.update()                 # folds the previous step's routed slots into the window
        if self.offload is not None:
            self.offload.begin_step()
        if self.guard is not None:             # model(input_ids, positions, kv_cache, meta)
            meta = args[3] if len(args) > 3 else None
            key = meta.num_seqs if getattr(meta, "is_decode", False) else None
            self.predictor.paused = not self.guard.begin(key)

    # -- CUDA-graph decode steps (engine/cuda_graphs.py): the pre-hook in its host and device halves --------
    @property
    def graph_pre_hook(self):
        """The pre-hook a graph step does not run as such: it runs the two halves below instead."""
        return self._begin_step

    def begin_graph_step(self) -> None:
        """Host half, before each replay: the load window's step count, the offload's leftover predictions."""
        if self.load is not None:
            self.load.steps += 1
        if self.offload is not None:
            self.offload.begin_step()

    def graph_step_device(self, live: torch.Tensor | None = None) -> None:
        """Device half, captured at the start of the step's graph: the load window's fold (no launch outside)."""
        if self.load is not None:
            self.load.fold(live)

    def stats(self) -> dict:
        """Load, prediction recall and expert-cache counters (reads device counters: not in a step)."""
        top_k = getattr(getattr(self.model, "arch", None), "top_k", 2)
        return {
            "expert_load": self.load.snapshot(top_k) if self.load is not None else None,
            "prediction": self.predictor.recall() if self.predictor is not None else None,
            "offload": self.offload.stats() if self.offload is not None else None,
            "prefetch_guard": self.guard.stats() if self.guard is not None else None,
        }

    def reset(self) -> None:
        if self.predictor is not None:
            self.predictor.reset()
        if self.offload is not None:
            self.offload.reset_stats()

    def remove_hooks(self) -> None:
        self._hook.remove()
        if self.predictor is not None:
            self.predictor.remove()
        if self.offload is not None:
            self.offload.close()


def install_routing(model: torch.nn.Module, config: OffloadConfig, device: torch.device | str | None = None,
                    predictor_source: str = DEFAULT_PREDICTOR_SOURCE) -> RoutingRuntime:
    """Attach the load tracker, and the predictor / offloading that `config` asks for, to `model`.

    With offloading the routed experts move to host memory (pinned when CUDA is available), their
    device slots are allocated on `device` and the rest of the model is moved there (so the model
    may be loaded on the CPU first). Without offloading the model is left where it is.
    """
    device = torch.device(device) if device is not None else None
    has_moe = hasattr(model, "layers") and bool(moe_layer_ids(model))
    if (config.cpu_offload_experts or config.track_prediction) and not has_moe:
        raise ConfigError("cpu_offload_experts / track_prediction need a model with routed MoE layers")
    predictor = offload = guard = None
    if config.cpu_offload_experts:
        arch = model.arch
        first = model.layers[moe_layer_ids(model)[0]].mlp.experts
        host_format = "fp8" if getattr(first, "quantized", False) else config.host_format   # FP8 models stay FP8
        slots = resolve_cache_slots(config.expert_cache_size, arch.num_experts,
                                    expert_bytes(arch, model.dtype, host_format), len(moe_layer_ids(model)))
        threshold = config.prefetch_threshold if config.prefetches else None
        offload = ExpertOffload(model, slots, config.eviction, predictor=None, device=device or model.device,
                                host_format=config.host_format, prefetch_threshold=threshold,
                                staging_slots=config.staging_slots, staging=config.staging,
                                prefetch_gate=config.prefetch_gate,
                                cpu_compute_fraction=config.cpu_compute_fraction)
    if offload is not None and device is not None:
        model.to(device)                       # non-expert weights; host expert copies are not module state
    if config.predicts:
        predictor = ExpertPredictor(model, config.lookahead, config.extra_candidates, source=predictor_source)
        if offload is not None and config.prefetches:
            offload.attach_predictor(predictor)
            guard = PrefetchGuard() if config.prefetch_guard else None
    expert_load = getattr(model, "expert_load", None)
    load = ExpertLoadTracker(expert_load, config.load_decay) if isinstance(expert_load, torch.Tensor) else None
    return RoutingRuntime(model, load, predictor, offload, guard)
