#!/bin/bash
# Issue 19 (session 28's item 1 (i)): the bf16 decode kernel's launch sweep (BLOCK_N x warps x stages x splits x
# combine) at B=1 16k Hkv 8 / 4, B=1 2k, B=8 32k, B=64 16k, the graph path, next to the engine's launch and SDPA
# (~2.5 min). A winner goes into decode.default_config / FullPrecisionKVCache.graph_decode_splits, then bench_decode's
# B=1 bf16 row (7.787 ms against 7.0).
export PYTHONUNBUFFERED=1 MOEKV_COMMIT=$(cat ab/main_commit)
mkdir -p $OUT/fp
PYTHONPATH=src:. timeout 230 python3 -u benchmarks/sweep_fp_decode.py --out $OUT/fp 2>&1 | tail -40
cd $OUT && tar czf fp.tgz fp && rm -rf fp
