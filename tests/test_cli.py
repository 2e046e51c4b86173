"""The ``prewarm`` command line, run in-process with typer's CliRunner against a real database."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from forecaster.cli import app
from forecaster.data import AZURE2019_TOP100, AZURE2021_EXCERPT, sample_path


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    """No PREWARM_* or DATABASE_URL from the caller's shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith("PREWARM_") or name == "DATABASE_URL":
            monkeypatch.delenv(name)
    monkeypatch.setenv("PREWARM_DATA_DIR", str(tmp_path / "data"))


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def cli(runner, db_url, tmp_path):
    def invoke(*args: str, **env: str):
        return runner.invoke(app, list(args), env={"DATABASE_URL": db_url, "PREWARM_MODELS_DIR": str(tmp_path / "models"),
                                                   "PREWARM_DATA_DIR": str(tmp_path / "data"), **env})

    return invoke


def table_counts(engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar())
                for t in ("serving_models", "invocations", "coverage", "ingest_batches")}


def azure2021_expected() -> dict[str, int]:
    """Figures of the shipped Azure 2021 excerpt, computed here from the file itself."""
    frame = pd.read_csv(sample_path(AZURE2021_EXCERPT))
    minute = np.floor((frame["end_timestamp"] - frame["duration"]) / 60).astype("int64")
    n_minutes = int(minute.max() - min(0, minute.min()) + 1)
    return {
        "invocations": len(frame),
        "models": frame["func"].nunique(),
        "rows_written": len(set(zip(frame["func"], minute))),
        "covered_steps": frame["func"].nunique() * n_minutes,
    }


# --- db ----------------------------------------------------------------------------


def _head_revision() -> str:
    from forecaster.store.db import MIGRATIONS_DIR

    return sorted(p.name.split("_")[0] for p in (MIGRATIONS_DIR / "versions").glob("[0-9]*_*.py"))[-1]


def test_db_upgrade_and_current(cli):
    upgraded = cli("db", "upgrade")
    assert upgraded.exit_code == 0, upgraded.output
    head = _head_revision()
    assert upgraded.stdout == f"database at revision {head}\n"
    current = cli("db", "current")
    assert current.exit_code == 0, current.output
    assert current.stdout == f"{head}\n"


def test_db_downgrade_to_base_and_back(cli):
    down = cli("db", "downgrade", "base")
    assert down.exit_code == 0, down.output
    assert down.stdout == "database at revision None\n"
    assert cli("db", "current").stdout == "empty (no migrations applied)\n"
    assert cli("db", "upgrade").stdout == f"database at revision {_head_revision()}\n"
    assert cli("db", "current").stdout == f"{_head_revision()}\n"


# --- ingest ------------------------------------------------------------------------


def test_ingest_azure2021_sample_then_list_models(cli, engine):
    expected = azure2021_expected()
    assert (expected["invocations"], expected["models"]) == (199, 31)  # as the data README says

    result = cli("ingest", "trace", str(sample_path(AZURE2021_EXCERPT)), "--register")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["duplicate"] is False
    assert isinstance(summary["batch_id"], int)
    assert {k: summary[k] for k in expected} == expected
    assert summary["covered_steps"] == 31 * 21

    listed = cli("models", "list", "--json")
    assert listed.exit_code == 0, listed.output
    models = [json.loads(line) for line in listed.stdout.splitlines()]
    assert len(models) == expected["models"]
    assert sorted(m["id"] for m in models) == sorted(pd.read_csv(sample_path(AZURE2021_EXCERPT))["func"].unique())
    assert all(m["labels"] == {"registered_by": "trace:azure2021"} and m["gpus_per_replica"] == 1 for m in models)

    counts = table_counts(engine)
    assert counts == {"serving_models": 31, "invocations": expected["rows_written"], "coverage": 31,
                      "ingest_batches": 1}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT sum(count) FROM invocations")).scalar() == 199

    again = cli("ingest", "trace", str(sample_path(AZURE2021_EXCERPT)), "--register")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["duplicate"] is True
    assert table_counts(engine) == counts


def test_models_list_plain_output(cli):
    cli("models", "register", "m1", "--image-ref", "reg/m1:1", "--gpus-per-replica", "2")
    listed = cli("models", "list")
    assert listed.exit_code == 0, listed.output
    assert listed.stdout == "m1\treg/m1:1\t-\tgpus=2\n"
    assert listed.stderr == "1 models\n"


def test_ingest_without_register_rejects_unknown_models(cli, engine):
    result = cli("ingest", "trace", str(sample_path(AZURE2021_EXCERPT)))
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ")
    assert "unknown" in result.stderr or "not registered" in result.stderr
    assert table_counts(engine) == {"serving_models": 0, "invocations": 0, "coverage": 0, "ingest_batches": 0}


def test_ingest_malformed_csv_exits_2_and_writes_nothing(cli, engine, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(
        "unique_id,ds,y\n"
        "m1,2024-01-01T00:00:00Z,3\n"
        "m2,2024-01-01T00:00:00Z,1\n"
        "m1,2024-01-01T00:01:00Z,-2\n"
    )
    result = cli("ingest", "trace", str(path), "--register")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: {path}: row 3, field 'y': count is negative: ")
    assert table_counts(engine) == {"serving_models": 0, "invocations": 0, "coverage": 0, "ingest_batches": 0}


def test_ingest_error_shows_the_value_as_written(cli, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("unique_id,ds,y\nm1,2024-01-01T00:00:00Z,-2\n")
    result = cli("ingest", "trace", str(path), "--register")
    assert result.stderr == f"error: {path}: row 1, field 'y': count is negative: -2\n"


def test_ingest_missing_file_is_a_usage_error(cli):
    result = cli("ingest", "trace", "/nonexistent/trace.csv")
    assert result.exit_code == 2
    assert "does not exist" in result.stderr


# --- demo --------------------------------------------------------------------------


def test_demo_ingests_once(cli, engine):
    first = cli("demo", "--summary-only", "--top", "3")
    assert first.exit_code == 0, first.output
    lines = first.stdout.splitlines()
    assert lines[0] == (f"ingested {AZURE2019_TOP100}: 100 models, 662,115 invocations, 144,000 model-steps "
                        "covered; 114,269 non-zero rows written")
    assert lines[1] == "window 2019-07-15 00:00 .. 2019-07-16 00:00 UTC"
    assert "... and 97 more models" in lines
    assert lines[-1].startswith("all models: 662,115 invocations; ")
    assert table_counts(engine) == {"serving_models": 100, "invocations": 114_269, "coverage": 100,
                                    "ingest_batches": 1}

    second = cli("demo", "--summary-only", "--top", "3")
    assert second.exit_code == 0, second.output
    assert second.stdout.splitlines()[0] == (
        f"ingested {AZURE2019_TOP100}: 100 models, 662,115 invocations, 144,000 model-steps covered; "
        "already in the store (no change)")
    assert second.stdout.splitlines()[1:] == lines[1:]
    assert table_counts(engine)["ingest_batches"] == 1


# --- models register --------------------------------------------------------------------


def test_models_register(cli, engine):
    result = cli("models", "register", "m1", "--replica-rps", "12.5", "--cold-start-slo-s", "30",
                 "--burst-factor", "2.5")
    assert result.exit_code == 0, result.output
    assert result.stdout == "created m1\n"
    listed = [json.loads(line) for line in cli("models", "list", "--json").stdout.splitlines()]
    assert listed == [{"id": "m1", "image_ref": None, "weights_uri": None, "gpus_per_replica": 1,
                       "replica_rps": 12.5, "cold_start_slo_s": 30.0, "burst_factor": 2.5, "labels": {}}]


def _full_spec_model(engine, model_id="llama-70b"):
    """A model set up as over the API: every column given, two labels, a burst factor."""
    from forecaster.store.catalog import ServingModelSpec, upsert_models

    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(
            id=model_id, image_ref="vllm/vllm-openai:v0.6.0", image_size_bytes=9_000_000_000,
            weights_uri="s3://m/llama-70b", weights_size_bytes=140_000_000_000, gpus_per_replica=4, replica_rps=2.5,
            cold_start_slo_s=60.0, burst_factor=2.0,
            labels={"cold_cost": "5", "prometheus_query": "sum(rate(x[1m]))*60"})])


def _model_row(engine, model_id="llama-70b") -> dict:
    with engine.connect() as conn:
        return dict(conn.execute(text(
            "SELECT image_ref, image_size_bytes, weights_uri, weights_size_bytes, gpus_per_replica, replica_rps, "
            "cold_start_slo_s, burst_factor, labels FROM serving_models WHERE id = :id"), {"id": model_id}).one()._mapping)


def test_models_register_on_a_registered_model_changes_only_the_options_given(cli, engine):
    """Issue: ``models register ID --image-ref NEW`` rebuilt the whole spec from the option defaults and wrote every
    column: GPUs 4 -> 1, the rate, sizes, SLO, burst factor and labels wiped, exit 0."""
    _full_spec_model(engine)
    before = _model_row(engine)
    result = cli("models", "register", "llama-70b", "--image-ref", "vllm/vllm-openai:v0.6.1")
    assert result.exit_code == 0, result.output
    assert result.stdout == "updated llama-70b: image_ref (the rest kept)\n"
    assert _model_row(engine) == {**before, "image_ref": "vllm/vllm-openai:v0.6.1"}

    result = cli("models", "register", "llama-70b", "--gpus-per-replica", "8", "--label", "team=search",
                 "--label", "cold_cost=7.5")
    assert result.exit_code == 0, result.output
    assert result.stdout == "updated llama-70b: gpus_per_replica, labels (the rest kept)\n"
    assert _model_row(engine) == {**before, "image_ref": "vllm/vllm-openai:v0.6.1", "gpus_per_replica": 8,
                                  "labels": {"cold_cost": "7.5", "prometheus_query": "sum(rate(x[1m]))*60",
                                             "team": "search"}}

    result = cli("models", "register", "llama-70b")
    assert result.exit_code == 0 and result.stdout == "llama-70b is registered; nothing given, nothing changed\n"
    created = cli("models", "register", "new-model", "--label", "team=x")
    assert created.exit_code == 0 and created.stdout == "created new-model\n"
    assert _model_row(engine, "new-model") == {
        "image_ref": None, "image_size_bytes": None, "weights_uri": None, "weights_size_bytes": None,
        "gpus_per_replica": 1, "replica_rps": None, "cold_start_slo_s": None, "burst_factor": None,
        "labels": {"team": "x"}}


@pytest.mark.parametrize(("label", "expected"), [
    ("cold_cost=-1", "label 'cold_cost' must be a number from 0 to 1e+09"),
    ("cold_cost=nan", "label 'cold_cost' must be a number from 0 to 1e+09"),
    ("cold_cost=abc", "label 'cold_cost' must be a number from 0 to 1e+09"),
    ("k8s_kind=Pod", "label 'k8s_kind' must be one of Deployment, InferenceService"),
    ("catalog=gpt-5", "label 'catalog' must name an entry of the simulator's catalogue"),
    ("noequals", "--label: expected KEY=VALUE"),
])
def test_models_register_refuses_a_label_the_product_cannot_use(cli, engine, label, expected):
    _full_spec_model(engine)
    before = _model_row(engine)
    for model_id in ("llama-70b", "new-model"):
        result = cli("models", "register", model_id, "--label", label)
        assert result.exit_code == 2 and expected in result.stderr, result.output
        assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1
    assert _model_row(engine) == before and table_counts(engine)["serving_models"] == 1


def test_models_register_rejects_zero_rps(cli, engine):
    result = cli("models", "register", "m1", "--replica-rps", "0")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == "error: replica_rps must be > 0, got 0.0\n"
    assert table_counts(engine)["serving_models"] == 0


# --- settings errors ---------------------------------------------------------------------


def test_non_postgres_database_url_exits_2(runner):
    result = runner.invoke(app, ["db", "current"], env={"DATABASE_URL": "mysql://x"})
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: invalid settings: ")
    assert "DATABASE_URL='mysql://x': " in result.stderr
    assert "must be a PostgreSQL URL" in result.stderr


def test_bad_database_url_names_the_variable_exactly(runner):
    result = runner.invoke(app, ["db", "current"], env={"DATABASE_URL": "mysql://x"})
    assert result.stderr.startswith("error: invalid settings: DATABASE_URL='mysql://x': ")


def test_database_url_with_a_raw_special_character_in_the_password_exits_2_in_one_line(runner):
    """Before, 'invalid literal for int()' came with a traceback; the message names DATABASE_URL, not the password."""
    result = runner.invoke(app, ["db", "current"],
                           env={"DATABASE_URL": "postgresql://pw:p@ss:w/rd%#?x@127.0.0.1:55432/pwdb"})
    assert result.exit_code == 2
    assert result.stderr.startswith("error: invalid settings: DATABASE_URL='postgresql://pw:***@127.0.0.1:55432/pwdb': ")
    assert "percent-encode" in result.stderr
    assert "ss:w/rd" not in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_unsupported_driver_in_database_url_is_shown_without_its_password(runner):
    result = runner.invoke(app, ["db", "current"],
                           env={"DATABASE_URL": "postgresql+asyncpg://pw:S3cretPassw0rd@127.0.0.1:55432/pwdb"})
    assert result.exit_code == 2
    assert "S3cretPassw0rd" not in result.stderr and "pw:***@127.0.0.1" in result.stderr


def test_a_wrong_database_password_exits_3_at_once_saying_so(runner, password_postgres):
    """It was retried until PREWARM_DB_WAIT_TIMEOUT_S and reported as 'did not answer'."""
    import time

    started = time.monotonic()
    result = runner.invoke(app, ["db", "current"], env={"DATABASE_URL": password_postgres.url(password="Wr0ng"),
                                                        "PREWARM_DB_WAIT_TIMEOUT_S": "10"})
    assert result.exit_code == 3
    assert time.monotonic() - started < 5
    assert result.stderr.startswith("error: database postgresql+psycopg://postgres:***@127.0.0.1:")
    assert "refused the connection, authentication failed" in result.stderr and "Wr0ng" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_negative_future_skew_exits_2(cli):
    result = cli("db", "current", PREWARM_MAX_FUTURE_SKEW_S="-1")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: invalid settings: PREWARM_MAX_FUTURE_SKEW_S='-1': ")
    assert "greater than or equal to 0" in result.stderr


def test_a_cross_field_settings_error_prints_no_secret(runner):
    """It printed PREWARM_SETTINGS={...}: the whole input, database password, agent token and S3 key in clear."""
    result = runner.invoke(app, ["db", "current"], env={
        "DATABASE_URL": "postgresql://prewarm:Db-Passw0rd-XYZ@db.internal:5432/prewarm",
        "PREWARM_AGENT_TOKEN": "agent-token-SECRET-123", "PREWARM_AGENT_S3_SECRET_ACCESS_KEY": "s3-SECRET-KEY-456",
        "PREWARM_PLANS_RETENTION_DAYS": "1"})
    assert result.exit_code == 2
    assert result.stderr.startswith("error: invalid settings: Value error, PREWARM_PLANS_RETENTION_DAYS=1 would delete")
    for secret in ("Db-Passw0rd-XYZ", "agent-token-SECRET-123", "s3-SECRET-KEY-456", "PREWARM_SETTINGS="):
        assert secret not in result.output
    assert result.stderr.count("\n") == 1


def test_a_misspelt_setting_name_is_printed_with_the_nearest_one(runner, tmp_path):
    """PREWARM_ACTUATOR_KILLSWITCH=true (for _KILL_SWITCH) was ignored without a word."""
    env_file = tmp_path / "prewarm.env"
    env_file.write_text("PREWARM_PLANNER_GPU_BUGET=4\n")
    result = runner.invoke(app, ["db", "current"], env={
        "PREWARM_ACTUATOR_KILLSWITCH": "true", "PREWARM_SETTINGS_FILE": str(env_file),
        "PREWARM_PLANS_RETENTION_DAYS": "1"})  # and an invalid one, so that no database is needed to see the warning
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == ("warning: PREWARM_ACTUATOR_KILLSWITCH (in the environment) is not a setting and is ignored; "
                        "did you mean PREWARM_ACTUATOR_KILL_SWITCH?")
    assert lines[1].startswith("warning: PREWARM_PLANNER_GPU_BUGET (in the settings file ")
    assert lines[1].endswith("did you mean PREWARM_PLANNER_GPU_BUDGET?")
    assert lines[2].startswith("error: invalid settings: ")


def test_an_empty_api_host_exits_2_naming_it(runner):
    # an unreachable database: were the host taken, serve would stop there (exit 3) instead of listening
    result = runner.invoke(app, ["serve", "--no-scheduler"], env={
        "PREWARM_API_HOST": "", "DATABASE_URL": "postgresql://u@127.0.0.1:1/x", "PREWARM_DB_WAIT_TIMEOUT_S": "1"})
    assert result.exit_code == 2
    assert result.stderr.startswith("error: invalid settings: PREWARM_API_HOST='': ")


def test_missing_settings_file_exits_2(cli, tmp_path):
    missing = tmp_path / "nope.env"
    result = cli("db", "current", PREWARM_SETTINGS_FILE=str(missing))
    assert result.exit_code == 2
    assert result.stderr == f"error: PREWARM_SETTINGS_FILE={str(missing)!r}: no such file\n"


def test_demo_loop_trains_forecasts_plans_and_records_actions(cli, engine):
    result = cli("demo", "--replay-minutes", "3", "--speed", "0", "--no-serve", "--members", "fallback")
    assert result.exit_code == 0, result.output
    assert "replay done: 3 minutes" in result.stdout
    with engine.connect() as conn:
        champion = conn.execute(text("SELECT count(*) FROM model_versions WHERE status = 'champion' "
                                     "AND kind = 'forecast'")).scalar()
        latency = conn.execute(text("SELECT count(*) FROM model_versions WHERE status = 'champion' "
                                    "AND kind = 'latency'")).scalar()
        issued = conn.execute(text("SELECT count(DISTINCT issued_at), count(DISTINCT model_id) FROM forecasts")).one()
        plans = conn.execute(text("SELECT count(*) FROM plans")).scalar()
        replayed = conn.execute(text("SELECT count(*) FROM ingest_batches WHERE source = 'demo-replay'")).scalar()
    assert champion == 1 and tuple(issued) == (3, 100) and plans == 3 and replayed == 3
    assert latency == 1  # the retrain trained the latency model too


def test_demo_trains_again_when_the_champions_artefacts_are_gone(cli, engine):
    """The embedded database outlives a deleted checkout whose models/ held the champion: no crash, a new one."""
    args = ("demo", "--replay-minutes", "1", "--speed", "0", "--no-serve", "--members", "fallback")
    assert cli(*args).exit_code == 0
    with engine.connect() as conn:
        old_id, old_path = conn.execute(text("SELECT id, path FROM model_versions WHERE status = 'champion' "
                                             "AND kind = 'forecast'")).one()
    shutil.rmtree(old_path)
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert f"the champion {old_id} has no artefacts" in result.stdout
    with engine.connect() as conn:
        statuses = dict(conn.execute(text("SELECT id, status FROM model_versions WHERE kind = 'forecast'")).all())
    assert statuses[old_id] == "failed"
    assert [v for v, status in statuses.items() if status == "champion"] != [old_id]
    assert list(statuses.values()).count("champion") == 1


def test_demo_trains_again_when_another_version_of_the_code_trained_the_champion(cli, engine):
    """The data dir outlives checkouts: a champion trained by other code is retired and trained again, so the
    demo replays this checkout's forecasts; one this checkout trained is used as it is."""
    args = ("demo", "--replay-minutes", "1", "--speed", "0", "--no-serve", "--members", "fallback")
    assert cli(*args).exit_code == 0
    with engine.connect() as conn:
        first = conn.execute(text("SELECT id FROM model_versions WHERE status = 'champion' AND kind = 'forecast'"
                                  )).scalar()
    again = cli(*args)
    assert again.exit_code == 0 and f"forecasting with the champion {first}" in again.stdout
    with engine.begin() as conn:
        conn.execute(text("UPDATE model_versions SET code_version = '0.0.1+0ld' WHERE id = :id"), {"id": first})
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert f"the champion {first} was trained by 0.0.1+0ld" in result.stdout
    with engine.connect() as conn:
        statuses = dict(conn.execute(text("SELECT id, status FROM model_versions WHERE kind = 'forecast'")).all())
    assert statuses[first] == "retired" and list(statuses.values()).count("champion") == 1


# --- errors at the edge: one line, the file or option, exit code 2 ------------------------


def _truncated_gzip(tmp_path):
    """The shipped gzipped sample cut in half, as a copy that broke off mid-transfer."""
    path = tmp_path / "truncated.csv.gz"
    whole = sample_path(AZURE2019_TOP100).read_bytes()
    assert whole[:2] == b"\x1f\x8b"  # gzip
    path.write_bytes(whole[: len(whole) // 2])
    return path


@pytest.mark.parametrize("case", ["truncated-gzip", "header-only", "mistyped-format", "start-year-1",
                                  "start-a-word", "bad-model-id"])
def test_ingest_trace_errors_are_one_line_exit_2_and_write_nothing(cli, engine, tmp_path, case):
    header_only = tmp_path / "header.csv"
    import gzip

    header_only.write_text(gzip.decompress(sample_path(AZURE2019_TOP100).read_bytes()).decode().splitlines()[0] + "\n")
    path, extra, expected = {
        "truncated-gzip": (_truncated_gzip(tmp_path), [], "cannot read the file (EOFError"),
        "header-only": (header_only, [], "no data rows (header only?); nothing was ingested"),
        "mistyped-format": (header_only, ["--format", "azure2091"], "unknown trace format 'azure2091'"),
        "start-year-1": (header_only, ["--start", "0001-01-01"], "--start: 0001-01-01"),
        "start-a-word": (header_only, ["--start", "yesterday"], "--start"),
        "bad-model-id": (header_only, ["--model-id", "a\x01b"], "--model-id: contains the control character U+0001"),
    }[case]
    result = cli("ingest", "trace", str(path), "--register", *extra)
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, (ValueError, EOFError))
    if case not in ("start-a-word",):  # typer's own usage error names the option in its box
        lines = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and (str(path) in lines[0] or "--" in lines[0])
    assert table_counts(engine) == {"serving_models": 0, "invocations": 0, "coverage": 0, "ingest_batches": 0}


@pytest.mark.parametrize(("args", "expected"), [
    (["a\x00b"], "model id contains the control character U+0000"),
    (["llama", "--replica-rps", "1e-300"], "replica_rps must be in [0.001, 1e+06], got 1e-300"),
    (["llama", "--replica-rps", "inf"], "replica_rps must be finite"),
    (["llama", "--image-size-bytes", str(2**70)], "image_size_bytes must be in [0, 1.1259e+15]"),
    (["llama", "--cold-start-slo-s", "1e9"], "cold_start_slo_s must be in"),
])
def test_models_register_refuses_values_out_of_bounds(cli, engine, args, expected):
    result = cli("models", "register", *args)
    assert result.exit_code == 2 and expected in result.output, result.output
    assert table_counts(engine)["serving_models"] == 0


# --- the demo's replay onto a simulated cluster -------------------------------------------------------------


@pytest.fixture
def small_trace(tmp_path):
    """The shipped Azure 2019 sample cut to its first five functions (same format, same day)."""
    frame = pd.read_csv(sample_path(AZURE2019_TOP100))
    path = tmp_path / "azure2019_five.csv"
    frame.head(5).to_csv(path, index=False)
    return path


def test_demo_replay_acts_on_a_simulated_cluster_and_serves_the_comparison(engine, settings, small_trace):
    """The plan job's actuator drives the simulator: actions succeed there, its replica starts become cold-start
    rows, and the API serves per model exactly what the simulators measured (the reactive side checked against
    an independent one-shot run of the same requests)."""
    from dataclasses import replace

    from fastapi.testclient import TestClient

    from api.main import create_app
    from forecaster.demo import (COLD_START_SOURCE, DEMO_CLUSTER, WARMUP_MIN, SimClock, demo_workload,
                                 per_model_outcomes, run_loop)
    from forecaster.ingest.traces import read_trace
    from forecaster.simulation.catalog import assign_models
    from forecaster.simulation.engine import FleetSimulator
    from forecaster.simulation.policies import KnativePolicy
    from forecaster.store.tokens import create_token

    minutes = 12
    clock = SimClock(pd.Timestamp("2019-07-15", tz="UTC").to_pydatetime())
    summary = run_loop(engine, settings, clock=clock, trace=small_trace, replay_minutes=minutes, speed=0,
                       members=["fallback"], echo=lambda line: None)
    assert summary["replayed_minutes"] == minutes
    split = pd.Timestamp("2019-07-15 18:00", tz="UTC")
    with engine.connect() as conn:
        scaled = conn.execute(text(
            "SELECT count(*) FROM actions WHERE backend = 'simulated' AND kind = 'scale' AND status = 'succeeded' "
            "AND detail ? 'guardrails'")).scalar()
        unfinished_dry_run = conn.execute(text("SELECT count(*) FROM actions WHERE backend <> 'simulated'")).scalar()
        cold = conn.execute(text("SELECT count(*), count(DISTINCT model_id), min(started_at), max(started_at) "
                                 "FROM cold_starts WHERE source = :s"), {"s": COLD_START_SOURCE}).one()
        node_cache = conn.execute(text("SELECT count(*) FROM node_cache WHERE node_id LIKE 'node-%'")).scalar()
    assert scaled > 0 and unfinished_dry_run == 0
    assert cold[0] == summary["cold_starts_stored"] > 0 and cold[1] >= 1
    assert split - pd.Timedelta(minutes=WARMUP_MIN) <= cold[2] and cold[3] < split + pd.Timedelta(minutes=minutes)
    assert node_cache > 0  # the simulated nodes reported what they hold
    assert summary["action_statuses"].get("succeeded", 0) >= scaled

    token = create_token(engine, name="t", scopes=["read"])
    with TestClient(create_app(settings, engine, clock=clock)) as client:
        body = client.get("/v1/replays/latest", headers={"Authorization": f"Bearer {token}"}).json()
        one = client.get("/v1/replays/latest", params={"model_id": body["data"][0]["model_id"]},
                         headers={"Authorization": f"Bearer {token}"}).json()
    info = body["replay"]
    assert (info["subject"], info["baseline"]) == ("prewarm", "reactive")
    assert pd.Timestamp(info["window_start"]) == split and pd.Timestamp(info["scored_until"]) == clock()
    assert body["count"] == 5 and one["count"] == 1 and one["data"][0] == body["data"][0]
    for policy in ("prewarm", "reactive"):
        served = {r["model_id"]: r[policy] for r in body["data"]}
        measured = {r["model_id"]: r for r in summary["outcomes"][policy]}
        assert served.keys() == measured.keys()
        for model_id, figures in served.items():
            assert figures == pytest.approx({k: v for k, v in measured[model_id].items() if k != "model_id"})
        assert info["totals"][policy]["cold_requests"] == summary["totals"][policy]["cold_requests"]
        assert info["totals"][policy]["requests"] == summary["totals"][policy]["requests"] > 0
    for row in body["data"]:
        assert row["reactive"]["cold_requests"] >= 0
        assert row["cold_requests_avoided"] == row["reactive"]["cold_requests"] - row["prewarm"]["cold_requests"]
        assert row["wait_saved_s"] == pytest.approx(row["reactive"]["wait_total_s"] - row["prewarm"]["wait_total_s"])

    # The reactive side, stepped minute by minute beside the demo, is the simulator's own one-shot run.
    raw = read_trace(small_trace).raw
    counts = pd.DataFrame({"unique_id": raw["unique_id"].astype(str), "ds": raw["ds"], "y": raw["y"]})
    totals = counts.groupby("unique_id")["y"].sum()
    models = assign_models(totals.index.to_numpy(), order_by=totals.to_numpy())
    ids = np.asarray(sorted(models.index.astype(str)), dtype=object)
    start = split - pd.Timedelta(minutes=WARMUP_MIN)
    workload = demo_workload(counts, ids, start=start, minutes=WARMUP_MIN + minutes)
    config = replace(DEMO_CLUSTER, score_from_s=60.0 * WARMUP_MIN)
    alone = per_model_outcomes(FleetSimulator(workload, models.loc[ids], KnativePolicy(), config).run(),
                               config.score_from_s)
    served = {r["model_id"]: r["reactive"] for r in body["data"]}
    for row in alone:
        assert served[row["model_id"]] == pytest.approx({k: v for k, v in row.items() if k != "model_id"})


def test_replays_endpoint_without_a_replay_is_empty(engine, settings):
    from fastapi.testclient import TestClient

    from api.main import create_app
    from forecaster.store.tokens import create_token

    token = create_token(engine, name="t", scopes=["read"])
    with TestClient(create_app(settings, engine)) as client:
        response = client.get("/v1/replays/latest", headers={"Authorization": f"Bearer {token}"})
        unauthorised = client.get("/v1/replays/latest")
    assert response.status_code == 200 and response.json() == {"replay": None, "count": 0, "data": []}
    assert unauthorised.status_code == 401


def test_serve_stopped_by_sigterm_stops_the_embedded_database_it_started(tmp_path):
    """kill / systemd / docker stop: the embedded PostgreSQL goes down with prewarm instead of being orphaned."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx
    import psutil

    from tests.runtime_fixtures import wait_until

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_") and k != "DATABASE_URL"}
    env["PREWARM_DATA_DIR"] = str(data)
    server = subprocess.Popen([sys.executable, "-m", "forecaster.cli", "serve", "--no-scheduler", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def postgres() -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            try:
                if str(data) in " ".join(process.info["cmdline"] or []) and "postgres" in process.name():
                    found.append(process)
            except psutil.Error:
                pass
        return found

    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200,
                   timeout=120, what="prewarm serve", proc=server)
        assert postgres(), "serve did not start an embedded PostgreSQL"
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        deadline = time.monotonic() + 30
        while postgres() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not postgres(), "the embedded PostgreSQL outlived prewarm serve"
    finally:
        if server.poll() is None:
            server.kill()
        for process in postgres():
            process.send_signal(signal.SIGINT)


def test_demo_replay_run_again_on_the_same_store_reads_the_same(engine, settings, tmp_path):
    """The embedded database outlives a demo run: a second run of the same window clears what the first left
    (its actions planned ahead of the window's end included), so it plans, acts and counts exactly the same."""
    from forecaster.demo import SimClock, run_loop

    trace = tmp_path / "azure2019_thirty.csv"
    pd.read_csv(sample_path(AZURE2019_TOP100)).head(30).to_csv(trace, index=False)

    def once() -> dict:
        clock = SimClock(pd.Timestamp("2019-07-15", tz="UTC").to_pydatetime())
        return run_loop(engine, settings, clock=clock, trace=trace, replay_minutes=12, speed=0,
                        members=["fallback"], echo=lambda line: None)

    first, second = once(), once()
    assert second["totals"] == first["totals"]
    assert second["action_statuses"] == first["action_statuses"]
    assert (second["actions"], second["cold_starts_stored"]) == (first["actions"], first["cold_starts_stored"])
    with engine.connect() as conn:
        pending_after = conn.execute(text("SELECT count(*) FROM actions WHERE status = 'pending'")).scalar()
    assert pending_after == first["action_statuses"].get("pending", 0)


def test_a_signal_while_the_demo_serves_leaves_the_api_thread_to_be_joined():
    """SIGTERM while `prewarm demo` serves raises in the main thread as it waits for the API's thread: the wait
    ends, and the thread still counts as running, so the demo's next join waits for the API to shut down before
    the database stops (an interrupted ``Thread.join()`` marked it stopped: the database went first)."""
    import signal
    import threading

    from forecaster.cli import wait_for_thread

    release = threading.Event()
    api = threading.Thread(target=release.wait, args=(30,), daemon=True)
    api.start()

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGALRM, terminate)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(SystemExit):
            wait_for_thread(api, poll_s=0.05)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert api.is_alive()
    release.set()
    api.join(timeout=5)
    assert not api.is_alive()


# --- ports and output paths, checked before anything runs ----------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["serve", "--no-scheduler", "--port", "70000"],  # listened on 70000 mod 65536 = 4464, announcing :70000
    ["serve", "--no-scheduler", "--port", "0"],  # `port or settings.api_port`: bound 8080
    ["serve", "--no-scheduler", "--port", "-1"],
    ["demo", "--port", "70000"],
    ["agent", "--port", "0"],
])
def test_a_port_out_of_range_is_refused_before_anything_listens(cli, monkeypatch, args):
    import uvicorn

    import forecaster.demo

    listened = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: listened.append(kw.get("port")))
    monkeypatch.setattr(forecaster.demo, "run_loop", lambda *a, **kw: listened.append("demo"))
    monkeypatch.setattr(os, "execv", lambda *a: listened.append("agent"))  # the agent execs its own process
    result = cli(*args, PREWARM_AGENT_TOKEN="agent-secret")
    assert result.exit_code == 2, result.output
    assert "--port" in result.output and listened == []


@pytest.fixture
def taken_port():
    """A port some other process listens on."""
    import socket

    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _fake_replay(monkeypatch, during_ready=lambda clock: None):
    """Stand in for the demo's ingest, training and replay (minutes): call ``on_ready`` as the real loop does."""
    import forecaster.demo

    calls = []

    def run_loop(engine, settings, *, clock, on_ready=None, **kwargs):
        calls.append("run_loop")
        during_ready(clock)
        if on_ready is not None:
            on_ready(clock)
            calls.append("served")
        return {"replayed_minutes": 0, "forecast_rows": 0, "actions": 0, "cold_starts_stored": 0, "totals": {},
                "action_statuses": {}}

    monkeypatch.setattr(forecaster.demo, "run_loop", run_loop)
    monkeypatch.setattr(forecaster.demo, "format_comparison", lambda totals, statuses: [])
    return calls


def test_demo_with_its_port_taken_exits_before_the_replay(cli, monkeypatch, taken_port):
    """Issue: the API thread died on the bind error and the demo printed the dashboard URL and token anyway and
    exited 0; nothing it printed answered."""
    calls = _fake_replay(monkeypatch)
    result = cli("demo", "--port", str(taken_port), "--exit-when-done")
    assert result.exit_code == 3, result.output
    assert f"demo: cannot listen on 127.0.0.1:{taken_port} (address already in use)" in result.stderr
    assert "dashboard" not in result.output and calls == []


def test_demo_prints_the_dashboard_only_once_its_api_listens(cli, monkeypatch):
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    holder = socket.socket()
    taken_meanwhile = _fake_replay(monkeypatch, during_ready=lambda clock: (
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1), holder.bind(("127.0.0.1", port)),
        holder.listen()))
    try:  # the port is taken after the check at the start, while the demo trains: the API cannot listen
        result = cli("demo", "--port", str(port), "--exit-when-done")
    finally:
        holder.close()
    assert result.exit_code == 3, result.output
    assert f"demo: the API did not start listening on 127.0.0.1:{port}" in result.stderr
    assert "address already in use" in result.stderr
    assert "dashboard" not in result.output and taken_meanwhile == ["run_loop"]

    answered = []
    calls = _fake_replay(monkeypatch)
    import forecaster.demo

    real = forecaster.demo.run_loop

    def run_loop_then_ask(*args, **kwargs):
        summary = real(*args, **kwargs)
        answered.append(httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code)
        return summary

    monkeypatch.setattr(forecaster.demo, "run_loop", run_loop_then_ask)
    result = cli("demo", "--port", str(port), "--exit-when-done")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"dashboard: http://127.0.0.1:{port}/dashboard/#token=pw_")
    assert calls == ["run_loop", "served"] and answered == [200]


@pytest.mark.parametrize("option", ["--out", "--json"])
def test_report_checks_its_output_folders_before_the_replay(cli, engine, monkeypatch, tmp_path, option):
    """Issue: ``report --out missing/dir/x.html`` ran the whole replay, then failed with FileNotFoundError; a bad
    ``--json`` failed after the HTML was written."""
    import forecaster.report.history

    read = []
    monkeypatch.setattr(forecaster.report.history, "load_history", lambda *a, **kw: read.append(1) or 1 / 0)
    html = tmp_path / "report.html"
    missing = tmp_path / "no" / "such"
    paths = {"--out": str(missing / "r.html"), "--json": str(tmp_path / "r.json")}
    if option == "--json":
        paths = {"--out": str(html), "--json": str(missing / "r.json")}
    result = cli("report", "--since", "30m", "--out", paths["--out"], "--json", paths["--json"])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {option} {paths[option]}: the folder {missing} does not exist\n"
    assert read == [] and not html.exists()
    folder = cli("report", "--out", str(tmp_path))
    assert folder.exit_code == 2 and "--out" in folder.output
