"""API benchmark: the recommendation endpoint against a bare-ASGI floor, closed and open loop, 10,000-100,000 models.

Usage:
    python bench/api.py [--models 10000 100000] [--connections 10 100] [--seconds 15] [--rounds 3] [--workers N]
                        [--open-loop-rps R] [--hey] [--json PATH]

For each ``--models`` count a fresh database (embedded PostgreSQL unless
PREWARM_BENCH_ADMIN_URL names a server) gets N models and one 60-minute
forecast run each (point and the forecast job's five levels, as the job
stores them). Two servers then run side by side on the same uvicorn (its
event loop and HTTP parser, ``--workers`` processes each):

* ``prewarm serve --no-scheduler`` (``PREWARM_API_WORKERS``), the system
  under test; every request asks a random model's recommendation with a read
  token;
* the floor, :mod:`asgi_floor`: one Starlette route with the same path that
  returns a fixed body of the same size, no auth, no work.

Load generators, in their own processes:

* closed loop: ``wrk -t1 -c C -d S --latency`` (Debian's C generator) with a
  Lua script that sets the Authorization header, picks a random model per
  request and reports percentiles; floor and prewarm alternate per
  connection count, ``--rounds`` pairs (default 3), so both see the same
  neighbours on the machine; the figures are the pairs' medians;
* open loop: :mod:`open_loop` (asyncio on uvloop, its own process) sends at a
  constant rate, by default the rate KEDA's metrics-api scaler sends (one
  request per model every 30 s: N / 30 per second), random models, latency
  counted from each request's due time; with ``--hey``, also ``hey -q`` on one
  model's URL as a cross-check (hey cannot vary the URL).

Everything shares this machine's cores; the load average before and after is
in the output. Figures per configuration (models x connections): ``floor_rps``,
``rps``, ``p50_ms``, ``p99_ms``, ``models``, ``connections``,
``open_loop_rps``, ``open_loop_p99_ms`` (the open-loop figures belong to the
models count), and the issue's targets checked against them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))

from bench.benchdb import fresh_database, on_bench_server  # noqa: E402
from forecaster.contracts.forecast import FORECAST_LEVELS, quantile_column  # noqa: E402
from forecaster.store.catalog import ServingModelSpec, upsert_models  # noqa: E402
from forecaster.store.db import make_engine  # noqa: E402
from forecaster.store.forecasts import write_forecast_arrays  # noqa: E402
from forecaster.store.tokens import create_token  # noqa: E402

#: The issue's targets: capacity >= 70% of the floor at 10,000 models; p99 at 100 connections below
#: max(20 ms, 1.5x the floor's p99); p99 < 20 ms at the KEDA rate of 100,000 models.
CAPACITY_SHARE = 0.70
P99_MS = 20.0
P99_VS_FLOOR = 1.5
#: KEDA's metrics-api scaler polls once per ScaledObject every 30 s by default.
KEDA_POLL_S = 30.0

WRK_SCRIPT = r"""
local models = tonumber(os.getenv("BENCH_MODELS"))
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_TOKEN")
math.randomseed(tonumber(os.getenv("BENCH_SEED") or "7"))
request = function()
  return wrk.format("GET", string.format("/v1/models/model-%06d/recommendation", math.random(0, models - 1)))
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('BENCH_JSON {"requests":%d,"duration_us":%d,"status_errors":%d,"connect_errors":%d,' ..
    '"read_errors":%d,"write_errors":%d,"timeouts":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_ids(n_models: int) -> list[str]:
    return [f"model-{i:06d}" for i in range(n_models)]


def prepare(admin_url: str, n_models: int, *, database: str = "bench_api") -> tuple[str, str]:
    """A fresh ``database`` with ``n_models`` models, one 60-minute run each, and a read token."""
    url = fresh_database(admin_url, database)
    engine = make_engine(url)
    rng = np.random.default_rng(7)
    ids = model_ids(n_models)
    with engine.begin() as conn:
        for start in range(0, n_models, 2000):
            upsert_models(conn, [ServingModelSpec(id=i, replica_rps=float(rng.uniform(0.5, 20)))
                                 for i in ids[start:start + 2000]])
    issued = datetime.now(timezone.utc).replace(microsecond=0)
    first_target = issued.replace(second=0)
    base = rng.gamma(1.0, 50.0, size=(n_models, 1))
    level = base * (1 + 0.2 * np.sin(np.arange(60)[None, :] / 9))
    spread = {0.1: 0.7, 0.5: 1.0, 0.9: 1.4, 0.95: 1.55, 0.99: 1.9}
    columns = {"point": level} | {quantile_column(q): level * spread[q] for q in FORECAST_LEVELS}
    write_forecast_arrays(engine, ids, first_target, columns, issued_at=issued, model_version_id=None)
    token = create_token(engine, name="bench", scopes=["read"])
    engine.dispose()
    return url, token


async def closed_loop(call, ids: list[str], concurrency: int, seconds: float, warmup_s: float
                      ) -> tuple[list[float], int]:
    """``concurrency`` workers calling ``await call(model_id)`` back to back; latencies after the warm-up."""
    latencies: list[float] = []
    errors = 0
    measure_from = time.perf_counter() + warmup_s
    stop_at = measure_from + seconds

    async def worker(seed: int) -> None:
        nonlocal errors
        rng = random.Random(seed)
        while True:
            started = time.perf_counter()
            if started >= stop_at:
                return
            ok = await call(rng.choice(ids))
            if started >= measure_from:
                if ok:
                    latencies.append(time.perf_counter() - started)
                else:
                    errors += 1

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return latencies, errors


async def drive(url: str, token: str, ids: list[str], clients: int, seconds: float,
                warmup_s: float) -> tuple[list[float], int]:
    """Closed-loop Python clients (httpx, in this process); bench/scale.py's quick latency probe."""
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=10) as client:
        async def recommendation(model_id: str) -> bool:
            return (await client.get(f"/v1/models/{model_id}/recommendation")).status_code == 200

        return await closed_loop(recommendation, ids, clients, seconds, warmup_s)


def _wait_until_answers(base: str, path: str, token: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode} before answering")
        try:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            if httpx.get(f"{base}{path}", headers=headers, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("server did not come up")
        time.sleep(0.5)


def stop_server(server: subprocess.Popen, *, timeout_s: float = 20.0) -> None:
    """Stop a server this bench started, by its PID: SIGTERM, wait, SIGKILL."""
    server.terminate()
    try:
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@contextlib.contextmanager
def _process(argv: list[str], env: dict, base: str, probe_path: str, token: str, timeout_s: float):
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait_until_answers(base, probe_path, token, server, timeout_s)
        yield base
    finally:
        stop_server(server)


@contextlib.contextmanager
def serving(url: str, token: str, probe_model: str, *, timeout_s: float = 120.0, workers: int | None = None):
    """``prewarm serve`` on a free port against ``url``; yields its base URL once a recommendation answers."""
    port = free_port()
    # the fleet's one run is written once, before the server starts: keep it served as fresh for the whole benchmark
    env = {**os.environ, "DATABASE_URL": url, "PREWARM_FORECAST_FRESH_S": "86400"}
    if workers is not None:
        env["PREWARM_API_WORKERS"] = str(workers)
    argv = [sys.executable, "-m", "forecaster.cli", "serve", "--port", str(port), "--no-scheduler"]
    with _process(argv, env, f"http://127.0.0.1:{port}", f"/v1/models/{probe_model}/recommendation", token,
                  timeout_s) as base:
        yield base


@contextlib.contextmanager
def floor_serving(workers: int, *, timeout_s: float = 60.0):
    """The bare-ASGI floor (:mod:`asgi_floor`) served as prewarm serves, with ``workers`` processes."""
    port = free_port()
    argv = [sys.executable, str(BENCH / "asgi_floor.py"), "--port", str(port), "--workers", str(workers)]
    with _process(argv, dict(os.environ), f"http://127.0.0.1:{port}", "/v1/models/model-000000/recommendation",
                  "", timeout_s) as base:
        yield base


def wrk(base: str, token: str, n_models: int, connections: int, seconds: float, script: Path) -> dict:
    """One closed-loop ``wrk -t1`` run; requests/s and latency percentiles (ms) from its Lua ``done``."""
    env = {**os.environ, "BENCH_MODELS": str(n_models), "BENCH_TOKEN": token}
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", "--timeout", "5s",
                          "-s", str(script), base], env=env, capture_output=True, text=True, timeout=seconds + 60,
                         check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH_JSON ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}")
    raw = json.loads(line[len("BENCH_JSON "):])
    errors = sum(raw[k] for k in ("status_errors", "connect_errors", "read_errors", "write_errors", "timeouts"))
    return {"rps": round(raw["requests"] / (raw["duration_us"] / 1e6), 1), "requests": raw["requests"],
            "errors": errors, "p50_ms": raw["p50_us"] / 1000, "p90_ms": raw["p90_us"] / 1000,
            "p99_ms": raw["p99_us"] / 1000, "max_ms": raw["max_us"] / 1000}


def open_loop(base: str, token: str, n_models: int, rate: float, seconds: float, connections: int) -> dict:
    port = int(base.rsplit(":", 1)[1])
    out = subprocess.run([sys.executable, str(BENCH / "open_loop.py"), "--port", str(port), "--token", token,
                          "--models", str(n_models), "--rate", f"{rate:g}", "--seconds", f"{seconds:g}",
                          "--connections", str(connections)],
                         capture_output=True, text=True, timeout=seconds + 60, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"open-loop client failed: {out.stderr[-1000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def hey(base: str, token: str, model_id: str, rate: float, seconds: float, connections: int) -> dict | None:
    """``hey -z S -c C -q rate/C`` on one model's URL (hey cannot vary it); None when hey is not installed."""
    if shutil.which("hey") is None:
        return None
    out = subprocess.run(["hey", "-z", f"{seconds:g}s", "-c", str(connections), "-q", f"{rate / connections:g}",
                          "-H", f"Authorization: Bearer {token}", f"{base}/v1/models/{model_id}/recommendation"],
                         capture_output=True, text=True, timeout=seconds + 60, check=False)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out.stdout)
    p50 = re.search(r"50%+ in ([\d.]+) secs", out.stdout)
    p99 = re.search(r"99%+ in ([\d.]+) secs", out.stdout)
    statuses = dict(re.findall(r"\[(\d{3})\]\s+(\d+) responses", out.stdout))
    if rps is None or p99 is None:
        raise RuntimeError(f"hey failed: {out.stdout[-500:]} {out.stderr[-500:]}")
    return {"rps": float(rps.group(1)), "p50_ms": float(p50.group(1)) * 1000 if p50 else None,
            "p99_ms": float(p99.group(1)) * 1000, "non_200": sum(int(n) for s, n in statuses.items() if s != "200")}


def run_models(admin_url: str, n_models: int, args, script: Path) -> list[dict]:
    started = time.monotonic()
    url, token = prepare(admin_url, n_models)
    seeded_s = time.monotonic() - started
    rate = args.open_loop_rps or n_models / KEDA_POLL_S
    ids = model_ids(n_models)
    rows = []
    with floor_serving(args.workers) as floor, serving(url, token, ids[0], timeout_s=300,
                                                        workers=args.workers) as served:
        ready_s = time.monotonic() - started - seeded_s
        for base in (floor, served):  # warm every worker's connections and caches
            wrk(base, token, n_models, max(args.connections), 3, script)
        for connections in args.connections:
            pairs = []  # floor then prewarm, --rounds times: each wrk run opens new connections, and the kernel
            for _ in range(args.rounds):  # deals them to the workers afresh, so one split never decides a figure
                pairs.append((wrk(floor, token, n_models, connections, args.seconds, script),
                              wrk(served, token, n_models, connections, args.seconds, script)))
            ratios = [served_fig["rps"] / floor_fig["rps"] for floor_fig, served_fig in pairs]
            for k, (floor_fig, served_fig) in enumerate(pairs):
                print(f"{n_models:,} models, {connections} connections, round {k + 1}/{len(pairs)}: floor "
                      f"{floor_fig['rps']:,.0f}/s p99 {floor_fig['p99_ms']:.1f} ms; recommendation "
                      f"{served_fig['rps']:,.0f}/s p50 {served_fig['p50_ms']:.2f} ms p99 {served_fig['p99_ms']:.1f} ms "
                      f"({ratios[k]:.2f}x floor), errors {served_fig['errors']}", flush=True)

            def median(key: str, which: int) -> float:
                return round(float(np.median([pair[which][key] for pair in pairs])), 3)

            rows.append({"models": n_models, "connections": connections, "workers": args.workers,
                         "rounds": len(pairs), "floor_rps": median("rps", 0), "floor_p50_ms": median("p50_ms", 0),
                         "floor_p99_ms": median("p99_ms", 0), "rps": median("rps", 1),
                         "p50_ms": median("p50_ms", 1), "p90_ms": median("p90_ms", 1),
                         "p99_ms": median("p99_ms", 1), "max_ms": max(pair[1]["max_ms"] for pair in pairs),
                         "errors": sum(pair[1]["errors"] for pair in pairs),
                         "floor_errors": sum(pair[0]["errors"] for pair in pairs),
                         "capacity_vs_floor": round(float(np.median(ratios)), 3),
                         "capacity_vs_floor_rounds": [round(r, 3) for r in ratios],
                         "p99_ms_rounds": [pair[1]["p99_ms"] for pair in pairs],
                         "floor_p99_ms_rounds": [pair[0]["p99_ms"] for pair in pairs]})
            row = rows[-1]
            print(f"{n_models:,} models, {connections} connections, median of {len(pairs)}: floor "
                  f"{row['floor_rps']:,.0f}/s p99 {row['floor_p99_ms']:.1f} ms; recommendation {row['rps']:,.0f}/s "
                  f"p99 {row['p99_ms']:.1f} ms ({row['capacity_vs_floor']:.2f}x floor)", flush=True)
        floor_open = open_loop(floor, token, n_models, rate, args.seconds, args.open_loop_connections)
        served_open = open_loop(served, token, n_models, rate, args.seconds, args.open_loop_connections)
        print(f"{n_models:,} models, open loop at {rate:,.0f}/s over {args.open_loop_connections} connections: "
              f"recommendation {served_open['rps']:,.0f}/s p50 {served_open['p50_ms']:.2f} ms "
              f"p99 {served_open['p99_ms']:.2f} ms, errors {served_open['errors']}; floor p99 "
              f"{floor_open['p99_ms']:.2f} ms", flush=True)
        hey_fig = hey(served, token, ids[0], rate, args.seconds, args.open_loop_connections) if args.hey else None
    for row in rows:
        row.update({"open_loop_target_rps": round(rate, 1), "open_loop_rps": served_open["rps"],
                    "open_loop_p50_ms": served_open["p50_ms"], "open_loop_p99_ms": served_open["p99_ms"],
                    "open_loop_max_ms": served_open["max_ms"], "open_loop_errors": served_open["errors"],
                    "open_loop_connections": args.open_loop_connections,
                    "floor_open_loop_p99_ms": floor_open["p99_ms"], "seed_s": round(seeded_s, 1),
                    "server_ready_s": round(ready_s, 1)})
        if hey_fig is not None:
            row.update({"hey_open_loop_rps": hey_fig["rps"], "hey_open_loop_p99_ms": hey_fig["p99_ms"],
                        "hey_non_200": hey_fig["non_200"]})
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """The issue's three targets, each with the figures it was judged on."""
    out = []
    for row in rows:
        if row["models"] == 10_000:
            out.append({"target": f"capacity >= {CAPACITY_SHARE:.0%} of the floor", "models": row["models"],
                        "connections": row["connections"], "value": row["capacity_vs_floor"],
                        "met": row["capacity_vs_floor"] >= CAPACITY_SHARE})
            if row["connections"] == 100:
                bound = max(P99_MS, P99_VS_FLOOR * row["floor_p99_ms"])
                out.append({"target": "p99 at 100 connections < max(20 ms, 1.5x floor p99)", "models": row["models"],
                            "bound_ms": round(bound, 2), "value": row["p99_ms"], "met": row["p99_ms"] < bound})
    for row in {r["models"]: r for r in rows}.values():
        if row["models"] == 100_000:
            out.append({"target": f"p99 < {P99_MS:g} ms at a constant {row['open_loop_target_rps']:,.0f}/s",
                        "models": row["models"], "value": row["open_loop_p99_ms"],
                        "achieved_rps": row["open_loop_rps"], "met": row["open_loop_p99_ms"] < P99_MS})
    return out


def run(admin_url: str, args) -> dict:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="prewarm-bench-wrk-") as tmp:
        script = Path(tmp) / "recommendation.lua"
        script.write_text(WRK_SCRIPT)
        rows = [row for n in args.models for row in run_models(admin_url, n, args, script)]
    return {"cpus": os.cpu_count(), "workers": args.workers, "seconds": args.seconds,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "closed_loop": "wrk -t1 --latency (Lua: random model per request)",
            "open_loop": "bench/open_loop.py (own process, uvloop; constant rate, latency from the due time)",
            "configurations": rows, "targets": targets(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--connections", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--seconds", type=float, default=15.0, help="Length of each measured run.")
    parser.add_argument("--rounds", type=int, default=3,
                        help="Closed-loop floor/prewarm pairs per connection count; the figures are their medians "
                             "(the capacity ratio: the median of the pairs' ratios). Each run's connections are "
                             "dealt to the workers afresh, which alone moved a single run's ratio by ~20%%.")
    parser.add_argument("--workers", type=int, default=min(2, len(os.sched_getaffinity(0))),
                        help="uvicorn worker processes of both servers (default: 2, or 1 on one core).")
    parser.add_argument("--open-loop-rps", type=float, help="Constant rate; default the KEDA rate, models / 30 s.")
    parser.add_argument("--open-loop-connections", type=int, default=100)
    parser.add_argument("--hey", action="store_true", help="Also run hey -q on one model's URL (cross-check).")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        parser.error("wrk is not installed (Debian: apt-get install wrk)")
    figures = on_bench_server(lambda url: run(url, args), prefix="prewarm-bench-api-")
    for target in figures["targets"]:
        print(f"{'met ' if target['met'] else 'MISS'} {target['target']} ({target['models']:,} models): "
              f"{target['value']}")
    print(f"load average before {figures['load_average_before']}, after {figures['load_average_after']}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
