"""The benchmarks: `bench_*.py` scripts, each printing a table and writing JSON + markdown to results/.

Run them from the repository root with the source and the root on the path, as scripts or as modules:

    PYTHONPATH=src:. python benchmarks/bench_attention.py --dry
    PYTHONPATH=src:. python -m benchmarks.bench_attention --dry

They import each other as `benchmarks.<name>` (timing.py, synthetic_kv.py, bench_moe.py) and the shared
case builders as `moekv.testing` (never the test suite); no script edits the import path.
"""
