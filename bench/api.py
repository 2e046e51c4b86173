"""API benchmark: the recommendation endpoint with 10,000 registered models at 100 concurrent clients.

Usage:
    python bench/api.py [--models 10000] [--clients 100] [--seconds 20] [--json PATH]

A fresh database (embedded PostgreSQL unless PREWARM_BENCH_ADMIN_URL names a
server) gets N models and one 60-minute forecast run for each; ``prewarm serve``
runs as its own process (one uvicorn worker) and this process drives it with
closed-loop asyncio clients over loopback keep-alive connections, each asking
for a random model's recommendation. Both share this machine's cores, so the
figures include the load generator's contention. Latency is measured per
request from send to full body.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from forecaster.store.catalog import ServingModelSpec, upsert_models  # noqa: E402
from forecaster.store.db import embedded_server, make_engine, upgrade  # noqa: E402
from forecaster.store.forecasts import write_forecasts  # noqa: E402
from forecaster.store.tokens import create_token  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(admin_url: str, n_models: int) -> tuple[str, str]:
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS bench_api WITH (FORCE)"))
        conn.execute(text("CREATE DATABASE bench_api"))
    admin.dispose()
    url = make_url(admin_url).set(database="bench_api").render_as_string(hide_password=False)
    engine = make_engine(url)
    upgrade(engine)
    rng = np.random.default_rng(7)
    ids = [f"model-{i:06d}" for i in range(n_models)]
    with engine.begin() as conn:
        for start in range(0, n_models, 2000):
            upsert_models(conn, [ServingModelSpec(id=i, replica_rps=float(rng.uniform(0.5, 20)))
                                 for i in ids[start:start + 2000]])
    issued = datetime.now(timezone.utc).replace(microsecond=0)
    minutes = pd.date_range(pd.Timestamp(issued).floor("min"), periods=60, freq="min")
    base = rng.gamma(1.0, 50.0, size=n_models)
    frame = pd.DataFrame({"unique_id": np.repeat(ids, 60), "ds": np.tile(minutes, n_models)})
    level = np.repeat(base, 60) * (1 + 0.2 * np.sin(np.tile(np.arange(60), n_models) / 9))
    frame["point"] = level
    frame["q0.1"], frame["q0.5"], frame["q0.9"] = level * 0.7, level, level * 1.4
    write_forecasts(engine, frame, issued_at=issued, model_version_id=None)
    token = create_token(engine, name="bench", scopes=["read"])
    engine.dispose()
    return url, token


async def drive(url: str, token: str, model_ids: list[str], clients: int, seconds: float,
                warmup_s: float) -> tuple[list[float], int]:
    latencies: list[float] = []
    errors = 0
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=10) as client:
        measure_from = time.perf_counter() + warmup_s
        stop_at = measure_from + seconds

        async def one_client(seed: int) -> None:
            nonlocal errors
            rng = random.Random(seed)
            while True:
                started = time.perf_counter()
                if started >= stop_at:
                    return
                response = await client.get(f"/v1/models/{rng.choice(model_ids)}/recommendation")
                finished = time.perf_counter()
                if started >= measure_from:
                    if response.status_code == 200:
                        latencies.append(finished - started)
                    else:
                        errors += 1

        await asyncio.gather(*(one_client(i) for i in range(clients)))
    return latencies, errors


@contextlib.contextmanager
def serving(url: str, token: str, probe_model: str, *, timeout_s: float = 120.0):
    """``prewarm serve`` on a free port against ``url``; yields its base URL once a recommendation answers."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": url}
    server = subprocess.Popen([sys.executable, "-m", "forecaster.cli", "serve", "--port", str(port),
                              "--no-scheduler"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{base}/v1/models/{probe_model}/recommendation",
                             headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up")
            time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def run(admin_url: str, n_models: int, clients: int, seconds: float) -> dict:
    url, token = prepare(admin_url, n_models)
    ids = [f"model-{i:06d}" for i in range(n_models)]
    with serving(url, token, ids[0]) as base:
        latencies, errors = asyncio.run(drive(base, token, ids, clients, seconds, warmup_s=3.0))
    ms = np.array(latencies) * 1000.0
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "requests_per_s": round(len(ms) / seconds, 1),
        "models": n_models,
        "clients": clients,
        "requests": int(len(ms)),
        "errors": errors,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    admin_url = os.environ.get("PREWARM_BENCH_ADMIN_URL")
    if admin_url:
        figures = run(admin_url, args.models, args.clients, args.seconds)
    else:
        with tempfile.TemporaryDirectory(prefix="prewarm-bench-api-") as tmp:
            os.chmod(tmp, 0o755)
            with embedded_server(Path(tmp) / "pgdata") as url:
                figures = run(url, args.models, args.clients, args.seconds)
    print(f"recommendation endpoint, {figures['models']:,} models, {figures['clients']} concurrent clients, "
          f"{figures['seconds']:g} s: p50 {figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms, "
          f"{figures['requests_per_s']:,.0f} requests/s, {figures['errors']} errors")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
