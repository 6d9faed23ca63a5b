#!/bin/bash
# Issue 19 (session 28's item 2): programmatic dependent launch (KernelConfig.pdl, off by default). GPU tests first,
# then B=1 16k decode rows with PDL off / on, bf16 and FP8 weights (~4 min). Default on only if every row is faster
# or equal and the tests pass.
export PYTHONUNBUFFERED=1 MOEKV_COMMIT=$(cat ab/main_commit)
mkdir -p $OUT/p
PYTHONPATH=src:. timeout 120 python3 -m pytest -q tests/ops/test_pdl.py > $OUT/p/tests.log 2>&1; echo "pdl tests rc=$?" >> $OUT/p/tests.log; tail -3 $OUT/p/tests.log
PYTHONPATH=src:. timeout 230 python3 -u benchmarks/bench_decode.py --scenarios "1x16384:bf16,int3" --synthetic-kv --no-hf \
  --moe-tokens "" --pdl off,on --quantization none,fp8 --steps 96 --tag pdl --out $OUT/p 2>&1 | tail -30
cd $OUT && tar czf p.tgz p && rm -rf p
