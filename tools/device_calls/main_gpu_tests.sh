#!/bin/bash
# main's GPU tests (v7 kernel with the staging blocks: never GPU-run; kv cache; one-program align)
export PYTHONUNBUFFERED=1 MOEKV_COMMIT=$(cat ab/main_commit)   # git rev-parse --short HEAD > ab/main_commit here
mkdir -p $OUT/t
PYTHONPATH=src:. python3 -c "import torch; from moekv.ops.cuda import lowbit_decode as v; v.module(torch.device('cuda'))" > $OUT/t/build.log 2>&1 &
PYTHONPATH=src:. timeout 100 python3 -m pytest -q tests/ops/test_moe_kernels.py > $OUT/t/moe.log 2>&1; echo "moe rc=$?" >> $OUT/t/moe.log
wait
PYTHONPATH=src:. timeout 200 python3 -m pytest -q tests/ops/test_lowbit_decode_v7.py > $OUT/t/main-v7.log 2>&1; echo "v7 rc=$?" >> $OUT/t/main-v7.log
PYTHONPATH=src:. timeout 150 python3 -m pytest -q tests/kvcache tests/engine/test_staging_blocks.py > $OUT/t/main-kv.log 2>&1; echo "kv rc=$?" >> $OUT/t/main-kv.log
tail -3 $OUT/t/*.log
cd $OUT && tar czf r2.tgz t && rm -rf t
