"""Dashboard reads at fleet scale: one page of ``GET /v1/fleet`` over N models, and one model's week-long series.

Usage:
    python bench/dashboard.py [--models 100000] [--runs-min 60] [--window-min 60] [--repeat 20] [--json PATH]

A fresh database (embedded PostgreSQL unless PREWARM_BENCH_ADMIN_URL names a
server) is filled in SQL: N models, one forecast run per model per minute for
``--runs-min`` minutes with 60 target minutes each, one row per run (as the forecast job writes
them), per-minute counts with coverage, cold starts and actions. The app runs
under uvicorn in this process on loopback; each figure is the wall time of a
full HTTP request (query, JSON encoding, transfer), after one warm-up request.
Before the figures, the forecast_errors job (``forecaster.jobs.error_scoring``,
the real scoring step) scores the seeded hour into the error rollup, as it
would an hour after that hour ended; its time is reported per hour of data.
The fleet figures are one page (50 rows, as the page asks) for every sort key
(the error sorts read the rollup: ``error_source`` is printed with each), the
wMAPE page at horizon 30, the page at offset N/2 and a search. Then the fleet's error over the newest scored
hour (``fleet_hour_errors`` and ``p_any_bands``, what ``/metrics`` reads once per scored hour) and ``GET
/metrics`` itself. ``uptime``'s load is printed before and after, since the machine may be shared.
Like ``bench/scale.py`` the fleet is generated, but here in SQL (the forecast
rows as the forecast job stores them), since only the reads are measured.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
from sqlalchemy import text

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdb import fresh_database, on_bench_server  # noqa: E402
from forecaster.jobs.error_scoring import score_errors_job  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
from forecaster.store.dashboard import (  # noqa: E402
    FLEET_SORTS, fleet_hour_errors, newest_scored_hour, p_any_bands)
from forecaster.store.db import make_engine  # noqa: E402
from forecaster.store.forecasts import ensure_forecast_partitions  # noqa: E402
from forecaster.store.partitions import ensure_partitions  # noqa: E402
from forecaster.store.tokens import create_token  # noqa: E402

END = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill(engine, *, models: int, runs_min: int, week_model: bool) -> dict[str, int]:
    """Fill the store in SQL; returns row counts."""
    first_run = END - timedelta(minutes=runs_min)
    ensure_partitions(engine, END - timedelta(days=8), END + timedelta(days=1))
    ensure_forecast_partitions(engine, [(END - timedelta(days=d)).date() for d in range(9)])
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) SELECT 'model-' || lpad(g::text, 6, '0') "
                          "FROM generate_series(1, :n) g"), {"n": models})
        # One row per model and run, 60 target minutes as arrays (as write_forecasts stores them).
        conn.execute(text(
            "INSERT INTO forecasts (model_id, issued_at, first_target, point, p_any, quantile_levels, quantiles) "
            "SELECT m.id, r.t, r.t, pt.point, "
            "array_fill(CAST(0.9 AS real), ARRAY[60]), CAST('{0.1,0.5,0.9}' AS real[]), p.q "
            "FROM serving_models m JOIN (SELECT c, ARRAY(SELECT CAST(10 + c + k % 5 AS real) "
            "FROM generate_series(0, 59) k) AS point FROM generate_series(0, 7) c) pt ON pt.c = hashtext(m.id) & 7, "
            "generate_series(CAST(:a AS timestamptz), CAST(:b AS timestamptz), interval '1 minute') r(t), "
            "(SELECT ARRAY[ARRAY(SELECT CAST(5 + k % 5 AS real) FROM generate_series(0, 59) k), "
            "              ARRAY(SELECT CAST(10 + k % 5 AS real) FROM generate_series(0, 59) k), "
            "              ARRAY(SELECT CAST(20 + k % 5 AS real) FROM generate_series(0, 59) k)] AS q) p"),
            {"a": first_run, "b": END})
        conn.execute(text(
            "INSERT INTO invocations (model_id, minute, count) SELECT m.id, t, 5 + (hashtext(m.id || t::text) & 15) "
            "FROM serving_models m, generate_series(CAST(:a AS timestamptz), CAST(:b AS timestamptz) - "
            "interval '1 minute', interval '1 minute') t WHERE hashtext(m.id || t::text) % 10 <> 0"),
            {"a": first_run, "b": END})
        conn.execute(text(
            "INSERT INTO coverage (model_id, source, step_seconds, ranges) SELECT id, 'bench', 60, "
            "tstzmultirange(tstzrange(:a, :b, '[)')) FROM serving_models"), {"a": first_run, "b": END})
        conn.execute(text(
            "INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, source) "
            "SELECT m.id, 'node-' || k, CAST(:b AS timestamptz) - k * interval '7 minutes', 30 + k, 'bench' "
            "FROM serving_models m, generate_series(1, 5) k"), {"b": END})
        conn.execute(text(
            "INSERT INTO actions (kind, model_id, node_id, target, not_before, deadline, reason, expected_benefit, "
            "status) SELECT 'prepull', m.id, 'node-' || k, 'img', CAST(:b AS timestamptz) - k * interval '9 minutes', "
            "CAST(:b AS timestamptz) - k * interval '9 minutes' + interval '5 minutes', 'forecast_spike', 40, "
            "CASE WHEN k % 3 = 0 THEN 'failed' ELSE 'succeeded' END "
            "FROM serving_models m, generate_series(1, 6) k"), {"b": END})
        if week_model:  # one model with a full week of runs, for the series figure
            week_start = END - timedelta(days=7)
            conn.execute(text(
                "INSERT INTO forecasts (model_id, issued_at, first_target, point, quantile_levels, quantiles) "
                "SELECT 'model-000001', r.t, r.t, ARRAY(SELECT CAST(10 + k % 5 AS real) FROM generate_series(0, 59) k), "
                "CAST('{0.1,0.5,0.9}' AS real[]), array_cat(array_cat(array_fill(CAST(5 AS real), ARRAY[1, 60]), "
                "array_fill(CAST(10 AS real), ARRAY[1, 60])), array_fill(CAST(20 AS real), ARRAY[1, 60])) "
                "FROM generate_series(CAST(:a AS timestamptz), CAST(:b AS timestamptz), interval '1 minute') r(t) "
                "ON CONFLICT DO NOTHING"), {"a": week_start, "b": first_run})
            conn.execute(text(
                "INSERT INTO invocations (model_id, minute, count) SELECT 'model-000001', t, 7 "
                "FROM generate_series(CAST(:a AS timestamptz), CAST(:b AS timestamptz) - interval '1 minute', "
                "interval '1 minute') t ON CONFLICT DO NOTHING"), {"a": week_start, "b": first_run})
            conn.execute(text("UPDATE coverage SET ranges = ranges + tstzmultirange(tstzrange(:a, :b, '[)')) "
                              "WHERE model_id = 'model-000001'"), {"a": week_start, "b": first_run})
        counts = {table: conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
                  for table in ("serving_models", "forecasts", "invocations", "cold_starts", "actions")}
    return counts


def timed(client: httpx.Client, url: str, repeat: int) -> dict[str, float]:
    client.get(url).raise_for_status()  # warm-up
    times, size = [], 0
    for _ in range(repeat):
        started = time.perf_counter()
        response = client.get(url)
        times.append((time.perf_counter() - started) * 1000)
        response.raise_for_status()
        size = len(response.content)
    times.sort()
    p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    return {"p50_ms": round(statistics.median(times), 1), "p95_ms": round(p95, 1), "max_ms": round(times[-1], 1),
            "bytes": size, "requests": repeat}


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (``uptime``'s), for the record beside the figures."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(admin_url: str, args) -> dict:
    import uvicorn

    from api.main import create_app

    url = fresh_database(admin_url, "bench_dashboard")
    engine = make_engine(url)
    started = time.perf_counter()
    counts = fill(engine, models=args.models, runs_min=args.runs_min, week_model=True)
    fill_s = time.perf_counter() - started
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))  # what autovacuum does to fresh tables (index-only scans need it)
    print(f"filled in {time.perf_counter() - started:.0f} s: {counts}", flush=True)
    token = create_token(engine, name="bench", scopes=["read"])
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=url, data_dir=Path(tmp) / "data", models_dir=Path(tmp) / "models",
                            error_rollup_lookback_h=1)
        # the job's run after the seeded hour ended: it scores END - 1 h .. END at the offered horizons
        scored = score_errors_job(engine, settings, END + timedelta(seconds=settings.error_rollup_delay_s))
        hour = scored["scored"][0] if scored["scored"] else {}
        print(f"forecast_errors job: scored {hour.get('hour')} at horizons {scored['horizons_min']} in "
              f"{hour.get('seconds')} s ({hour.get('models')} models, {hour.get('runs_read')} runs read, "
              f"{hour.get('rows')} rollup rows); load {load_average()}", flush=True)
        app = create_app(settings, engine, clock=lambda: END)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        results = {"models": args.models, "forecast_runs": counts["forecasts"], "window_min": args.window_min,
                   "fill_s": round(fill_s, 1), "score_hour_s": hour.get("seconds"),
                   "score_hour_models": hour.get("models"), "score_hour_runs_read": hour.get("runs_read"),
                   "score_horizons_min": scored["horizons_min"], "load_before": load_average()}
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                              headers={"Authorization": f"Bearer {token}"}) as client:
                base = f"/v1/fleet?horizon=5&window_min={args.window_min}&limit=50"
                figures = ((("fleet_wmape", "", "wmape"),)
                           + tuple((f"fleet_{key}", f"&sort={key}", key) for key in FLEET_SORTS if key != "wmape")
                           + (("fleet_h30_wmape", "&horizon=30", "wmape"),
                              ("fleet_wmape_middle_page", f"&offset={args.models // 2}", "wmape"),
                              ("fleet_search", "&search=model-00012&sort=model_id", "model_id"),
                              ("fleet_search_wmape", "&search=model-00012", "wmape")))
                for name, query, sort in figures:
                    if sort not in args.fleet_sorts.split(","):
                        continue
                    url = base.replace("horizon=5&", "") + query if "horizon=" in query else base + query
                    figure = timed(client, url, args.repeat)
                    figure["error_source"] = client.get(url).json()["error_source"]
                    results[name] = figure
                    print(f"GET {url} ({args.models} models): p50 {figure['p50_ms']} ms, p95 {figure['p95_ms']} ms, "
                          f"max {figure['max_ms']} ms, {figure['bytes']} bytes, errors from "
                          f"{figure['error_source']}", flush=True)
                week = (f"/v1/models/model-000001/series?horizon=5&start={(END - timedelta(days=7)).isoformat()}"
                        f"&end={END.isoformat()}").replace("+", "%2B")
                figure = timed(client, week, max(5, args.repeat // 2))
                results["series_week"] = figure
                print(f"GET /v1/models/model-000001/series (10,080 minutes): p50 {figure['p50_ms']} ms, "
                      f"p95 {figure['p95_ms']} ms, max {figure['max_ms']} ms, {figure['bytes']} bytes", flush=True)
                # the fleet's error over the newest scored hour, as /metrics reads it once per scored hour
                with engine.connect() as conn:
                    reads = []
                    for _ in range(max(3, args.repeat // 2)):
                        begun = time.perf_counter()
                        hour_start = newest_scored_hour(conn)[0]
                        rows = fleet_hour_errors(conn, hour=hour_start)
                        bands = p_any_bands(conn, hour=hour_start)
                        reads.append(1000 * (time.perf_counter() - begun))
                results["fleet_hour_errors"] = {"p50_ms": round(statistics.median(reads), 1),
                                                "max_ms": round(max(reads), 1), "horizons": len(rows),
                                                "p_any_band_rows": len(bands)}
                print(f"fleet_hour_errors + p_any_bands ({args.models} models, {len(rows)} horizons): p50 "
                      f"{results['fleet_hour_errors']['p50_ms']} ms, max {results['fleet_hour_errors']['max_ms']} ms",
                      flush=True)
                figure = timed(client, "/metrics", args.repeat)  # the hour's errors cached after the first scrape
                results["metrics"] = figure
                print(f"GET /metrics: p50 {figure['p50_ms']} ms, p95 {figure['p95_ms']} ms, max {figure['max_ms']} ms, "
                      f"{figure['bytes']} bytes", flush=True)
                results["load_after"] = load_average()
                print(f"load before {results['load_before']}, after {results['load_after']} (1/5/15 min)",
                      flush=True)
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            engine.dispose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=100_000)
    parser.add_argument("--runs-min", type=int, default=60, help="minutes of forecast runs per model")
    parser.add_argument("--window-min", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--fleet-sorts", default=",".join(FLEET_SORTS),
                        help="fleet sort keys to measure (default all; the error sorts read the error rollup)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    results = on_bench_server(lambda url: run(url, args), prefix="prewarm-bench-dashboard-")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
