#!/bin/bash
# Issue 19 (session 30's run7): the W8A8 GPU tests, then the MoE layer for both shapes, FP8 and bf16, 16 .. 1024
# tokens, rows moekv / moekv-grouped / moekv-grouped-w8a8 (~3 min). If W8A8 is faster from N tokens on:
# KernelConfig.w8a8_min_tokens = N after B=64 FP8 decode rows off / on.
export PYTHONUNBUFFERED=1 MOEKV_COMMIT=$(cat ab/main_commit)
mkdir -p $OUT/w
PYTHONPATH=src:. timeout 100 python3 -m pytest -q tests/ops/test_moe_w8a8.py > $OUT/w/tests.log 2>&1; tail -3 $OUT/w/tests.log
PYTHONPATH=src:. timeout 200 python3 -u benchmarks/bench_moe.py --model mixtral-8x7b,qwen3-30b-a3b --quantization none,fp8 \
  --tokens 16,64,128,256,1024 --impl moekv,moekv-grouped,moekv-grouped-w8a8 --out $OUT/w 2>&1 | tail -30
cd $OUT && tar czf w.tgz w && rm -rf w
