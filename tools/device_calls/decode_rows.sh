#!/bin/bash
# Issue 17 / 23 / 19 decode rows (Mixtral-8x7B shape, synthetic KV): B=1 16k bf16 + int3, B=64 16k int3, whole staging
# pages, then the int3 rows with 32-token staging blocks + the lazy partial page (the bits target). ~4 min.
export PYTHONUNBUFFERED=1 MOEKV_COMMIT=$(cat ab/main_commit)
mkdir -p $OUT/d $OUT/b
PYTHONPATH=src:. timeout 230 python3 -u benchmarks/bench_decode.py --scenarios "1x16384:bf16,int3;64x16384:int3" \
  --synthetic-kv --no-hf --moe-tokens "" --steps 64 --tag s31 --out $OUT/d 2>&1 | tail -25
PYTHONPATH=src:. timeout 170 python3 -u benchmarks/bench_decode.py --scenarios "64x16384:int3" \
  --synthetic-kv --no-hf --moe-tokens "" --steps 64 --staging-block 32 --lazy-partial-page --tag s31-blocks \
  --out $OUT/b 2>&1 | tail -25
cd $OUT && tar czf d.tgz d b && rm -rf d b
