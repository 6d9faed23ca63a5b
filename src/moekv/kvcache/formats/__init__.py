"""KV page formats: full_precision (bf16/fp16/fp32) and lowbit (int4/int3/int2 + sparse outliers)."""
