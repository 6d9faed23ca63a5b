"""Soak run of `moekv serve` (issue 20): waves of concurrent streams, a share cancelled, malformed requests
mixed in, /health polled throughout, optionally SIGTERM during the last wave; RSS and KV usage per wave.

    PYTHONPATH=src:. python benchmarks/soak.py --waves 20 --concurrency 128 \\
        --json benchmarks/results/soak-cpu-tiny-shakespeare-moe.json

It starts the server itself (`python -m moekv serve`, the bundled model unless --model) and reports, per
wave: requests by outcome, errors by class, server RSS after the wave, and whether running requests and
KV usage came back to 0. `check(report)` lists what breaks the contract: a 5xx (other than a stream ended
`aborted` by the SIGTERM), a malformed request not answered in OpenAI's error shape, a completed stream
without `data: [DONE]`, KV or running requests not back to 0, /health failing before the SIGTERM, the
exit status, and RSS growing more than --max-rss-growth between wave --baseline-wave and the last wave.
A benchmark asserts nothing itself: the exit status is 1 when `check` found anything.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from moekv.metrics import parse_metrics
from moekv.testing.bad_requests import BAD_REQUESTS, error_shape_problem, fuzzed_requests

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Wave:
    index: int
    seconds: float = 0.0
    outcomes: Counter = field(default_factory=Counter)   # completed / cancelled / aborted_by_sigterm / ...
    statuses: Counter = field(default_factory=Counter)   # HTTP status -> count (malformed and streams)
    problems: list[str] = field(default_factory=list)
    rss_mb: float | None = None
    idle: dict | None = None                             # running / waiting / kv usage after the wave


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def stream_one(http: httpx.AsyncClient, url: str, rng: random.Random, args, wave: Wave,
                     first_chunk: asyncio.Event, stopping: asyncio.Event) -> None:
    body = {"prompt": "ROMEO:\n" + "O, " * rng.randint(0, 20), "max_tokens": args.max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.8, "seed": rng.randrange(1 << 30)}
    cancel_after = rng.randint(1, max(1, args.max_tokens - 1)) if rng.random() < args.cancel_fraction else None
    chunks, text = 0, ""
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            wave.statuses[response.status_code] += 1
            if response.status_code != 200:
                wave.outcomes["failed"] += 1
                wave.problems.append(f"stream status {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for piece in response.aiter_text():
                text += piece
                chunks = text.count("data: {")
                if chunks:
                    first_chunk.set()
                if cancel_after is not None and chunks >= cancel_after:
                    wave.outcomes["cancelled"] += 1
                    return
    except httpx.HTTPError as exc:
        if stopping.is_set() and not text:   # it never got in: the server had stopped accepting
            wave.outcomes["refused_after_sigterm"] += 1
            return
        wave.outcomes["transport_error"] += 1
        wave.problems.append(f"stream: {type(exc).__name__}: {exc}")
        return
    if not text.endswith("data: [DONE]\n\n"):
        wave.outcomes["no_done"] += 1
        wave.problems.append(f"stream without [DONE]: ...{text[-200:]!r}")
    elif '"code":"aborted"' in text:
        wave.outcomes["aborted_by_sigterm"] += 1
    elif '{"error"' in text:
        wave.outcomes["stream_error"] += 1
        wave.problems.append(f"stream error event: {text[-300:]!r}")
    else:
        wave.outcomes["completed"] += 1


async def malformed_one(http: httpx.AsyncClient, url: str, path: str, raw: bytes, wave: Wave,
                        stopping: asyncio.Event) -> None:
    try:
        response = await http.post(url + path, content=raw, headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        if stopping.is_set():
            wave.outcomes["refused_after_sigterm"] += 1
        else:
            wave.outcomes["transport_error"] += 1
            wave.problems.append(f"malformed request: {type(exc).__name__}: {exc}")
        return
    wave.statuses[response.status_code] += 1
    wave.outcomes["malformed_answered"] += 1
    if response.status_code >= 500 and not (stopping.is_set() and response.status_code == 503):
        wave.problems.append(f"{response.status_code} for {raw[:100]!r}: {response.text[:200]}")
    elif response.status_code >= 400 and (problem := error_shape_problem(response.status_code, response.content)):
        wave.problems.append(problem)


async def wait_idle(http: httpx.AsyncClient, url: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        values = parse_metrics((await http.get(url + "/metrics")).text)
        idle = {"running": values.get("moekv:num_requests_running"),
                "waiting": values.get("moekv:num_requests_waiting"),
                "kv_cache_usage_perc": values.get("moekv:kv_cache_usage_perc")}
        if all(v == 0 for v in idle.values()) or time.monotonic() > deadline:
            return idle
        await asyncio.sleep(0.1)


async def run_wave(index: int, args, url: str, proc: subprocess.Popen, health: list, sigterm: bool) -> Wave:
    wave = Wave(index)
    rng = random.Random(args.seed * 1000 + index)
    malformed = [(p, b.encode()) for p, b, _, _ in BAD_REQUESTS] + fuzzed_requests(args.seed + index, args.fuzzed)
    rng.shuffle(malformed)
    first_chunk, stopping = asyncio.Event(), asyncio.Event()
    limits = httpx.Limits(max_connections=args.concurrency + 32, max_keepalive_connections=args.concurrency + 32)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        tasks = [asyncio.create_task(stream_one(http, url, rng, args, wave, first_chunk, stopping))
                 for _ in range(args.concurrency)]
        for path, raw in malformed:
            tasks.append(asyncio.create_task(malformed_one(http, url, path, raw, wave, stopping)))
            await asyncio.sleep(0.005)
        if sigterm:
            await first_chunk.wait()
            await asyncio.sleep(0.5)
            stopping.set()
            health.append(("sigterm", time.monotonic()))
            proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)
        wave.seconds = time.monotonic() - started
        if not sigterm:
            wave.idle = await wait_idle(http, url)
            await asyncio.sleep(0.5)
            wave.rss_mb = rss_mb(proc.pid)
            if any(v != 0 for v in wave.idle.values()):
                wave.problems.append(f"not idle after the wave: {wave.idle}")
    return wave


async def poll_health(url: str, health: list, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            try:
                status = (await http.get(url + "/health")).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            health.append((status, time.monotonic()))
            await asyncio.sleep(0.5)


async def soak(args, url: str, proc: subprocess.Popen) -> tuple[list[Wave], list]:
    health: list = []
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_health(url, health, stop))
    waves = []
    for index in range(args.waves):
        wave = await run_wave(index, args, url, proc, health, sigterm=args.sigterm and index == args.waves - 1)
        waves.append(wave)
        print(f"wave {index}: {wave.seconds:.1f} s, rss {wave.rss_mb or float('nan'):.0f} MB, "
              f"{dict(wave.outcomes)}, statuses {dict(wave.statuses)}, problems {len(wave.problems)}", flush=True)
    stop.set()
    await poller
    return waves, health


def check(report: dict) -> list[str]:
    """Everything that breaks the soak contract (empty: it held)."""
    problems = [f"wave {w['index']}: {p}" for w in report["waves"] for p in w["problems"]]
    sigterm_at = report.get("sigterm_at")
    bad_health = [h for h in report["health"] if h[0] != 200 and (sigterm_at is None or h[1] < sigterm_at)]
    if bad_health:
        problems.append(f"/health failed before the SIGTERM: {bad_health[:5]}")
    if report["exit_status"] != 0:
        problems.append(f"the server exited with {report['exit_status']}")
    rss = report["rss_growth"]
    if rss["growth"] is not None and rss["growth"] > report["config"]["max_rss_growth"]:
        problems.append(f"RSS grew {rss['growth']:.1%} from wave {rss['from_wave']} to wave {rss['to_wave']}")
    return problems


def machine() -> dict:
    model_name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                       if line.startswith("model name")), platform.processor())
    return {"cpu": model_name, "cores": os.cpu_count(), "gpu": None, "load_average": os.getloadavg(),
            "python": platform.python_version()}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    from moekv.paths import default_model_dir

    port = args.port
    command = [sys.executable, "-m", "moekv", "serve", "--model", str(args.model or default_model_dir()),
               "--port", str(port), "--num-pages", str(args.num_pages), "--max-num-seqs", str(args.max_num_seqs),
               "--shutdown-timeout", str(args.shutdown_timeout), *args.server_arg]
    log = open(log_path, "wb")
    proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the server did not become healthy; see {log_path}")


def run(args) -> dict:
    log_path = Path(args.server_log)
    proc, url = start_server(args, log_path)
    try:
        waves, health = asyncio.run(soak(args, url, proc))
    finally:
        if proc.poll() is None and not args.sigterm:
            proc.send_signal(signal.SIGTERM)
        try:
            exit_status = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_status = None
    sigterm_at = next((t for status, t in health if status == "sigterm"), None)
    measured = [w for w in waves if w.rss_mb is not None]
    base = next((w for w in measured if w.index == args.baseline_wave), measured[0] if measured else None)
    last = measured[-1] if measured else None
    growth = (last.rss_mb - base.rss_mb) / base.rss_mb if base and last and last.index > base.index else None
    server_log = log_path.read_text(errors="replace")
    totals, statuses = Counter(), Counter()
    for w in waves:
        totals.update(w.outcomes)
        statuses.update(w.statuses)
    report = {
        "benchmark": "soak", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(), "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": machine(), "config": {k: v for k, v in vars(args).items()},
        "waves": [{**asdict(w), "outcomes": dict(w.outcomes), "statuses": {str(k): v for k, v in w.statuses.items()}}
                  for w in waves],
        "totals": {"outcomes": dict(totals), "statuses": {str(k): v for k, v in sorted(statuses.items())},
                   "requests": sum(statuses.values()) + totals["refused_after_sigterm"] + totals["transport_error"]},
        "rss_growth": {"from_wave": base.index if base else None, "to_wave": last.index if last else None,
                       "from_mb": base.rss_mb if base else None, "to_mb": last.rss_mb if last else None,
                       "growth": growth},
        "health": [(status, t) for status, t in health if status != "sigterm"], "sigterm_at": sigterm_at,
        "exit_status": exit_status,
        "server_log": {"aborted_lines": server_log.count("ended unfinished (abort)"),
                       "tracebacks": server_log.count("Traceback")},
    }
    if report["server_log"]["tracebacks"]:
        report["waves"][-1]["problems"].append(f"{report['server_log']['tracebacks']} traceback(s) in the log")
    report["problems"] = check(report)
    return report


def markdown(report: dict) -> str:
    config, rss = report["config"], report["rss_growth"]
    lines = [f"# Soak run: `moekv serve` under waves of load and malformed input ({report['date']})", "",
             f"Commit {report['commit']}; machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
             f"no GPU; load average at the end {', '.join(f'{x:.1f}' for x in report['machine']['load_average'])}.",
             "", "```bash", f"PYTHONPATH=src:. python {report['command']}", "```", "",
             f"{config['waves']} waves of {config['concurrency']} concurrent streams ({config['max_tokens']} tokens, "
             f"{config['cancel_fraction']:.0%} cancelled mid-stream) plus {len(BAD_REQUESTS)} issue-20 cases and "
             f"{config['fuzzed']} fuzzed malformed requests per wave"
             + ("; SIGTERM during the last wave." if config["sigterm"] else "."), "",
             "| wave | seconds | completed | cancelled | aborted by SIGTERM | malformed answered | statuses | "
             "RSS MB | running / waiting / KV after | problems |", "|" + " --- |" * 10]
    for w in report["waves"]:
        o, idle = w["outcomes"], w["idle"] or {}
        lines.append(f"| {w['index']} | {w['seconds']:.1f} | {o.get('completed', 0)} | {o.get('cancelled', 0)} | "
                     f"{o.get('aborted_by_sigterm', 0)} | {o.get('malformed_answered', 0)} | "
                     f"{' '.join(f'{k}:{v}' for k, v in sorted(w['statuses'].items()))} | "
                     f"{'-' if w['rss_mb'] is None else round(w['rss_mb'])} | "
                     f"{idle.get('running', '-')} / {idle.get('waiting', '-')} / {idle.get('kv_cache_usage_perc', '-')} | "
                     f"{len(w['problems'])} |")
    growth = "n/a" if rss["growth"] is None else f"{rss['growth']:+.2%}"
    mb = {k: "-" if rss[k] is None else f"{rss[k]:.0f}" for k in ("from_mb", "to_mb")}
    lines += ["", f"RSS from wave {rss['from_wave']} to wave {rss['to_wave']}: {mb['from_mb']} -> {mb['to_mb']} MB "
              f"({growth}; limit {config['max_rss_growth']:.0%}). Requests: {report['totals']['requests']}, "
              f"by status {report['totals']['statuses']}, outcomes {report['totals']['outcomes']}. "
              f"Server exit status {report['exit_status']}; log: {report['server_log']['aborted_lines']} "
              f"aborted-request lines, {report['server_log']['tracebacks']} tracebacks.", "",
              "Problems: " + ("none." if not report["problems"] else "; ".join(report["problems"][:20]))]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--waves", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cancel-fraction", type=float, default=0.25)
    parser.add_argument("--fuzzed", type=int, default=40, help="fuzzed malformed requests per wave")
    parser.add_argument("--num-pages", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--shutdown-timeout", type=float, default=1.0)
    parser.add_argument("--no-sigterm", dest="sigterm", action="store_false",
                        help="do not SIGTERM the server during the last wave")
    parser.add_argument("--baseline-wave", type=int, default=3, help="RSS growth is measured from this wave")
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-arg", action="append", default=[], help="one more `moekv serve` argument")
    parser.add_argument("--server-log", default="soak-server.log")
    parser.add_argument("--json", default=None, help="write the report here (and a .md next to it)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(markdown(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        path.with_suffix(".md").write_text(markdown(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
