"""CPU paths built on torch's fused CPU kernels, for ops whose reference twin is too slow to serve with."""
