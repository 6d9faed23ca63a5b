"""benchmarks/hf_cache_report.py (bench_hf_cache.py's report): the per-width targets against every peer and the Pareto
rows (no model)."""

from __future__ import annotations

from benchmarks import hf_cache_report


def _row(name, family, bits, lowbit, ppl, kl):
    return {"name": name, "family": family, "bits": bits, "bits_per_value_lowbit": lowbit,
            "bits_per_value_all_in": (lowbit or 15) + 1, "perplexity": ppl, "mean_kl": kl}


def test_targets_compare_each_width_with_every_peer():
    rows = [_row("DynamicCache (reference)", "dynamic", 16, None, 48.7, 0.0),
            _row("quanto int2 matched", "quanto", 2, 2.5, 49.19, 0.0144),
            _row("HQQ 2-bit matched", "hqq", 2, 2.5, 53.3, 0.0756),
            _row("HQQ 3-bit matched", "hqq", 3, 3.70, 49.3, 0.0062),
            _row("moekv int2", "moekv", 2, 2.49, 49.10, 0.0150),
            _row("moekv int3", "moekv", 3, 3.49, 49.0, 0.0028),
            {"name": "quanto int4 default", "family": "quanto", "bits": 4, "grouping": "", "skipped": "no quanto"}]
    checks = {(c["ours"], c["theirs"]): c["status"] for c in hf_cache_report.check_targets(rows)}
    assert checks == {("moekv int2", "quanto int2 matched"): "missed",      # lower ppl, higher KL
                      ("moekv int2", "HQQ 2-bit matched"): "met",
                      ("moekv int3", "HQQ 3-bit matched"): "met",
                      ("moekv int4", "quanto int4 default"): "not measured"}
    measured, front = hf_cache_report.pareto_rows(rows)
    assert [r["name"] for r, on in zip(measured, front) if on] == ["quanto int2 matched", "moekv int2", "moekv int3"]


def test_only_takes_substrings_and_exact_names():
    from benchmarks.bench_hf_cache import selected
    only = ["quanto", "=moekv int3"]
    assert selected("quanto int2 matched", only)
    assert selected("moekv int3", only) and selected("MoeKV Int3", only)
    assert not selected("moekv int3 values min/max", only)     # '=' is the whole name, not a prefix
    assert not selected("HQQ 3-bit matched", only)
    assert selected("moekv int3 values min/max", ["int3"])
