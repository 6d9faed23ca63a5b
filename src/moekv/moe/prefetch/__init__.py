"""Speculative expert routing and expert offloading.

    predictor.py  ExpertPredictor: at layer l, the next layers' routers applied to the current hidden
                  state guess their experts; recall counted on the device
    residency.py  ExpertCache: slot bookkeeping of one layer's device expert cache (LRU / LFU,
                  predicted experts protected for the step)
    offload.py    OffloadedExperts (the Experts seam with host weights + device slots), SlotCopier
                  (side CUDA stream + events; plain copies on the CPU)
    manager.py    ExpertOffload: installs OffloadedExperts in every MoE block, turns predictions
                  into prefetches, cache-size resolution
    runtime.py    install_routing(model, OffloadConfig): the one call the engine makes
See docs/expert-offload.md.
"""

from moekv.moe.prefetch.manager import ExpertOffload, resolve_cache_slots
from moekv.moe.prefetch.offload import OffloadedExperts
from moekv.moe.prefetch.predictor import ExpertPredictor, recall_counts
from moekv.moe.prefetch.residency import ExpertCache
from moekv.moe.prefetch.runtime import RoutingRuntime, install_routing

__all__ = ["ExpertCache", "ExpertOffload", "ExpertPredictor", "OffloadedExperts", "RoutingRuntime",
           "install_routing", "recall_counts", "resolve_cache_slots"]
