"""Low-bit KV pages in Triton: the general attention kernel (prefill, mixed steps, and decode for formats the CUDA
decode kernel of ops/cuda does not take) with its code unpacking, the page quantizer and the decode-step staging
write, chosen by ops.dispatch."""
