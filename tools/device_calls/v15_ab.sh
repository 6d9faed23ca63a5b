#!/bin/bash
# Issue 17, v15 (branch v15: the work split, docs/attention-kernels.md item 7): A/B against main's kernel
# (971fca4's csrc = main's), the launch-config sweep, then v15's v7 GPU tests (~4 min). Prepared here:
#   mkdir -p ab/v15 && git archive v15 src tests benchmarks tools pyproject.toml | tar -x -C ab/v15
#   python3 tools/ab_baseline.py 971fca4 ab/M        # and name `ab` in the run's carry
export MOEKV_COMMIT=73a8fac PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
cd ab/v15
mkdir -p $OUT/ab $OUT/ws
PYTHONPATH=src:. timeout 200 python3 -u benchmarks/ab_decode_kernel.py --a-dir ../M --a-name main --b-name "v15 work split" --b-kwargs '{"work_split": true}' --shapes '32x16384:3;8x32768:3' --tag s31-v15 --out $OUT/ab 2>&1 | tee $OUT/ab/log.txt | tail -40
PYTHONPATH=src:. timeout 110 python3 -u benchmarks/bench_attention.py --lowbit-only --shapes 32x16384,8x32768,1x16384 --bits 3 --impls v7 --lowbit-configs '{"v7": [{"chunk_split": false}, {"chunk_split": true}, {"chunk_split": true, "work_split": true}, {"chunk_split": true, "work_split": 4}, {"chunk_split": true, "work_split": 24}]}' --out $OUT/ws 2>&1 | tee $OUT/ws/log.txt | tail -40
mkdir -p $OUT/t
MOEKV_COMMIT=73a8fac PYTHONPATH=src:. timeout 170 python3 -m pytest -q -x tests/ops/test_lowbit_decode_v7.py > $OUT/t/v15-v7.log 2>&1; echo "v15 tests rc=$?" >> $OUT/t/v15-v7.log; tail -3 $OUT/t/v15-v7.log
cd $OUT && tar czf r1.tgz ab ws t && rm -rf ab ws t
