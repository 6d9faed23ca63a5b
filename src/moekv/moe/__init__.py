"""What plugs into the MoE block's `experts` seam from outside, after the model is built.

A MoE block routes (layers.router), then hands (hidden, topk_ids, topk_weights) to its `experts`
module. The seam and its on-device implementation live with the layers (`layers.experts.Experts`,
`LocalExperts`: ops.dispatch.moe_experts, reference or Triton); this package holds what replaces
or watches `block.experts` from outside: expert offloading with prefetch (prefetch/) and expert load
statistics (load_stats.py). Expert parallelism across ranks plugs in the same way (distributed/).
So model code stays single-device, and `moe` imports `layers`, never the other way round.
"""
