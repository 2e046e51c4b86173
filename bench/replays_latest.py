"""``GET /v1/replays/latest`` at fleet scale: what the dashboard's calls cost with N models in the replay.

Usage:
    python bench/replays_latest.py [--models 10000] [--repeat 20]

A fresh database (embedded PostgreSQL unless PREWARM_BENCH_ADMIN_URL names a server) holds one replay with an
outcome row per model under both policies (filled in SQL). Each figure is the median wall time of a request
through the app (``TestClient``: query, JSON encoding, no socket) and the body's size: the fleet page's call
(``limit=0``: totals only), a model page's (``model_id=``), the default page and every model at once. For
comparison, the former read (every outcome row of the replay fetched and summed in Python, whatever was asked)
is timed on its own, without the HTTP layer. ``uptime``'s load is printed, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import text

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdb import fresh_database, on_bench_server  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
from forecaster.store.db import make_engine  # noqa: E402
from forecaster.store.replays import OUTCOME_COLUMNS, start_replay  # noqa: E402
from forecaster.store.tokens import create_token  # noqa: E402

END = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def former_read(conn, replay_id: int) -> int:
    """The read before paging: every row of the replay fetched, grouped and summed in Python."""
    rows = conn.execute(text(
        f"SELECT policy, model_id, {', '.join(OUTCOME_COLUMNS)} FROM replay_outcomes WHERE replay_id = :r "
        "ORDER BY model_id, policy"), {"r": replay_id}).mappings().all()
    totals: dict[str, dict] = {}
    by_model: dict[str, dict] = {}
    for row in rows:
        total = totals.setdefault(row["policy"], dict.fromkeys(OUTCOME_COLUMNS, 0))
        for c in OUTCOME_COLUMNS[:4]:
            total[c] += row[c]
        by_model.setdefault(row["model_id"], {})[row["policy"]] = dict(row)
    return len(by_model)


def timed(call, repeat: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(admin_url: str, args) -> None:
    from fastapi.testclient import TestClient

    from api.main import create_app

    url = fresh_database(admin_url, "prewarm_bench_replays")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) SELECT 'model-' || lpad(g::text, 6, '0') "
                          "FROM generate_series(1, :n) g"), {"n": args.models})
        replay = start_replay(conn, source="demo", window_start=END - timedelta(hours=6), window_end=END,
                              policies=("prewarm", "reactive"))
        conn.execute(text(
            "INSERT INTO replay_outcomes (replay_id, policy, model_id, requests, cold_requests, replica_starts, "
            "wait_total_s, wait_max_s) SELECT :r, p, id, 1000, 10, 3, 12.5, 4.0 FROM serving_models, "
            "unnest(ARRAY['prewarm', 'reactive']) p"), {"r": replay})
        conn.execute(text("ANALYZE"))
    token = create_token(engine, name="bench", scopes=["read"])
    settings = Settings(database_url=url, data_dir=Path("/tmp/prewarm-bench-replays"),
                        models_dir=Path("/tmp/prewarm-bench-replays"), api_snapshot_refresh_s=0)
    print(f"load: {os.getloadavg()}")
    print(f"{args.models:,} models in the replay; medians of {args.repeat}")
    with engine.connect() as conn:
        seconds = timed(lambda: former_read(conn, replay), args.repeat)
    print(f"{seconds * 1000:8.1f} ms              former read (every row, summed in Python), whatever was asked")
    with TestClient(create_app(settings, engine, clock=lambda: END)) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        for query in ("limit=0", "model_id=model-000042", "", f"limit={args.models}"):
            path = "/v1/replays/latest" + (f"?{query}" if query else "")
            size = len(client.get(path).content)
            seconds = timed(lambda: client.get(path).raise_for_status(), args.repeat)
            print(f"{seconds * 1000:8.1f} ms {size:>12,} B  GET {path}")
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    on_bench_server(lambda url: run(url, args), prefix="prewarm-bench-replays-")


if __name__ == "__main__":
    main()
