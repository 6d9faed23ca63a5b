#!/bin/bash
# Issue 24 (session 30's run6): the prefetch guard's rows and the CPU-split rows, Mixtral-8x7B shape, 8 layers,
# batch 1 (21 GiB pinned; ~3 min). Results: offload-speed-h200-guard-split (rename the files from $OUT/o).
export PYTHONUNBUFFERED=1 MOEKV_COMMIT=$(cat ab/main_commit)
mkdir -p $OUT/o
PYTHONPATH=src:. timeout 280 python3 -u benchmarks/bench_offload.py speed --device cuda --num-layers 8 \
  --modes on-demand,prefetch,staged,prefetch-guard,staged-guard,cpu-split-25,cpu-split-50 --out $OUT/o 2>&1 | tail -40
cd $OUT && tar czf o.tgz o && rm -rf o
