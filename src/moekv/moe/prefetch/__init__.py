"""Speculative expert routing and expert offloading.

    predictor.py  ExpertPredictor: at layer l, the next layers' routers applied to the current hidden
                  state guess their experts; recall counted on the device
    residency.py  ExpertCache: slot bookkeeping of one layer's device expert cache (LRU / LFU,
                  predicted experts protected for the step)
    pool.py       HostExperts (host copies, 16-bit or FP8) and SlotPool (the device slots of all layers)
    offload.py    OffloadedExperts (the Experts seam with host copies + pool slots, one host read of
                  routing per layer), SlotCopier (side CUDA stream + events; plain copies on the CPU)
    policy.py     the staged prefetch policy: margin calibration, threshold, staging slots (Stager)
    staged.py     StagedPrefetch: the policy driving chunked guess copies at each decision point
    gate.py       GuessGate: per-layer guess budgets learned from measured copy windows and chunk costs
    timeline.py   simulate_decode: the copy / compute timeline simulator (on-demand, prefetch, staged)
    device_staging.py  DeviceStagedExperts: slot table and copies on the device, no host reads
    compute.py    SlotExpertCompute: expert compute over pool slots, bit-identical to LocalExperts
    cpu_split.py  CpuSplit: a decode miss split between the CPU (from the host copy, on a worker thread) and a
                  partial copy computed on the device (cpu_compute_fraction; its reference twin)
    manager.py    ExpertOffload: installs offloaded experts in every MoE block, turns predictions
                  into prefetches, cache-size resolution
    guard.py      PrefetchGuard: prefetch kept on only while decode steps measure faster with it (per batch size)
    runtime.py    install_routing(model, OffloadConfig): the one call the engine makes; its per-step hook
    trace.py      routing traces of a trained model, replayed in another (benchmarks, tests)
See docs/expert-offload.md.
"""

from moekv.moe.prefetch.manager import ExpertOffload, resolve_cache_slots
from moekv.moe.prefetch.offload import OffloadedExperts
from moekv.moe.prefetch.predictor import ExpertPredictor, recall_counts
from moekv.moe.prefetch.residency import ExpertCache
from moekv.moe.prefetch.runtime import RoutingRuntime, install_routing

__all__ = ["ExpertCache", "ExpertOffload", "ExpertPredictor", "OffloadedExperts", "RoutingRuntime",
           "install_routing", "recall_counts", "resolve_cache_slots"]
