"""Per-layer ops outside attention and experts: RMSNorm (+ residual add), rotary, routing top-k, and
the opt-in skinny GEMM for decode-size projections."""
