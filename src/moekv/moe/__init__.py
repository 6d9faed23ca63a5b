"""Where routed experts run: the `Experts` seam of the MoE block.

A MoE block routes (layers.router), then hands (hidden, topk_ids, topk_weights) to its `experts`
module. `LocalExperts` computes them on this device (ops.dispatch.moe_experts: reference or
Triton); other implementations plug in by replacing `block.experts` after the model is built
(expert offloading with prefetch, expert parallelism across ranks), so model code stays
single-device.
"""
