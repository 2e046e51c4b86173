"""Migrations build the whole schema, and remove it again, on a real PostgreSQL."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from sqlalchemy import inspect, text

from forecaster.store.db import current_revision, downgrade, make_engine, upgrade
from forecaster.store.tables import Base

EXPECTED_TABLES = {
    "serving_models", "invocations", "coverage", "ingest_batches", "cold_starts", "nodes", "node_cache",
    "model_versions", "forecasts", "plans", "actions", "job_runs", "apscheduler_jobs", "api_tokens",
    "actuator_control", "backtest_runs", "backtest_results", "rollups", "transfers", "replays", "replay_outcomes",
    "forecast_errors", "forecast_error_hours", "model_ahead_gpus", "action_counts", "source_cursors",
}
HEAD = sorted(p.name.split("_")[0] for p in (Path(__file__).resolve().parent.parent / "migrations" / "versions")
              .glob("[0-9]*_*.py"))[-1]


def test_upgrade_creates_every_table_the_code_maps(empty_db_url):
    engine = make_engine(empty_db_url)
    assert current_revision(engine) is None
    upgrade(engine)
    tables = set(inspect(engine).get_table_names())
    assert EXPECTED_TABLES <= tables
    assert set(Base.metadata.tables) == EXPECTED_TABLES  # nothing mapped that no migration creates
    with engine.connect() as conn:
        strategy = conn.execute(
            text("SELECT partstrat FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid "
                 "WHERE c.relname = 'invocations'")
        ).scalar()
    assert strategy == "r"  # range-partitioned
    assert current_revision(engine) == HEAD
    upgrade(engine)  # idempotent
    assert current_revision(engine) == HEAD
    engine.dispose()


def test_columns_match_the_mapped_tables(db_url):
    engine = make_engine(db_url)
    inspector = inspect(engine)
    for name, table in Base.metadata.tables.items():
        db_columns = {c["name"] for c in inspector.get_columns(name)}
        assert db_columns == set(table.columns.keys()), name
    engine.dispose()


def test_downgrade_to_base_and_up_again(empty_db_url):
    engine = make_engine(empty_db_url)
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('m')"))
    downgrade(engine, "base")
    assert set(inspect(engine).get_table_names()) - {"alembic_version"} == set()
    upgrade(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM serving_models")).scalar() == 0
    engine.dispose()


def test_constraints_reject_impossible_rows(db_url):
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('m')"))
    import pytest
    from sqlalchemy.exc import IntegrityError

    for sql in (
        "INSERT INTO serving_models (id, replica_rps) VALUES ('bad', 0)",
        "INSERT INTO nodes (id, gpus_total, gpus_free) VALUES ('n', 2, 3)",
        "INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, source) "
        "VALUES ('m', 'n', now(), -1, 't')",
        "INSERT INTO model_versions (id, status, path) VALUES ('a', 'champion', 'x'), ('b', 'champion', 'y')",
        "INSERT INTO model_versions (id, status, path, kind) VALUES ('c', 'champion', 'x', 'latency'), "
        "('d', 'champion', 'y', 'latency')",
        "INSERT INTO model_versions (id, status, path, kind) VALUES ('e', 'retired', 'x', 'weather')",
        "INSERT INTO transfers (model_id, node_id, kind, tier, ref, started_at, seconds, source) "
        "VALUES ('m', 'n', 'preload', 'image', 'x', now(), 1, 't')",
        "INSERT INTO transfers (model_id, node_id, kind, tier, ref, started_at, seconds, source) "
        "VALUES ('m', 'n', 'prepull', 'image', 'x', now(), -1, 't')",
    ):
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(text(sql))
    with engine.begin() as conn:  # one champion per kind: a forecast champion and a latency champion coexist
        conn.execute(text("INSERT INTO model_versions (id, status, path, kind) VALUES ('f', 'champion', 'x', "
                          "'forecast'), ('l', 'champion', 'y', 'latency')"))
    engine.dispose()


def test_agent_observations_stored_as_cold_starts_move_to_transfers(empty_db_url):
    engine = make_engine(empty_db_url)
    upgrade(engine, "0006")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id, image_ref, weights_uri) "
                          "VALUES ('m', 'reg/img:1', 's3://w/m')"))
        conn.execute(text(
            "INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, image_pull_s, weight_fetch_s, "
            "cache_state, source) VALUES "
            "('m', 'n1', '2026-11-29T10:00Z', 3.5, 3.5, NULL, 'none', 'actuator-agent'), "
            "('m', 'n1', '2026-11-29T10:01Z', 8.0, NULL, 8.0, 'none', 'actuator-agent'), "
            "('m', 'n2', '2026-11-29T10:02Z', 40.0, 20.0, 10.0, 'none', 'push')"))
    upgrade(engine)
    with engine.connect() as conn:
        moved = conn.execute(text("SELECT kind, tier, ref, bytes, seconds FROM transfers ORDER BY started_at")).all()
        left = conn.execute(text("SELECT node_id, source FROM cold_starts")).all()
    assert moved == [("prepull", "image", "reg/img:1", None, 3.5), ("preload", "disk", "s3://w/m", None, 8.0)]
    assert left == [("n2", "push")]  # a real cold start stays
    downgrade(engine, "0006")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM cold_starts")).scalar() == 3
    engine.dispose()


def test_hours_scored_before_p_any_sums_existed_are_scored_again(empty_db_url):
    engine = make_engine(empty_db_url)
    upgrade(engine, "0013")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO forecast_errors (horizon_min, hour, model_id, scored_minutes, abs_error, "
                          "actual, forecast) VALUES (5, '2026-11-29T10:00Z', 'm', 60, 12.0, 300.0, 310.0)"))
        conn.execute(text("INSERT INTO forecast_error_hours (hour, horizons_min, batch_watermark, models, seconds) "
                          "VALUES ('2026-11-29T10:00Z', '{5}', 7, 1, 0.5)"))
    upgrade(engine)
    with engine.connect() as conn:
        # the old row reads "no p_any scored" until the hour is scored again, which forgetting it asks for
        assert conn.execute(text("SELECT scored_minutes, p_any_minutes, p_any_sq_error, p_any_sum, invoked_minutes "
                                 "FROM forecast_errors")).all() == [(60, 0, 0.0, 0.0, 0)]
        assert conn.execute(text("SELECT count(*) FROM forecast_error_hours")).scalar() == 0
    downgrade(engine, "0013")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT scored_minutes FROM forecast_errors")).all() == [(60,)]
    engine.dispose()


def test_gpus_ahead_are_filled_from_the_action_history(empty_db_url):
    """0015 keeps each model's GPUs ahead and the actions per kind and status in tables: the upgrade fills them
    from the history (the GPUs ahead of each model's latest counted scale or release, 0 left out), and the
    downgrade drops them."""
    engine = make_engine(empty_db_url)
    upgrade(engine, "0014")
    rows = [  # (model, kind, status, detail, finished_at)
        ("a", "scale", "succeeded", '{"ahead_gpus": 4}', "2026-12-01T10:00Z"),
        ("a", "scale", "failed", '{"ahead_gpus": 9}', "2026-12-01T10:05Z"),  # failed: does not count
        ("b", "scale", "succeeded", '{"ahead_gpus": 6}', "2026-12-01T10:00Z"),
        ("b", "release", "succeeded", '{"ahead_gpus": 0}', "2026-12-01T10:02Z"),  # b is back at its ask
        ("c", "scale", "succeeded", '{}', "2026-12-01T10:00Z"),  # no figure: does not count
        ("d", "scale", "running", '{"ahead_gpus": 2}', None),
        ("d", "prepull", "succeeded", '{"ahead_gpus": 7}', "2026-12-01T10:09Z"),  # not a scale
    ]
    with engine.begin() as conn:
        for model, kind, status, detail, finished in rows:
            conn.execute(text("INSERT INTO actions (kind, model_id, status, detail, started_at, finished_at) "
                              "VALUES (:k, :m, :s, CAST(:d AS jsonb), '2026-12-01T09:59Z', :f)"),
                         {"k": kind, "m": model, "s": status, "d": detail, "f": finished})
    upgrade(engine)
    with engine.connect() as conn:
        assert dict(conn.execute(text("SELECT model_id, ahead_gpus FROM model_ahead_gpus")).all()) == {"a": 4, "d": 2}
        assert sorted(conn.execute(text("SELECT kind, status, n FROM action_counts")).all()) == [
            ("prepull", "succeeded", 1), ("release", "succeeded", 1), ("scale", "failed", 1),
            ("scale", "running", 1), ("scale", "succeeded", 3)]
    downgrade(engine, "0014")
    assert {"model_ahead_gpus", "action_counts"}.isdisjoint(inspect(engine).get_table_names())
    engine.dispose()


def test_history_retention_adds_pruned_counts_and_the_age_indexes(empty_db_url):
    """0016 adds ``action_counts.pruned`` (0 for the counts already kept) and the indexes retention walks; the
    downgrade takes them away again."""
    engine = make_engine(empty_db_url)
    upgrade(engine, "0015")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO action_counts (kind, status, n) VALUES ('scale', 'succeeded', 5)"))
    upgrade(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT kind, status, n, pruned FROM action_counts")).all() == [
            ("scale", "succeeded", 5, 0)]
    indexes = {i["name"] for table in ("actions", "plans") for i in inspect(engine).get_indexes(table)}
    assert {"actions_finished_age", "plans_planned_at", "actions_updated"} <= indexes
    downgrade(engine, "0015")
    inspector = inspect(engine)
    assert "pruned" not in {c["name"] for c in inspector.get_columns("action_counts")}
    assert {"actions_finished_age", "plans_planned_at", "actions_updated"}.isdisjoint(
        {i["name"] for table in ("actions", "plans") for i in inspector.get_indexes(table)})
    engine.dispose()


def _leave_invalid_index(engine, name: str, table: str) -> None:
    """What a failed or cancelled ``CREATE INDEX CONCURRENTLY name`` leaves: an INVALID index of that name.

    An open transaction holding ROW EXCLUSIVE on the table makes the build wait (after it has committed the
    index's catalogue row), so its statement timeout fires every time, whatever the machine's speed.
    """
    from sqlalchemy.exc import OperationalError

    import pytest

    with engine.connect() as writer:
        writer.execute(text(f"LOCK TABLE {table} IN ROW EXCLUSIVE MODE"))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("SET statement_timeout = '300ms'"))
            with pytest.raises(OperationalError, match="statement timeout"):
                conn.execute(text(f"CREATE INDEX CONCURRENTLY {name} ON {table} (id)"))
        writer.rollback()


def _index_state(engine, name: str):
    with engine.connect() as conn:
        return conn.execute(text("SELECT i.indisvalid, pg_get_indexdef(i.indexrelid) AS definition FROM pg_index i "
                                 "WHERE i.indexrelid = to_regclass(:n)"), {"n": name}).one()


def test_an_invalid_index_left_by_a_failed_concurrent_build_is_built_again(empty_db_url):
    """Migrations 0003, 0015 and 0016 ask operators to build their indexes CONCURRENTLY by hand first; a build that
    failed left an INVALID index of that name, which ``IF NOT EXISTS`` skipped: the upgrade succeeded without it."""
    engine = make_engine(empty_db_url)
    upgrade(engine, "0002")
    wanted = {  # index (migration): a column its real definition has, which the failed build's ``(id)`` lacks
        "actions_model_time": "not_before",  # 0003
        "actions_scale_latest": "ahead_gpus",  # 0015
        "plans_planned_at": "planned_at",  # 0016
        "actions_updated": "updated_at",  # 0016
    }
    for name in wanted:
        _leave_invalid_index(engine, name, name.split("_")[0])
        assert _index_state(engine, name).indisvalid is False
    upgrade(engine)
    assert current_revision(engine) == HEAD
    for name, column in wanted.items():
        state = _index_state(engine, name)
        assert state.indisvalid is True, name
        assert column in state.definition, state.definition
    engine.dispose()


def test_a_valid_hand_built_index_is_kept(empty_db_url):
    engine = make_engine(empty_db_url)
    upgrade(engine, "0015")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("CREATE INDEX CONCURRENTLY plans_planned_at ON plans (planned_at, id)"))
        oid = conn.execute(text("SELECT 'plans_planned_at'::regclass::oid")).scalar()
    upgrade(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT 'plans_planned_at'::regclass::oid")).scalar() == oid
    engine.dispose()


def test_a_database_newer_than_this_release_starts_as_it_is_and_db_upgrade_refuses_it(db_url, tmp_path, monkeypatch,
                                                                                       caplog):
    """An image rolled back after a newer release migrated: the database's revision is unknown to this code. Every
    process used to fail at start (``Can't locate revision identified by ...``); now it warns and starts on the
    schema as it is, and only an explicit ``prewarm db upgrade`` (or downgrade) refuses, with a clear message."""
    import os

    from typer.testing import CliRunner

    from forecaster.cli import app

    for name in list(os.environ):
        if name.startswith("PREWARM_") or name == "DATABASE_URL":
            monkeypatch.delenv(name)
    engine = make_engine(db_url)
    newer = str(int(HEAD) + 1).zfill(len(HEAD))
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": newer})
    env = {"DATABASE_URL": db_url, "PREWARM_DATA_DIR": str(tmp_path / "data"),
           "PREWARM_MODELS_DIR": str(tmp_path / "models")}
    runner = CliRunner()

    caplog.set_level("WARNING", logger="forecaster.store.db")
    started = runner.invoke(app, ["models", "list"], env=env)
    assert started.exit_code == 0, started.output
    assert f"the database is at revision {newer}, which this release does not know" in caplog.text
    assert "the schema is kept as it is" in caplog.text

    refused = runner.invoke(app, ["db", "upgrade"], env=env)
    assert refused.exit_code == 1
    assert refused.stderr.startswith(f"error: the database is at revision {newer}, which this release does not know")
    refused = runner.invoke(app, ["db", "downgrade", "0017"], env=env)
    assert refused.exit_code == 1
    assert "which this release does not know" in refused.stderr
    assert current_revision(engine) == newer


def test_job_runs_get_owners_and_leases(empty_db_url):
    """0020 adds ``job_runs.owner``, ``lease_expires_at`` and ``attempt``: a claim running at the upgrade (no lease:
    its process may be gone) gets a day from its start, as does one a process of the previous version inserts
    later (the default); finished runs get none. The index of running claims goes with the downgrade."""
    engine = make_engine(empty_db_url)
    upgrade(engine, "0019")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO job_runs (job_name, slot, started_at, finished_at, status) VALUES "
                          "('retrain', '2026-12-01T03:00Z', '2026-12-01T03:00:02Z', NULL, 'running'), "
                          "('plan', '2026-12-01T10:00Z', '2026-12-01T10:00:01Z', '2026-12-01T10:00:05Z', 'ok')"))
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO job_runs (job_name, slot) VALUES ('plan', '2026-12-01T10:01Z')"))  # old code
        rows = conn.execute(text(
            "SELECT job_name, owner, lease_expires_at - started_at, attempt FROM job_runs ORDER BY slot")).all()
    day = timedelta(days=1)
    assert [(r[0], r[1], r[3]) for r in rows] == [("retrain", None, 1), ("plan", None, 1), ("plan", None, 1)]
    assert rows[0][2] == day and rows[1][2] is None and abs(rows[2][2] - day) < timedelta(seconds=5)
    assert "job_runs_running" in {i["name"] for i in inspect(engine).get_indexes("job_runs")}
    downgrade(engine, "0019")
    inspector = inspect(engine)
    assert {c["name"] for c in inspector.get_columns("job_runs")} == {
        "job_name", "slot", "started_at", "finished_at", "status", "detail"}
    assert "job_runs_running" not in {i["name"] for i in inspector.get_indexes("job_runs")}
    engine.dispose()
