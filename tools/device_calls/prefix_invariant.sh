#!/bin/bash
# Issue 21 (runbook row 8b): greedy identity with prefix caching on / off in bf16 needs the batch-invariant mode on the
# GPU. Its kernel tests compiled first, then the agentic workload with the mode (the summary's "identical" must be
# yes), then the concurrent one (~4 min together; the 32-turn / 64-request rows of the target: a second call).
export PYTHONUNBUFFERED=1 MOEKV_COMMIT=$(cat ab/main_commit)
mkdir -p $OUT/i
PYTHONPATH=src:. timeout 120 python3 -m pytest -q -x tests/ops/test_batch_invariant.py tests/engine/test_batch_invariant.py \
  > $OUT/i/tests.log 2>&1; echo "invariant tests rc=$?" >> $OUT/i/tests.log; tail -3 $OUT/i/tests.log
PYTHONPATH=src:. timeout 200 python3 -u benchmarks/bench_prefix_cache.py --model mixtral-8x7b --prefix 4096 --turns 32 \
  --user 32 --answer 16 --concurrency 64 --kv-cache-dtype bf16 --batch-invariant --tag prefix-cache-h200-invariant \
  --out $OUT/i 2>&1 | tail -20
cd $OUT && tar czf i.tgz i && rm -rf i
