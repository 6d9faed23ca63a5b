#!/bin/bash
# Issues 17 / 19 (B=64 decode): the skinny GEMM's BLOCK_M 32 / 64 against cuBLAS on Mixtral's qkv / o at 32 and 64 rows,
# with a launch sweep (~3 min); then, if a config beats cuBLAS, the B=64 decode row with MOEKV_SKINNY_GEMM=64 (a second
# call: bench_decode --scenarios 64x16384:int3 with and without it).
export PYTHONUNBUFFERED=1 MOEKV_COMMIT=$(cat ab/main_commit)
mkdir -p $OUT/g
PYTHONPATH=src:. timeout 240 python3 -u benchmarks/bench_gemv.py --rows 16,32,64 --shapes qkv,o --sweep --out $OUT/g 2>&1 | tail -30
cd $OUT && tar czf g.tgz g && rm -rf g
