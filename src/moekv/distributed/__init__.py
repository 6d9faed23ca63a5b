"""Expert parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU), launched by torchrun.

    groups.py          process groups from torchrun's environment (device group + gloo control group)
    placement.py       ExpertPlacement: expert -> rank slots per MoE layer, uneven counts, replicas
    balancer.py        EPLB-style placement from recorded load: replicate hot experts, pack replicas
    expert_parallel.py ExpertParallelExperts (the `Experts` seam) and the per-rank runtime
    exchange.py        token dispatch / combine: all-to-all or all-gather + reduce-scatter, one interface
    sharding.py        shard a built model's experts, random local-only models, rebalance (weight moves)

Communication only: the engines that use it (LockstepEngine, LeaderEngine) and the factory that builds
them are in engine/ (engine/lockstep.py, engine/leader.py, engine/factory.py). See docs/expert-parallel.md.
"""
