"""Expert parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU), launched by torchrun.

    groups.py          process groups from torchrun's environment (device group + gloo control group)
    placement.py       ExpertPlacement: expert -> rank slots per MoE layer, uneven counts, replicas
    balancer.py        EPLB-style placement from recorded load: replicate hot experts, pack replicas
    expert_parallel.py ExpertParallelExperts (the `Experts` seam) and the per-rank runtime
    exchange.py        token dispatch / combine: all-to-all or all-gather + reduce-scatter, one interface
    sharding.py        shard a built model's experts, random local-only models, rebalance (weight moves)
    lockstep.py        LockstepEngine: data-parallel attention, all ranks step together

Entry points: entrypoints/ep_runner.py (offline API, `moekv generate`) and entrypoints/ep_serve.py
(rank-side machinery for `moekv serve`). See docs/expert-parallel.md.
"""
