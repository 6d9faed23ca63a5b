"""Building blocks of the MoE decoders: linear, norm, rotary, attention, router, MoE and dense MLP.

Each layer is single-device and format-agnostic: attention reaches the KV cache only through
`KVCache.attention`, and the expert compute goes through `moekv.ops.dispatch`.
"""
