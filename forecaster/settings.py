"""One validated settings object for the whole service.

Values come from environment variables with the ``PREWARM_`` prefix (the
database also from the conventional ``DATABASE_URL``), optionally from a
dotenv-style file named by ``PREWARM_SETTINGS_FILE``. Settings are loaded once
at the edge (CLI, service start-up) and passed inward; domain code never reads
the environment itself.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import platformdirs
from pydantic import AliasChoices, Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger(__name__)


#: Upper bounds shared by several settings: each keeps the datetime, timedelta and SQL arithmetic the setting feeds
#: finite (datetime.max is 9999-12-31; 1,000,000 days overflowed the retention jobs every slot).
MAX_DAYS = 36_500  # retention ages, days: a hundred years
MAX_GPUS = 10_000_000  # GPU counts and budgets
MAX_BYTES = 1 << 60  # byte budgets (1 EiB), well inside a signed 64-bit integer
MAX_FUTURE_SKEW_S = 366 * 86_400  # how far ahead of now an ingested timestamp may be
#: PostgreSQL's lock_timeout takes at most 2,147,483,647 ms (INT_MAX); a pushed batch sets it from this in ms.
MAX_PUSH_LOCK_TIMEOUT_S = 2_147_483

#: Most ``prewarm serve`` worker processes (``PREWARM_API_WORKERS``), and most that 'auto' picks.
MAX_API_WORKERS = 64
AUTO_API_WORKERS_MAX = 8

PLACEHOLDER_SECRETS = frozenset({"", "changethis", "changeme", "secret", "token"})

#: Action kinds each single actuator backend can carry out: what ``PREWARM_ACTUATOR_ROUTES`` is checked against.
#: The backends declare the same sets as their ``actions`` attribute (``tests/test_composite_actuator.py`` holds
#: the two together); they live here too because settings sit below the actuation package.
BACKEND_ACTIONS: dict[str, frozenset[str]] = {
    "dry-run": frozenset({"prepull", "preload", "scale", "release"}),
    "agent": frozenset({"prepull", "preload"}),
    "kubernetes": frozenset({"prepull", "scale", "release"}),
}
ACTION_KINDS = ("prepull", "preload", "scale", "release")
#: The forecast ensemble's member families (issue 3's five), in the order the ensemble fits them: what
#: ``PREWARM_FORECAST_MEMBERS`` is checked against and ``bench/accuracy.py --select`` draws member sets from.
MEMBER_FAMILIES = ("lightgbm", "xgboost", "random_forest", "arima", "lstm")


def member_families(value: str | Sequence[str]) -> tuple[str, ...]:
    """Member family names (a comma list or a sequence) in :data:`MEMBER_FAMILIES` order.

    Raises ``ValueError`` naming what is wrong: an unknown family, one named twice, or none at all."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    names = [str(p).strip() for p in parts if str(p).strip()]
    unknown = sorted({n for n in names if n not in MEMBER_FAMILIES})
    if unknown:
        raise ValueError(f"unknown member families {unknown}; expected some of {', '.join(MEMBER_FAMILIES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a member family is named twice: {', '.join(names)}")
    if not names:
        raise ValueError(f"at least one member family is needed, of {', '.join(MEMBER_FAMILIES)}")
    return tuple(f for f in MEMBER_FAMILIES if f in names)


def parse_actuator_routes(value: str | None) -> dict[str, str]:
    """``scale=kubernetes,release=kubernetes,prepull=agent,preload=agent`` as {action kind: backend}.

    Kinds not named go to ``dry-run``; scale and release must go to the same backend (the one whose
    replica state bounds both). Raises ValueError saying what is wrong with which entry.
    """
    routes = dict.fromkeys(ACTION_KINDS, "dry-run")
    seen: set[str] = set()
    for entry in filter(None, (part.strip() for part in (value or "").split(","))):
        kind, sep, backend = (p.strip() for p in entry.partition("="))
        if not sep or not kind or not backend:
            raise ValueError(f"entry {entry!r} is not KIND=BACKEND (e.g. scale=kubernetes,preload=agent)")
        if kind not in ACTION_KINDS:
            raise ValueError(f"entry {entry!r}: unknown action kind {kind!r}; kinds are {', '.join(ACTION_KINDS)}")
        if backend not in BACKEND_ACTIONS:
            raise ValueError(f"entry {entry!r}: unknown backend {backend!r}; backends are "
                             f"{', '.join(BACKEND_ACTIONS)}")
        if kind in seen:
            raise ValueError(f"action kind {kind!r} is routed twice")
        if kind not in BACKEND_ACTIONS[backend]:
            able = [b for b, kinds in BACKEND_ACTIONS.items() if kind in kinds]
            raise ValueError(f"entry {entry!r}: the {backend} backend cannot {kind}; route it to one of "
                             f"{', '.join(able)}")
        seen.add(kind)
        routes[kind] = backend
    if routes["scale"] != routes["release"]:
        raise ValueError(f"scale ({routes['scale']}) and release ({routes['release']}) must go to the same backend: "
                         "its replica state bounds both")
    return routes


#: The two names of the database URL, the first one set (and not empty) taken.
_DATABASE_URL_NAMES = ("PREWARM_DATABASE_URL", "DATABASE_URL")


class SettingsError(ValueError):
    """Settings could not be loaded; the message names each bad variable and value."""


_URL_SCHEME = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.\-]*://")
_QUERY_PASSWORD = re.compile(r"(?i)\b(password=)[^&\s]*")


def mask_url(url: str) -> str:
    """``url`` with its password shown as ``***``, for messages and logs; any string, parsable or not.

    The user information runs from ``://`` to the *last* ``@``, and its password from the first ``:`` in it: so a
    password written with a raw ``@``, ``:`` or ``/`` is hidden whole. (SQLAlchemy's ``render_as_string(
    hide_password=True)`` parses ``u:p@ss@host`` as password ``p`` on host ``ss@host`` and shows ``ss``; nor does
    it hide a libpq ``?password=`` parameter.) A string without ``://`` has only such parameters masked.
    """
    scheme = _URL_SCHEME.match(url)
    if scheme is not None:
        rest = url[scheme.end():]
        at = rest.rfind("@")
        user, colon, password = rest[:max(at, 0)].partition(":")
        if at >= 0 and colon and password:
            url = f"{url[:scheme.end()]}{user}:***{rest[at:]}"
    return _QUERY_PASSWORD.sub(r"\1***", url)


#: What ``DATABASE_URL``'s errors suggest when the URL does not parse.
_PERCENT_ENCODE_HINT = ("percent-encode special characters in the user name and password (@ as %40, : as %3A, "
                        "/ as %2F, % as %25, # as %23, ? as %3F)")


def _check_database_url(url: str) -> None:
    """Raise ValueError (without the password) when SQLAlchemy cannot parse ``url`` or splits it wrongly."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number ('w' of 'p@ss:w/rd')
        reason = "the port is not a number" if isinstance(exc, ValueError) else "it does not parse"
        raise ValueError(f"is not a valid URL ({reason}): {_PERCENT_ENCODE_HINT}") from None
    if parsed.host is not None and "@" in parsed.host:
        # not the host in the message: it is the rest of a password written with a raw '@'
        raise ValueError(f"is not a valid URL (more than one '@' before the host): {_PERCENT_ENCODE_HINT}")


def _default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("prewarm", appauthor=False))


def _default_traces_dir() -> Path:
    return REPO_ROOT.parent / "shared" / "traces"


class Settings(BaseSettings):
    """Service settings; see README for the full list with defaults."""

    # hide_input_in_errors: str() of a ValidationError from Settings() would show DATABASE_URL with its password;
    # load_settings shows each bad value itself, secrets hidden and URLs masked.
    # allow_inf_nan=False: no float setting takes inf or nan (PREWARM_MAX_FUTURE_SKEW_S=inf made every push a 500).
    model_config = SettingsConfigDict(env_prefix="PREWARM_", extra="ignore", validate_default=True,
                                      hide_input_in_errors=True, allow_inf_nan=False)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The default sources, less empty database URLs: of ``PREWARM_DATABASE_URL`` and ``DATABASE_URL`` the
        first one present is taken, so an empty ``PREWARM_DATABASE_URL=`` (a compose file's blank) hid a real
        ``DATABASE_URL`` and the embedded database was opened instead. An empty one is now as if unset."""
        for source in (env_settings, dotenv_settings):
            if isinstance(source, EnvSettingsSource):  # the dotenv source is one too
                source.env_vars = {name: value for name, value in source.env_vars.items()
                                   if not (name.upper() in _DATABASE_URL_NAMES and not (value or "").strip())}
        return init_settings, env_settings, dotenv_settings, file_secret_settings

    environment: Literal["development", "production"] = "development"

    # --- database -------------------------------------------------------
    database_url: str | None = Field(
        default=None, repr=False,  # it may hold a password
        validation_alias=AliasChoices(*_DATABASE_URL_NAMES),
        description="SQLAlchemy URL of PostgreSQL; unset starts an embedded server under data_dir.",
    )
    data_dir: Path = Field(default_factory=_default_data_dir)
    db_wait_timeout_s: float = Field(default=60.0, gt=0, le=86_400)
    db_retry_attempts: int = Field(default=5, ge=1, le=50)
    db_retry_base_delay_s: float = Field(default=0.5, ge=0, le=60)
    db_migration_lock_timeout_s: float = Field(
        default=3.0, gt=0, le=600,
        description="How long a migration statement waits for a table lock (lock_timeout) before that upgrade "
                    "attempt gives up; the readers of that table queue behind it meanwhile.")
    db_migration_attempts: int = Field(
        default=5, ge=1, le=100,
        description="Upgrade attempts when a table lock cannot be had (2 s, 4 s, 8 s, then 10 s apart).")

    # --- files ----------------------------------------------------------
    models_dir: Path = Field(default=REPO_ROOT / "models")
    traces_dir: Path = Field(default_factory=_default_traces_dir)

    latency_table_files_kept: int = Field(
        default=6, ge=0, le=1000,
        description="Per-node latency tables kept as files under models_dir/latency-tables, so that the plan job, "
                    "the API's workers and restarted processes read an hour's table instead of each computing it "
                    "(about 110 MB and 33-90 s of CPU each at 100,000 models x 64 nodes); 0: none written or read.")
    model_versions_retention_days: int = Field(
        default=2, ge=1, le=3650,
        description="Days a saved model version's files (models_dir/<version>/) are kept: the retention job "
                    "deletes older ones and marks their rows deleted, unless a champion, the last former champion "
                    "or among the newest PREWARM_MODEL_VERSIONS_KEPT of their kind (a nightly forecast version "
                    "pickles its fit panel: about 94 KB per series).")
    model_versions_kept: int = Field(
        default=3, ge=1, le=1000,
        description="Newest model versions of each kind (forecast, latency) kept whatever their age, to roll "
                    "back to.")

    latency_train_days: int = Field(
        default=30, ge=1, le=3650,
        description="Days of cold starts and transfers the latency model's retrain learns from, counted back from "
                    "the newest stored one (so an imported trace's days still train it), or from the retrain's now "
                    "where that is earlier.")
    latency_train_max_events: int = Field(
        default=200_000, ge=100, le=10_000_000,
        description="At most this many of the newest cold starts (and transfers) in a latency retrain: its fit "
                    "takes about 0.17 ms and 2-3 KB per event on 2 cores (200,000: 34 s and 840 MB; all 1,200,000 "
                    "of 120 days: 210 s and 2.6 GB, bench/latency_window.py).")

    # --- ingest ---------------------------------------------------------
    auto_register_models: bool = False
    max_future_skew_s: float = Field(default=300.0, ge=0, le=MAX_FUTURE_SKEW_S)
    partition_days_ahead: int = Field(default=7, ge=1, le=366)
    # Retention of invocations (forecaster.store.retention): whole UTC days before today.
    invocations_minute_days: int = Field(default=7, ge=1, le=MAX_DAYS, description="Days of per-minute counts kept as ingested.")
    invocations_5min_days: int = Field(
        default=35, ge=1, le=MAX_DAYS, description="Days after which 5-minute buckets are rolled up to hourly ones.")
    invocations_retention_days: int = Field(
        default=400, ge=1, le=MAX_DAYS, description="Days after which invocations and their coverage are dropped entirely.")
    retention_interval_s: int = Field(default=3600, ge=60, le=604_800, description="How often the retention job runs.")
    # Retention of plans, actions, job runs, cold starts and transfers (forecaster.store.history_retention).
    plans_retention_days: int = Field(
        default=30, ge=0, le=36_500,
        description="Days of plans and finished actions kept (the audit trail of /v1/plans, /v1/actions and the "
                    "dashboard); older ones are deleted by the retention job, except each model's newest scale or "
                    "release (what it runs and holds ahead) and the plans open or kept actions belong to. About "
                    "360,000 actions a day at 100,000 models. 0: kept forever; else at least 2 (the plan job reads "
                    "the last day's pre-pulls and pre-loads, budget mode a day of plans).")
    cold_starts_retention_days: int = Field(
        default=90, ge=0, le=36_500,
        description="Days of cold starts and transfers kept, counted back from the newest of each; each model's "
                    "newest 20 cold starts stay (its rolling cold-start figures). 0: kept forever; else at least "
                    "PREWARM_LATENCY_TRAIN_DAYS.")
    job_runs_retention_days: int = Field(
        default=30, ge=0, le=36_500,
        description="Days of job runs kept (one row per job and slot, about 5,800 a day); each job's newest finished "
                    "run stays (/metrics reports it). 0: kept forever.")
    error_rollup_delay_s: int = Field(
        default=180, ge=0, le=86_400,
        description="Seconds after a target hour ends before the forecast_errors job scores it: its counts "
                    "ingested and the forecast runs that target it written (the forecast job's own duration).")
    error_rollup_lookback_h: int = Field(
        default=24, ge=1, le=24 * 31,
        description="Hours back the forecast_errors job scores hours never scored and re-scores hours late "
                    "counts touched.")
    error_rollup_retention_days: int = Field(
        default=8, ge=1, le=MAX_DAYS, description="Days of the error rollup kept (the fleet view's longest window is 7 days; "
                                     "about 80 bytes per model, horizon and hour).")

    # --- Prometheus -----------------------------------------------------
    prometheus_url: str | None = None
    #: forecaster.ingest.prometheus.DEFAULT_QUERY_TEMPLATE (exact_count_query of vLLM's request counter), written out
    #: because settings sit below the ingest layer; a test keeps the two equal.
    prometheus_query_template: str = (
        'sum((last_over_time(vllm:request_success_total{{model_name="{model_id}"}}[1m]) - last_over_time('
        'vllm:request_success_total{{model_name="{model_id}"}}[1m] offset 1m)) >= 0 or ((last_over_time('
        'vllm:request_success_total{{model_name="{model_id}"}}[1m]) + clamp_min(max_over_time('
        'vllm:request_success_total{{model_name="{model_id}"}}[1m]) - last_over_time('
        'vllm:request_success_total{{model_name="{model_id}"}}[1m] offset 1m), 0)) and last_over_time('
        'vllm:request_success_total{{model_name="{model_id}"}}[1m] offset 1m)) or ((last_over_time('
        'vllm:request_success_total{{model_name="{model_id}"}}[1m]) - min_over_time('
        'vllm:request_success_total{{model_name="{model_id}"}}[1m])) unless last_over_time('
        'vllm:request_success_total{{model_name="{model_id}"}}[1m] offset 1m)))'
    )
    prometheus_burst_query_template: str | None = Field(
        default=None,
        description="PromQL with {model_id} giving, at t, the most requests of any 10-second bucket of the minute "
                    "before t (example: forecaster.ingest.prometheus.EXAMPLE_BURST_QUERY_TEMPLATE; it needs a "
                    "scrape interval of 5 s or less). Each minute's peak moves the model's burst factor. Unset: only "
                    "models labelled prometheus_burst_query have one read.")
    prometheus_lag_s: int = Field(default=120, ge=0, le=86_400, description="Wait this long before a minute is final.")
    prometheus_backfill_minutes: int = Field(
        default=60, ge=1, le=10_080, description="How far back a model never ingested from Prometheus starts.")
    prometheus_max_catch_up_minutes: int = Field(
        default=21_600, ge=1, le=527_040,
        description="How far back a model with Prometheus coverage is caught up after an outage (prewarm, its "
                    "database or scheduler down): it resumes at the end of its coverage, at most this many minutes "
                    "before now (default 15 days, Prometheus' default retention); older minutes are reported as "
                    "skipped.")
    prometheus_timeout_s: float = Field(default=10.0, gt=0, le=3600)

    # --- API ------------------------------------------------------------
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8080, ge=1, le=65535)
    default_cold_start_s: float = Field(default=45.0, gt=0, le=86_400, description="Lead time when no cold start was observed.")
    recommendation_quantile: float = Field(default=0.9, gt=0, lt=1)
    forecast_fresh_s: float = Field(
        default=180.0, gt=0, le=86_400,
        description="A model's forecast older than this is not served as a replica floor (REST reason "
                    "forecast_stale, KEDA scaler FAILED_PRECONDITION, no gauge sample), and /readyz fails.")
    ingest_retry_after_s: int = Field(default=5, ge=1, le=3600)
    api_snapshot_refresh_s: float = Field(
        default=2.0, ge=0, le=3600, description="How often the API reloads new forecast runs; 0 = on every request.")
    # KEDA external scaler (gRPC, api/keda_scaler.py), served by the API process next to REST when a port is set
    keda_grpc_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="Port of KEDA's external scaler (gRPC) on the address `prewarm serve` binds (--host, else "
                    "PREWARM_API_HOST); unset = not served; 0 = any free port.")
    keda_stream_check_s: float = Field(
        default=5.0, gt=0, le=300,
        description="How often StreamIsActive re-evaluates each model (and picks up a new forecast snapshot).")
    coldstart_metrics_max_models: int = Field(
        default=1000, ge=0, le=100_000,
        description="/metrics cold-start gauges cover at most this many models (those with a forecast, by id).")
    recommendation_metrics: bool = Field(
        default=True,
        description="/metrics carries prewarm_recommended_replicas (two samples per model, for HPA through "
                    "prometheus-adapter); false leaves it out (KEDA or REST only: 14 MB a scrape at 100,000 models).")
    coldstart_metrics_max_age_s: float = Field(
        default=30.0, ge=0, le=3600,
        description="/metrics cold-start gauges are computed at most this often and served from the last "
                    "computation in between (sooner when the models or the UTC hour change); 0 = every scrape.")
    api_workers: int | Literal["auto"] = Field(
        default=1,
        description="Worker processes of `prewarm serve` (1 to 64), each with its own forecast snapshot; 'auto' = "
                    "one per CPU core this process may use, at most 8. /metrics then reports one worker per scrape.")

    # --- scheduler ------------------------------------------------------
    ingest_interval_s: int = Field(default=60, ge=1, le=86_400)
    partition_maintenance_interval_s: int = Field(default=3600, ge=60, le=86_400)
    forecast_interval_s: int = Field(default=60, ge=1, le=86_400)
    forecast_horizon_min: int = Field(default=60, ge=1, le=1440)
    forecast_lookback_min: int = Field(default=1440, ge=60, le=527_040, description="History the forecast job conditions on.")
    forecast_retention_days: int = Field(
        default=2, ge=1, le=MAX_DAYS,
        description="Days of forecast runs kept: whole daily partitions older than this are dropped. The table "
                    "grows by about 1.8 KB per model per minute (60 minutes x point, p_any, 5 quantiles as real).")
    train_window_min: int = Field(default=7 * 1440, ge=240, le=527_040, description="History the nightly retrain learns from.")
    plan_horizon_min: int = Field(default=10, ge=1, le=60, description="Minutes ahead the planner plans.")

    # --- planner costs and limits (forecaster.planning; see PlannerSettings for each) ---
    planner_cold_cost: float = Field(
        default=1.0, ge=0, le=1e9,
        description="GPU-seconds one second of cold-start wait is worth; a model's label cold_cost overrides it.")
    planner_cold_cost_weighting: Literal["model", "request"] = Field(
        default="model",
        description="model: each model's cold cost is scaled by the fleet's mean request rate over its own, so "
                    "every model's share of cold-start requests weighs alike (a per-model cold-start SLO; the "
                    "per-function cold % of the evaluation protocol); request: every request's wait weighs alike "
                    "(fewer cold requests overall, more models left mostly cold). One model: the same.")
    planner_gpu_second_cost: float = Field(default=1.0, gt=0, le=1e9, description="Price of an idle GPU-second.")
    planner_count_queued_wait: bool = Field(
        default=True, description="Charge a cold start for every request queued behind it, not the first only.")
    planner_replica_utilisation: float = Field(default=0.8, gt=0, le=1, description="Share of a replica planned busy.")
    planner_gpu_budget: float | None = Field(
        default=None, ge=0, le=MAX_GPUS, description="GPUs the planner may hold warm; unset: the fleet's less the headroom.")
    planner_gpu_headroom: float = Field(default=0.1, ge=0, lt=1, description="Share of GPUs left to the reactive path.")
    planner_max_transfers_per_node: int = Field(default=2, ge=0, le=1024)
    planner_max_transfers_per_registry: int = Field(default=48, ge=0, le=100_000)
    planner_tiers: bool = Field(default=True, description="Plan pre-pulls and pre-loads (False: scale-ahead only).")
    planner_max_tier_nodes: int = Field(default=8, ge=0, le=100_000, description="Nodes prepared per model at most.")
    planner_max_tier_actions: int = Field(default=64, ge=0, le=1_000_000, description="Pre-pulls/loads per plan.")
    planner_byte_cost: float = Field(default=2e-10, ge=0, le=1, description="GPU-seconds per byte moved.")
    planner_host_byte_second_cost: float = Field(default=2e-13, ge=0, le=1,
                                                 description="GPU-seconds per byte-second of host memory.")
    planner_lead_margin_s: float = Field(default=5.0, ge=0, le=3600, description="Extra lead time, seconds.")
    planner_lead_margin_frac: float = Field(default=0.2, ge=0, le=10, description="Extra lead time, share.")
    planner_release_hold_min: int = Field(default=0, ge=0, le=1440, description="Minutes below before a release.")
    planner_quantile_for_shape: float = Field(default=0.9, gt=0, lt=1)
    # budget mode (forecaster.planning.budget): the cold cost follows a stated waste budget
    planner_waste_budget_gpu_seconds_per_hour: float | None = Field(
        default=None, ge=0, le=MAX_GPUS * 3600, allow_inf_nan=False,
        description="Budget mode: idle GPU-seconds per hour the planner may spend (replicas held but not used); "
                    "each plan scales every cold cost by a factor a controller moves from the spend so far. Unset "
                    "(and no _pct): no budget, the cold costs as configured.")
    planner_waste_budget_pct: float | None = Field(
        default=None, ge=0, le=1e6, allow_inf_nan=False,
        description="Budget mode, normalised: % of the idle GPU-seconds a fixed keep-alive of "
                    "planner_waste_budget_reference_min minutes would have spent on the same invocations (100 = "
                    "as wasteful as a 10-minute keep-alive). With the absolute form too, the smaller allowance holds.")
    planner_waste_budget_reference_min: int = Field(default=10, ge=1, le=1440,
                                                    description="Keep-alive minutes of the normalised budget's 100 %.")
    planner_waste_budget_window_min: float = Field(
        default=240.0, gt=0, le=10080, allow_inf_nan=False,
        description="Pacing window of the budget controller, minutes: the spend curves and spend it meets the "
                    "allowance over (240: chosen by bench/budget_gains.py on the Azure day's warm-up minutes 0-239 "
                    "only, among 15/30/60/120/240: the longest whose spend there lands within 5 % of the budget).")
    planner_waste_budget_gain: float | None = Field(
        default=None, gt=0, le=10, allow_inf_nan=False,
        description="Integral gain per minute on log(cold cost) while no spend curve is known yet (the first "
                    "plan); unset: 1 / planner_waste_budget_window_min.")
    planner_waste_budget_max_factor: float = Field(
        default=1000.0, ge=1, le=1e6, allow_inf_nan=False,
        description="Budget mode keeps the cold cost within [1/f, f] x the configured one.")
    retrain_holdout_min: int = Field(default=120, ge=30, le=527_040, description="Held-out tail scoring challenger vs champion.")
    retrain_hour_utc: int = Field(default=3, ge=0, le=23)

    # --- scale-out (forecaster.distributed) -------------------------------
    dask_scheduler_address: str | None = Field(
        default=None,
        description="tcp://host:8786 of a Dask scheduler: retrain, backtests and the forecast job run as Dask tasks "
                    "per shard of series. Unset: a local process pool of shard_workers (1 = in this process, except "
                    "the forecast job's shards: one child process, see forecast_in_process).")
    dask_connect_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    shard_workers: int = Field(default=1, ge=1, le=256, description="Local worker processes when no Dask is set.")
    shard_max_series: int = Field(
        default=5000, ge=1, le=10_000_000, description="Series per shard; each shard of similar series gets its own ensemble.")
    shard_retries: int = Field(default=2, ge=0, le=20, description="Extra attempts for a shard that fails.")
    forecast_deadline_intervals: float = Field(
        default=2.0, gt=0, le=60, allow_inf_nan=False,
        description="The forecast job's shards must finish within this many forecast_interval_s of their start; "
                    "then the pool's workers are killed (Dask: the tasks cancelled) and the unfinished shards "
                    "forecast with their fallback, so a hung worker costs at most this long instead of every run "
                    "after it. Above 1 so that a healthy run slower than the interval (100,000 models on 2 cores: "
                    "up to ~76 s of shards, docs/scale.md) keeps its ensemble forecasts; below 1 (e.g. 0.75) a hang "
                    "never costs a slot, but shards slower than that get the fallback. Enforced with "
                    "shard_workers=1 too (the forecast job's shards then run in one child process), except with "
                    "forecast_in_process, where it only stops the retries. On Dask the run returns at the "
                    "deadline but a hung task keeps its worker thread.")
    forecast_in_process: bool = Field(
        default=False,
        description="With shard_workers=1 and no Dask, run the forecast job's shards in the job's own process "
                    "instead of one child process: no child (its memory, its spawn on the first run, the shards' "
                    "history sent to it each run), but nothing can stop a hung shard there, so "
                    "forecast_deadline_intervals does not bound the job. For tests and tiny fleets.")
    forecast_fit_threads: int = Field(
        default=1, ge=1, le=64,
        description="Ensemble members one shard fits at once, each on its own thread (the fitted model is the same "
                    "whatever this is; raise it where cores would otherwise idle during a retrain).")
    forecast_weighting: Literal["shrunk", "best", "inverse_error"] = Field(
        default="shrunk",
        description="How the ensemble combines its members per series (forecaster.forecast.ensemble): 'shrunk' "
                    "(default, chosen by nested validation) or 'best', its predecessor, about 1.6x faster to "
                    "forecast on the Azure day; 'inverse_error' is slower still and missed the calibration.")
    forecast_members: str = Field(
        default=",".join(MEMBER_FAMILIES),
        description="The ensemble's member families, a comma list of: " + ", ".join(MEMBER_FAMILIES) + " (default "
                    "all five; the fallback is always added). bench/accuracy.py --select scores member sets by "
                    "nested validation.")

    # --- actuator (forecaster.actuation) ---------------------------------
    actuator_backend: Literal["dry-run", "agent", "kubernetes", "composite"] = "dry-run"
    actuator_routes: str | None = Field(
        default=None,
        description="With actuator_backend=composite: the backend of each action kind, e.g. "
                    "'scale=kubernetes,release=kubernetes,prepull=agent,preload=agent' (prepull=kubernetes: pre-pull "
                    "Jobs where no agent runs); kinds not named stay dry-run.")
    actuator_kill_switch: bool = Field(default=False, description="Hard stop: every action is dropped.")
    actuator_max_actions_per_minute: int = Field(
        default=600, ge=0, le=10_000_000, description="Actions started per minute at most; the rest are dropped with a reason.")
    actuator_gpu_budget: int | None = Field(
        default=None, ge=0, le=MAX_GPUS,
        description="GPUs scale-ahead may hold above the reactive asks, all models together; unset: no cap at the "
                    "actuator (the planner keeps within its own budget, planner_gpu_budget).")
    actuator_max_attempts: int = Field(default=4, ge=1, le=50)
    actuator_retry_base_delay_s: float = Field(default=5.0, ge=0, le=3600)
    actuator_parallelism: int = Field(default=8, ge=1, le=256)
    agent_url_template: str = Field(default="http://{node}:7070", description="Node agent URL; {node} = node id.")
    agent_token: SecretStr | None = Field(default=None, description="Bearer token of the node agents.")
    agent_connect_timeout_s: float = Field(default=5.0, gt=0, le=3600)

    # --- node agent (forecaster.agent, `prewarm agent`) -------------------
    agent_host: str = "127.0.0.1"
    agent_port: int = Field(default=7070, ge=1, le=65535)
    agent_node_name: str | None = Field(default=None, description="Node id the agent reports; default hostname.")
    agent_cache_dir: Path | None = Field(default=None, description="Weights cache; default data_dir/weights-cache.")
    agent_cache_max_bytes: int | None = Field(default=None, ge=0, le=MAX_BYTES, description="LRU disk budget of the cache.")
    agent_disk_reserve_bytes: int = Field(default=1 << 30, ge=0, le=MAX_BYTES, description="Free disk never used by the cache.")
    agent_host_max_bytes: int = Field(default=16 << 30, ge=0, le=MAX_BYTES, description="Weights kept resident in host memory.")
    agent_containerd_socket: Path = Path("/run/containerd/containerd.sock")
    agent_registry_auth_file: Path | None = Field(default=None, description="Docker config JSON with registry auths.")
    agent_s3_endpoint_url: str | None = None
    agent_s3_region: str = "us-east-1"
    agent_s3_access_key_id: str | None = None
    agent_s3_secret_access_key: SecretStr | None = None
    agent_max_concurrent_pulls: int = Field(default=2, ge=1, le=64)
    agent_max_concurrent_preloads: int = Field(default=2, ge=1, le=64)
    agent_preload_streams: int = Field(default=4, ge=1, le=64, description="Parallel ranged reads per object.")
    agent_preload_part_bytes: int = Field(default=16 << 20, ge=1 << 20, le=5 << 30)
    agent_preload_buffer_bytes: int = Field(default=1 << 20, ge=64 << 10, le=64 << 20,
                                            description="Read buffer per stream; memory ~ streams x this.")
    agent_default_deadline_s: float = Field(default=600.0, gt=0, le=86_400)

    # --- Kubernetes backend ------------------------------------------------
    kubernetes_namespace: str = "default"
    kubernetes_kubeconfig: Path | None = Field(default=None, description="Unset: in-cluster config, then ~/.kube.")
    kubernetes_model_label: str = "prewarm.io/model"
    kubernetes_prepull_helper_image: str = "busybox:1.36"
    kubernetes_job_ttl_s: int = Field(default=600, ge=0, le=2_592_000)
    kubernetes_job_wait_s: float = Field(default=300.0, ge=0, le=86_400)
    kubernetes_owner_deployment: str | None = Field(default=None, description="Deployment that owns pre-pull Jobs.")
    kubernetes_image_pull_secret: str | None = None
    kubernetes_hpa_index_ttl_s: float = Field(
        default=60.0, ge=0, le=3600,
        description="Seconds the Kubernetes backend trusts its map of which HPA scales which Deployment: one "
                    "LIST of a namespace's HPAs per period (the plan job builds its backend each plan, so at most "
                    "one per plan), then a GET of the one HPA per action; an HPA created since is seen at the next "
                    "listing. 0: list on every lookup.")
    kubernetes_coldstart_max_start_s: float = Field(
        default=10_800.0, ge=60, le=86_400,
        description="Longest plausible cold start (seconds, creation to first Ready) the Kubernetes collector "
                    "believes: it counts only pods created at or after its watermark (on its first run: now) less "
                    "this, and drops a creation -> Ready longer than this. Ready's lastTransitionTime moves when a "
                    "readiness probe fails and recovers (restartCount stays 0), so a pod created long before would "
                    "otherwise be stored from its creation to that later transition (a 90 s start as 19,800 s). A start "
                    "really longer than this is not stored and so never learned: the coldstarts job counts such "
                    "pods (dropped_long_start) and logs a warning: raise this where loads take longer (a 405B-class "
                    "model's ~800 GB of weights take about 4.5 h at 50 MB/s). 3 h by default: a longer bound admits "
                    "more readiness flaps (and GPU waits) of pods never seen Ready before, such as on the "
                    "collector's first run, as starts of hours, which would stretch the model's lead times "
                    "silently; a start dropped is counted and warned about.")

    # --- hardening (issue 12): bounds at the edge, supervision ------------
    max_batch_span_days: float = Field(
        default=62.0, gt=0, le=3660,
        description="Longest span one ingested batch may cover (first window start to last window end), days; "
                    "longer is refused with 422 / exit 2 before any partition is created.")
    api_max_body_bytes: int = Field(
        default=32 << 20, ge=1024, le=1 << 32,
        description="Largest request body the API reads, bytes; larger is refused with 413 (a 200,000-row push "
                    "is about 14 MB).")
    embedded_start_timeout_s: float = Field(
        default=300.0, gt=0, le=86_400,
        description="How long starting the embedded PostgreSQL may take, seconds (covers crash recovery).")
    embedded_supervise_interval_s: float = Field(
        default=1.0, ge=0, le=3600,
        description="How often a serving process checks that the embedded PostgreSQL runs and restarts it; 0 = "
                    "never.")
    job_db_wait_s: float = Field(
        default=120.0, ge=0, le=86_400,
        description="How long a scheduled job's slot waits for an absent database (claim, rerun, record), seconds; "
                    "a 60 s outage loses no slot.")
    push_lock_timeout_s: float = Field(
        default=2.0, ge=0, le=MAX_PUSH_LOCK_TIMEOUT_S,
        description="How long a pushed batch waits for another writer of the same models, seconds; then 503 with "
                    "Retry-After (busy), not a hung request. 0 = wait as long as it takes (file ingest always does).")
    token_cache_s: float = Field(
        default=1.0, ge=0, le=1.0,
        description="How long the API trusts a verified token before asking the database again, seconds "
                    "(a revocation in another process takes effect within this; in the same process at once).")

    @field_validator("database_url")
    @classmethod
    def _normalise_database_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip()
        for prefix in ("postgres://", "postgresql://"):
            if value.startswith(prefix):
                value = "postgresql+psycopg://" + value[len(prefix):]
                break
        if not value.startswith("postgresql+psycopg://"):
            raise ValueError(
                f"must be a PostgreSQL URL (postgresql://user@host:port/db), got {mask_url(value)!r}"
            )
        _check_database_url(value)
        return value

    @field_validator("api_host", "agent_host")
    @classmethod
    def _host_not_empty(cls, value: str) -> str:
        # an empty host made uvicorn listen on every interface ("http://:8080")
        value = value.strip()
        if not value:
            raise ValueError("must be an address or host name to listen on (127.0.0.1: this host only; 0.0.0.0: "
                             "every interface); it is empty")
        return value

    @field_validator("api_workers", mode="before")
    @classmethod
    def _workers(cls, value: object) -> int | str:
        spelled = str(value).strip().lower()
        if spelled == "auto":
            return "auto"
        if isinstance(value, bool) or not spelled.isdigit() or not 1 <= int(spelled) <= MAX_API_WORKERS:
            raise ValueError(f"must be a whole number from 1 to {MAX_API_WORKERS} or 'auto', got {value!r}")
        return int(spelled)

    @property
    def api_worker_count(self) -> int:
        """``api_workers`` as a number: 'auto' is one per usable CPU core, at most :data:`AUTO_API_WORKERS_MAX`."""
        if self.api_workers != "auto":
            return int(self.api_workers)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(cores, AUTO_API_WORKERS_MAX))

    @field_validator("dask_scheduler_address")
    @classmethod
    def _dask_address(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None  # unset or empty (docker compose passes ""): no Dask
        value = value.strip()
        if "://" not in value:
            raise ValueError(f"must be a scheduler address such as tcp://host:8786, got {mask_url(value)!r}")
        return value

    @field_validator("prometheus_query_template", "prometheus_burst_query_template")
    @classmethod
    def _template_names_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.field_name == "prometheus_burst_query_template" and (value is None or not value.strip()):
            return None  # optional: unset, or set to nothing
        if "{model_id}" not in value:
            raise ValueError(f"must contain the placeholder {{model_id}}, got {value!r}")
        try:
            value.format(model_id="m")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"does not format with str.format(model_id=...) ({exc!r}): write literal braces "
                             "as '{{' and '}}' and the placeholder as '{model_id}'") from None
        return value

    @field_validator("agent_url_template")
    @classmethod
    def _template_names_node(cls, value: str) -> str:
        if "{node}" not in value and "{" in value:
            raise ValueError(f"may only use the placeholder {{node}}, got {value!r}")
        return value

    @field_validator("forecast_members")
    @classmethod
    def _members_known(cls, value: str) -> str:
        return ",".join(member_families(value))

    @field_validator("actuator_routes")
    @classmethod
    def _routes_parse(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        routes = parse_actuator_routes(value)
        return ",".join(f"{kind}={backend}" for kind, backend in routes.items())

    @model_validator(mode="after")
    def _routes_need_composite(self) -> "Settings":
        if self.actuator_routes is not None and self.actuator_backend != "composite":
            raise ValueError(f"PREWARM_ACTUATOR_ROUTES={self.actuator_routes!r} is set but PREWARM_ACTUATOR_BACKEND="
                             f"{self.actuator_backend!r}; routes apply only to PREWARM_ACTUATOR_BACKEND=composite")
        return self

    @property
    def actuator_route_map(self) -> dict[str, str]:
        """{action kind: backend} of the composite actuator (every kind ``dry-run`` when no route is set)."""
        return parse_actuator_routes(self.actuator_routes)

    @model_validator(mode="after")
    def _retention_ages_ascend(self) -> "Settings":
        if not self.invocations_minute_days <= self.invocations_5min_days <= self.invocations_retention_days:
            raise ValueError(
                "retention ages must satisfy PREWARM_INVOCATIONS_MINUTE_DAYS <= PREWARM_INVOCATIONS_5MIN_DAYS <= "
                f"PREWARM_INVOCATIONS_RETENTION_DAYS, got {self.invocations_minute_days} / "
                f"{self.invocations_5min_days} / {self.invocations_retention_days}")
        return self

    @model_validator(mode="after")
    def _plans_kept_a_day(self) -> "Settings":
        if self.plans_retention_days == 1:
            raise ValueError("PREWARM_PLANS_RETENTION_DAYS=1 would delete what the plan job reads (the last day's "
                             "pre-pulls and pre-loads, budget mode's day of plans): use 0 (keep forever) or 2 or more")
        return self

    @model_validator(mode="after")
    def _cold_starts_kept_for_training(self) -> "Settings":
        if 0 < self.cold_starts_retention_days < self.latency_train_days:
            raise ValueError(
                f"PREWARM_COLD_STARTS_RETENTION_DAYS={self.cold_starts_retention_days} is shorter than "
                f"PREWARM_LATENCY_TRAIN_DAYS={self.latency_train_days}: the latency retrain would lose what it learns "
                "from; use 0 (keep forever) or at least the training days")
        return self

    @model_validator(mode="after")
    def _production_needs_database(self) -> "Settings":
        if self.environment == "production" and self.database_url is None:
            raise ValueError("environment=production requires DATABASE_URL; the embedded database is for development")
        if self.environment == "production" and self.agent_token is not None \
                and self.agent_token.get_secret_value() in PLACEHOLDER_SECRETS:
            raise ValueError("PREWARM_AGENT_TOKEN is a placeholder; set a real secret in production")
        return self

    @property
    def weights_cache_dir(self) -> Path:
        """Where the node agent keeps pre-loaded weights."""
        return self.agent_cache_dir or self.data_dir / "weights-cache"

    @property
    def embedded_pgdata(self) -> Path:
        """Where the embedded PostgreSQL keeps its data between runs."""
        return self.data_dir / "postgres"


#: Settings whose value is never shown in a message: SecretStr fields, and names ending in token, secret, password or
#: key (not PREWARM_TOKEN_CACHE_S, a number).
_SECRET_NAME = re.compile(r"(?i)(token|secret|passw(or)?d|_key|_key_id)$")


def _is_secret(env_name: str) -> bool:
    field = Settings.model_fields.get(env_name.lower().removeprefix("prewarm_"))
    if field is not None and (field.annotation is SecretStr or SecretStr in get_args(field.annotation)):
        return True
    return _SECRET_NAME.search(env_name) is not None


def _shown_input(env_name: str, value: object) -> str:
    """``value`` of setting ``env_name`` as an error message shows it: a secret as ``'***'``, a URL's password masked."""
    if _is_secret(env_name):
        return "'***'"
    if isinstance(value, str):
        return repr(mask_url(value))
    if isinstance(value, (dict, list, tuple)):
        return "(not shown)"  # not a single value: it could carry anything
    return repr(value)


#: ``PREWARM_*`` names the project reads that are not settings (tests, benchmarks, the serve supervisor's heartbeat).
_OTHER_PREWARM_NAMES = frozenset({"PREWARM_SETTINGS_FILE", "PREWARM_SCHEDULER_HEARTBEAT_FILE",
                                  "PREWARM_REPORT_SCREENSHOT"})
_OTHER_PREWARM_PREFIXES = ("PREWARM_TEST_", "PREWARM_BENCH_")


def unknown_setting_names(env_file: str | os.PathLike[str] | None = None) -> list[str]:
    """One line for each ``PREWARM_*`` name in the environment or ``env_file`` that is no setting, with the nearest
    setting's name where one is close (a misspelt ``PREWARM_ACTUATOR_KILLSWITCH`` left the kill switch off without
    a word). Not refused: other tools may set ``PREWARM_*`` variables of their own."""
    known = sorted({f"PREWARM_{name.upper()}" for name in Settings.model_fields} | set(_DATABASE_URL_NAMES))
    found: dict[str, str] = {name.upper(): "the environment" for name in os.environ}
    if env_file:
        from dotenv import dotenv_values

        for name in dotenv_values(env_file):
            found.setdefault(name.upper(), f"the settings file {os.fspath(env_file)}")
    lines = []
    for name, where in sorted(found.items()):
        if not name.startswith("PREWARM_") or name in known or name in _OTHER_PREWARM_NAMES \
                or name.startswith(_OTHER_PREWARM_PREFIXES):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]}?" if close else ""
        lines.append(f"{name} (in {where}) is not a setting and is ignored{hint}")
    return lines


def load_settings(*, warn: Callable[[str], None] | None = None, **overrides: object) -> Settings:
    """Load settings from the environment (and ``PREWARM_SETTINGS_FILE``).

    Each ``PREWARM_*`` name that is no setting is passed to ``warn`` (default: logged at WARNING), the nearest
    setting suggested; loading goes on.

    Raises:
        SettingsError: naming each invalid variable, its value and the reason.
    """
    env_file = os.environ.get("PREWARM_SETTINGS_FILE")
    if env_file and not Path(env_file).is_file():
        raise SettingsError(f"PREWARM_SETTINGS_FILE={env_file!r}: no such file")
    for line in unknown_setting_names(env_file):
        (warn or log.warning)(line)
    try:
        return Settings(_env_file=env_file, **overrides)  # type: ignore[call-arg]
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if not err["loc"]:
                # a cross-field check (model_validator): its input is the whole settings dict, secrets and all;
                # the message names the settings and values concerned itself
                problems.append(err["msg"])
                continue
            name = str(err["loc"][0])
            if name.lower() in ("database_url", "prewarm_database_url"):
                env_name = "PREWARM_DATABASE_URL" if (os.environ.get("PREWARM_DATABASE_URL") or "").strip() \
                    else "DATABASE_URL"
            elif name.upper().startswith("PREWARM_"):
                env_name = name.upper()
            else:
                env_name = f"PREWARM_{name.upper()}"
            problems.append(f"{env_name}={_shown_input(env_name, err.get('input'))}: {err['msg']}")
        raise SettingsError("invalid settings: " + "; ".join(problems)) from None
