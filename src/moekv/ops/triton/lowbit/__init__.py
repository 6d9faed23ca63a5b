"""Low-bit KV pages: the general attention kernel (prefill and fallback) with its code unpacking, the
page quantizer, the decode-step staging write, and the decode-only kernels (decode_tc, decode_tm with
decode_fix; decode_common holds what they share), chosen by ops.dispatch."""
