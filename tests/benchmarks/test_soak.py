"""The short form of benchmarks/soak.py (issue 20) on the bundled model: 4 small waves of streams with a
quarter cancelled and malformed requests mixed in, SIGTERM during the last; the soak contract must hold
(no 5xx, OpenAI error shapes, every finished stream ends with [DONE], KV and running requests back to 0,
/health up until the SIGTERM, exit status 0, RSS flat between waves 1 and 2)."""

from __future__ import annotations

from benchmarks import soak
from tests.entrypoints.openai.helpers import free_port
from tests.helpers import needs_bundled_model


@needs_bundled_model
def test_short_soak_holds_the_contract(tmp_path):
    args = soak.parse_args(["--waves", "4", "--concurrency", "16", "--max-tokens", "8", "--fuzzed", "12",
                            "--baseline-wave", "1", "--max-rss-growth", "0.10", "--port", str(free_port()),
                            "--shutdown-timeout", "0.5", "--server-log", str(tmp_path / "server.log")])
    report = soak.run(args)
    assert report["problems"] == [], "\n".join(report["problems"][:10])
    totals = report["totals"]["outcomes"]
    assert totals["completed"] + totals["cancelled"] >= 3 * 16 * 0.9   # the first three waves ran
    assert totals["malformed_answered"] >= 3 * (len(soak.BAD_REQUESTS) + 12)
    statuses = report["totals"]["statuses"]
    assert not any(int(status) >= 500 and status != "503" for status in statuses), statuses
    assert all(w["idle"] == {"running": 0.0, "waiting": 0.0, "kv_cache_usage_perc": 0.0}
               for w in report["waves"][:-1])
    assert report["exit_status"] == 0 and report["server_log"]["tracebacks"] == 0
    rss = report["rss_growth"]
    assert (rss["from_wave"], rss["to_wave"]) == (1, 2) and rss["growth"] < 0.10
