"""SQLAlchemy 2 table definitions of the store.

These classes describe the schema for queries; the schema itself is created
only by the Alembic migrations in ``migrations/`` (never by ``create_all``).
Times are ``timestamptz`` in UTC; sizes in bytes; durations in seconds.

The metadata must still state what the migrations create: every index and
unique constraint, the column types and the server defaults (identity columns
included). ``alembic check`` and ``alembic revision --autogenerate`` compare it
with a migrated database (``compare_server_default`` is on in
``migrations/env.py``), and whatever is missing here comes out as a
``drop_index``, ``drop_constraint`` or ``alter_column`` in the next generated
migration; ``tests/test_migrations.py`` asserts there is no difference. A
Python-side ``default=`` stays next to its ``server_default`` where the code had
one, so the ORM's inserts send what they always sent. The daily partitions of
``invocations`` and ``forecasts`` cannot be declared here; ``include_name`` in
``migrations/env.py`` leaves them out. Autogenerate compares neither CHECK
constraints nor an index's WHERE or INCLUDE; the indexes state theirs anyway,
so that each reads as what its migration built.
"""

from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import (
    REAL,
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TSTZMULTIRANGE
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


TZ = DateTime(timezone=True)
#: The server default of the JSONB columns that hold an object.
EMPTY_OBJECT = text("'{}'::jsonb")


class ServingModel(Base):
    """The catalogue of what is served: one row per model deployment."""

    __tablename__ = "serving_models"

    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    image_ref: Mapped[str | None] = mapped_column(Text)
    image_size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    weights_uri: Mapped[str | None] = mapped_column(Text)
    weights_size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    gpus_per_replica: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    replica_rps: Mapped[float | None] = mapped_column(Float, doc="Requests per second one replica sustains.")
    cold_start_slo_s: Mapped[float | None] = mapped_column(Float)
    burst_factor: Mapped[float | None] = mapped_column(
        Float, doc="Peak 10-second request rate over the minute's mean (forecaster.contracts.bursts); 1 to 6.")
    burst_through: Mapped[datetime | None] = mapped_column(
        TZ, doc="End of the newest minute that moved burst_factor (Prometheus' burst query, pushed peak_10s).")
    labels: Mapped[dict] = mapped_column(JSONB, default=dict, server_default=EMPTY_OBJECT)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class Invocation(Base):
    """Invocations of a model in one step starting at ``minute`` (range-partitioned by day).

    Zero-count steps are not stored; :class:`Coverage` says which steps are known.
    """

    __tablename__ = "invocations"

    model_id: Mapped[str] = mapped_column(
        String(256), ForeignKey("serving_models.id", ondelete="CASCADE"), primary_key=True
    )
    minute: Mapped[datetime] = mapped_column(TZ, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)


class Coverage(Base):
    """Time ranges ingested per model, source and step width, as a multirange.

    A step inside ``ranges`` with no :class:`Invocation` row had zero invocations;
    a step outside every range of every source is unknown. Adjacent ranges merge
    on write, so the row stays small however often a source ingests.
    """

    __tablename__ = "coverage"

    model_id: Mapped[str] = mapped_column(
        String(256), ForeignKey("serving_models.id", ondelete="CASCADE"), primary_key=True
    )
    source: Mapped[str] = mapped_column(String(128), primary_key=True)
    step_seconds: Mapped[int] = mapped_column(Integer, primary_key=True)
    ranges = mapped_column(TSTZMULTIRANGE, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (Index("coverage_known_until", text("upper(ranges)")),)  # 0009


class SourceCursor(Base):
    """How far a pull source (Prometheus) has asked for a model's minutes and found no sample (migration 0018).

    Coverage ends at the last sampled minute, so a model without series (scaled to zero) would be asked again for
    every minute since it was last served, on every run; the next run starts at ``asked_through`` instead.
    """

    __tablename__ = "source_cursors"

    model_id: Mapped[str] = mapped_column(
        String(256), ForeignKey("serving_models.id", ondelete="CASCADE"), primary_key=True
    )
    source: Mapped[str] = mapped_column(String(128), primary_key=True)
    asked_through: Mapped[datetime] = mapped_column(TZ)
    query_sha256: Mapped[str] = mapped_column(String(64), doc="The query asked: another query asks again.")
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class Rollup(Base):
    """A day of ``invocations`` aggregated to ``step_seconds`` buckets by the retention job (one row per day)."""

    __tablename__ = "rollups"

    day: Mapped[date] = mapped_column(Date, primary_key=True)
    step_seconds: Mapped[int] = mapped_column(Integer)
    rolled_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    rows_before: Mapped[int] = mapped_column(BigInteger)
    rows_after: Mapped[int] = mapped_column(BigInteger)


class IngestBatch(Base):
    """Audit row per accepted batch; ``content_sha256`` makes duplicate pushes no-ops."""

    __tablename__ = "ingest_batches"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    source: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(32))  # "counts" | "cold_starts"
    content_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    models: Mapped[int] = mapped_column(Integer)
    rows_written: Mapped[int] = mapped_column(BigInteger)
    invocations: Mapped[int] = mapped_column(BigInteger)
    window_start: Mapped[datetime | None] = mapped_column(TZ)
    window_end: Mapped[datetime | None] = mapped_column(TZ)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class ColdStart(Base):
    """One observed cold start of a replica, in total and per phase (seconds)."""

    __tablename__ = "cold_starts"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(256), ForeignKey("serving_models.id", ondelete="CASCADE"))
    node_id: Mapped[str] = mapped_column(String(256))
    started_at: Mapped[datetime] = mapped_column(TZ)
    total_seconds: Mapped[float] = mapped_column(Float)
    image_pull_s: Mapped[float | None] = mapped_column(Float)
    weight_fetch_s: Mapped[float | None] = mapped_column(Float)
    weight_load_s: Mapped[float | None] = mapped_column(Float)
    runtime_init_s: Mapped[float | None] = mapped_column(Float)
    registration_s: Mapped[float | None] = mapped_column(Float)
    cache_state: Mapped[str | None] = mapped_column(
        String(32), doc="What the node had before: none, image, disk, host, gpu, sleeping."
    )
    source: Mapped[str] = mapped_column(String(128))
    event_id: Mapped[str] = mapped_column(
        String(256), server_default="",
        doc="What tells two starts of one model on one node in the same instant apart (the collector: the pod's "
            "uid); '' when the sender has none. Part of the key cold_starts_event_key (migration 0019).")
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (
        # One event per replica start: the same observation pushed twice is one row (0001; event_id since 0019).
        UniqueConstraint("model_id", "node_id", "started_at", "event_id", name="cold_starts_event_key"),
        Index("cold_starts_model_time", "model_id", "started_at"),  # 0001
        Index("cold_starts_time_model", "started_at", "model_id"),  # 0010
    )


class Transfer(Base):
    """One pre-pull or pre-load a node agent carried out: bytes moved, seconds in total and per phase.

    Not a cold start: no replica waited on it. The latency model learns the
    image pull and weight fetch rates from these rows.
    """

    __tablename__ = "transfers"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(256), ForeignKey("serving_models.id", ondelete="CASCADE"))
    node_id: Mapped[str] = mapped_column(String(256))
    kind: Mapped[str] = mapped_column(String(16))  # prepull | preload
    tier: Mapped[str] = mapped_column(String(16))  # image (prepull) | disk | host | gpu
    ref: Mapped[str] = mapped_column(Text)  # image reference or weights URI
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(TZ)
    seconds: Mapped[float] = mapped_column(Float)
    image_pull_s: Mapped[float | None] = mapped_column(Float)
    weight_fetch_s: Mapped[float | None] = mapped_column(Float)
    weight_load_s: Mapped[float | None] = mapped_column(Float)
    cache_state: Mapped[str | None] = mapped_column(String(32), doc="What the node had before: none or disk.")
    source: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (
        UniqueConstraint("model_id", "node_id", "kind", "started_at", name="transfers_event_key"),  # 0007
        Index("transfers_started_at", "started_at"),  # 0007
    )


class Node(Base):
    """A GPU node and its free capacity, as last reported."""

    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    gpus_total: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    gpus_free: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    disk_free_bytes: Mapped[int | None] = mapped_column(BigInteger)
    host_memory_free_bytes: Mapped[int | None] = mapped_column(BigInteger)
    network_bytes_per_s: Mapped[float | None] = mapped_column(Float)
    labels: Mapped[dict] = mapped_column(JSONB, default=dict, server_default=EMPTY_OBJECT)
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class NodeCacheEntry(Base):
    """Something a node holds warm: an image, or weights in a tier (disk, host, gpu)."""

    __tablename__ = "node_cache"

    node_id: Mapped[str] = mapped_column(String(256), ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True)
    artefact_kind: Mapped[str] = mapped_column(String(16), primary_key=True)  # image | weights
    ref: Mapped[str] = mapped_column(Text, primary_key=True)  # image reference or weights URI
    tier: Mapped[str] = mapped_column(String(16), primary_key=True)  # image | disk | host | gpu
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    in_use: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class ModelVersion(Base):
    """A trained model saved under ``models/<id>/``: the forecasting ensemble or the cold-start latency model."""

    __tablename__ = "model_versions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    status: Mapped[str] = mapped_column(String(16))  # challenger | champion | retired (a former champion) | rejected | failed | deleted
    path: Mapped[str] = mapped_column(Text)
    train_start: Mapped[datetime | None] = mapped_column(TZ)
    train_end: Mapped[datetime | None] = mapped_column(TZ)
    members: Mapped[list] = mapped_column(JSONB, default=list, server_default=text("'[]'::jsonb"))
    scores: Mapped[dict] = mapped_column(JSONB, default=dict, server_default=EMPTY_OBJECT)
    code_version: Mapped[str | None] = mapped_column(String(64))
    # forecast | latency (one champion each)
    kind: Mapped[str] = mapped_column(String(16), default="forecast", server_default="forecast")
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (
        # At most one champion of each kind (0007).
        Index("model_versions_one_champion", "kind", unique=True, postgresql_where=text("status = 'champion'")),
    )


class Forecast(Base):
    """One forecast run of one model: its target minutes as arrays (range-partitioned by day of ``issued_at``).

    Element ``k`` (1-based) of ``point``, ``p_any`` and of each row of
    ``quantiles`` is target minute ``first_target + (k - 1) * step_seconds``;
    ``quantiles`` holds one row per level, in the order of ``quantile_levels``.
    Values are invocations per minute (``real``); a NaN ``p_any`` element is unknown.
    """

    __tablename__ = "forecasts"

    model_id: Mapped[str] = mapped_column(
        String(256), ForeignKey("serving_models.id", ondelete="CASCADE"), primary_key=True
    )
    issued_at: Mapped[datetime] = mapped_column(TZ, primary_key=True)
    first_target: Mapped[datetime] = mapped_column(TZ, doc="Target minute of element 1.")
    step_seconds: Mapped[int] = mapped_column(Integer, default=60, server_default="60")
    model_version_id: Mapped[str | None] = mapped_column(String(64), ForeignKey("model_versions.id"))
    point: Mapped[list[float]] = mapped_column(ARRAY(REAL))
    p_any: Mapped[list[float] | None] = mapped_column(ARRAY(REAL), doc="Probability of at least one invocation.")
    quantile_levels: Mapped[list[float]] = mapped_column(ARRAY(REAL), doc="Ascending, e.g. [0.1, 0.5, 0.9].")
    quantiles: Mapped[list[list[float]]] = mapped_column(ARRAY(REAL, dimensions=2), doc="One row per level.")
    request_rate_rpm: Mapped[float | None] = mapped_column(
        REAL, doc="The model's requests per minute over the history the run was made from (migration 0017).")

    __table_args__ = (
        Index("forecasts_issued_at", "issued_at"),  # "newest run" queries
        {"postgresql_partition_by": "RANGE (issued_at)"},
    )


class Plan(Base):
    """One output of the planner at time ``planned_at``."""

    __tablename__ = "plans"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    planned_at: Mapped[datetime] = mapped_column(TZ)
    summary: Mapped[dict] = mapped_column(JSONB, default=dict, server_default=EMPTY_OBJECT)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (Index("plans_planned_at", "planned_at", "id"),)  # 0016


#: The time an action is about (migrations 0003, 0009, 0011): ``forecaster.store.dashboard`` filters on it.
_ACTION_TIME_SQL = "coalesce(not_before, updated_at)"


class Action(Base):
    """One pre-warm action of a plan: spec (what, where, when) plus status (what happened)."""

    __tablename__ = "actions"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    plan_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("plans.id", ondelete="SET NULL"))
    kind: Mapped[str] = mapped_column(String(16))  # prepull | preload | scale | release
    model_id: Mapped[str | None] = mapped_column(String(256))
    node_id: Mapped[str | None] = mapped_column(String(256))
    target: Mapped[str | None] = mapped_column(Text)
    spec: Mapped[dict] = mapped_column(JSONB, default=dict, server_default=EMPTY_OBJECT)
    not_before: Mapped[datetime | None] = mapped_column(TZ)
    deadline: Mapped[datetime | None] = mapped_column(TZ)
    reason: Mapped[str | None] = mapped_column(String(64))
    expected_benefit: Mapped[float | None] = mapped_column(Float)
    expected_cost: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16), default="pending", server_default="pending")
    status_reason: Mapped[str | None] = mapped_column(String(64))
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    # Added by migration 0002 (actuation).
    key: Mapped[str | None] = mapped_column(Text, doc="Idempotency key: one open unit of work per key.")
    backend: Mapped[str | None] = mapped_column(String(32))  # dry-run | agent | kubernetes
    detail: Mapped[dict] = mapped_column(JSONB, default=dict, server_default=EMPTY_OBJECT,
                                         doc="What was done (or would be), timings, errors.")
    next_attempt_at: Mapped[datetime | None] = mapped_column(TZ)
    started_at: Mapped[datetime | None] = mapped_column(TZ)
    finished_at: Mapped[datetime | None] = mapped_column(TZ)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (
        Index("actions_plan", "plan_id"),  # 0001
        Index("actions_status_deadline", "status", "deadline"),  # 0001
        # One open (pending or running) unit of work per key (0002).
        Index("actions_open_key", "key", unique=True, postgresql_where=text("status IN ('pending', 'running')")),
        Index("actions_started", "started_at"),  # 0002
        Index("actions_model_kind", "model_id", "kind", "finished_at"),  # 0002
        Index("actions_model_time", "model_id", text(_ACTION_TIME_SQL)),  # 0003
        Index("actions_time", text(_ACTION_TIME_SQL)),  # 0009
        Index("actions_succeeded_time_model", text(_ACTION_TIME_SQL), "model_id",  # 0011
              postgresql_include=["not_before", "updated_at"], postgresql_where=text("status = 'succeeded'")),
        Index("actions_scale_latest", "model_id", text("coalesce(finished_at, started_at) DESC NULLS LAST"),  # 0015
              text("id DESC"), postgresql_where=text(
                  "kind IN ('scale', 'release') AND status IN ('succeeded', 'running') AND detail ? 'ahead_gpus'")),
        Index("actions_replicas_newest", "model_id", text("updated_at DESC"), text("id DESC"),  # 0015
              postgresql_where=text("kind IN ('scale', 'release') AND status = 'succeeded'")),
        Index("actions_artefacts_recent", "updated_at",  # 0015
              postgresql_where=text("kind IN ('prepull', 'preload') AND status = 'succeeded' AND node_id IS NOT NULL")),
        Index("actions_finished_age", text("coalesce(finished_at, updated_at)"), "id",  # 0016
              postgresql_where=text("status IN ('succeeded', 'failed', 'dropped')")),
        Index("actions_updated", text("updated_at DESC"), text("id DESC")),  # 0016
    )


class ModelAheadGpus(Base):
    """GPUs a model holds above its reactive ask: its latest succeeded or running scale or release's
    ``ahead_gpus`` (no row for 0); kept by :func:`forecaster.store.actions.refresh_ahead` (migration 0015)."""

    __tablename__ = "model_ahead_gpus"
    __table_args__ = (CheckConstraint("ahead_gpus <> 0", name="model_ahead_gpus_nonzero"),)

    model_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    ahead_gpus: Mapped[int] = mapped_column(Integer)
    action_id: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class ActionCount(Base):
    """Actions per kind and current status (``n``; migration 0015) and those deleted since (``pruned``; 0016), kept
    where actions are recorded, marked, reaped or deleted (:func:`forecaster.store.actions.count_actions`): what
    ``/metrics`` reports as ``prewarm_actions_total`` (finished) and ``prewarm_actions_open`` (pending, running)."""

    __tablename__ = "action_counts"

    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), primary_key=True)
    n: Mapped[int] = mapped_column(BigInteger)
    # Added by migration 0016: actions of this kind and status deleted since (retention, a replay clearing its window).
    pruned: Mapped[int] = mapped_column(BigInteger, server_default="0")


class ActuatorControl(Base):
    """The actuator's global kill switch (one row), shared by the API and every actuating process."""

    __tablename__ = "actuator_control"
    __table_args__ = (CheckConstraint("id = 1", name="actuator_control_single_row"),)

    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True)  # always 1 (migration 0002)
    paused: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    reason: Mapped[str | None] = mapped_column(Text)
    updated_by: Mapped[str | None] = mapped_column(String(128))
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class JobRun(Base):
    """One run of a scheduled job for one time slot; the key stops a slot running twice.

    A ``running`` claim names its process (``owner``) and holds a lease that the process extends while the job
    runs (migration 0020); past its lease, or with its process known to be gone, the run is ``abandoned`` and the
    slot may be claimed again (``attempt`` counts the claims). See :mod:`forecaster.jobs.runs`.
    """

    __tablename__ = "job_runs"

    job_name: Mapped[str] = mapped_column(String(64), primary_key=True)
    slot: Mapped[datetime] = mapped_column(TZ, primary_key=True)
    started_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    finished_at: Mapped[datetime | None] = mapped_column(TZ)
    # running | ok | failed | abandoned
    status: Mapped[str] = mapped_column(String(16), default="running", server_default="running")
    detail: Mapped[dict] = mapped_column(JSONB, default=dict, server_default=EMPTY_OBJECT)
    owner: Mapped[str | None] = mapped_column(String(255))  # host:pid:token of the claiming process
    lease_expires_at: Mapped[datetime | None] = mapped_column(TZ, server_default=text("now() + interval '1 day'"))
    attempt: Mapped[int] = mapped_column(Integer, server_default="1")

    __table_args__ = (Index("job_runs_running", "job_name", "slot", postgresql_where=text("status = 'running'")),)


class ApiToken(Base):
    """A bearer token of the REST API; only its SHA-256 is kept."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(String(16)))
    revoked: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    last_used_at: Mapped[datetime | None] = mapped_column(TZ)


class SchedulerJob(Base):
    """APScheduler 3's SQLAlchemyJobStore table, created here so that migrations own it."""

    __tablename__ = "apscheduler_jobs"

    id: Mapped[str] = mapped_column(String(191), primary_key=True)
    next_run_time: Mapped[float | None] = mapped_column(Float(precision=25), index=True)
    job_state: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class BacktestRun(Base):
    """One ``prewarm backtest`` run: protocol, data window and the aggregate rows."""

    __tablename__ = "backtest_runs"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    data_start: Mapped[datetime] = mapped_column(TZ)
    data_end: Mapped[datetime] = mapped_column(TZ)
    step_seconds: Mapped[int] = mapped_column(Integer)
    protocol: Mapped[dict] = mapped_column(JSONB)
    summary: Mapped[list] = mapped_column(JSONB)


class BacktestResult(Base):
    """Per method, series and horizon: the backtest metrics (EVALUATION.md section 1)."""

    __tablename__ = "backtest_results"

    run_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("backtest_runs.id", ondelete="CASCADE"),
                                        primary_key=True)
    method: Mapped[str] = mapped_column(String(64), primary_key=True)
    unique_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    h: Mapped[int] = mapped_column(Integer, primary_key=True)
    busy: Mapped[bool] = mapped_column(Boolean)
    points: Mapped[int] = mapped_column(Integer)
    mae: Mapped[float | None] = mapped_column(Float)
    mase: Mapped[float | None] = mapped_column(Float)
    wql: Mapped[float | None] = mapped_column(Float)
    coverage_q90: Mapped[float | None] = mapped_column(Float)
    spike_recall: Mapped[float | None] = mapped_column(Float)
    spikes: Mapped[int] = mapped_column(Integer)


class Replay(Base):
    """One replay of a trace on a simulated cluster (``prewarm demo``): its window and how far it has got."""

    __tablename__ = "replays"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    source: Mapped[str] = mapped_column(String(64))
    window_start: Mapped[datetime] = mapped_column(TZ)
    window_end: Mapped[datetime] = mapped_column(TZ)
    scored_until: Mapped[datetime] = mapped_column(TZ, doc="The simulators have measured the minutes before this.")
    policies: Mapped[list] = mapped_column(JSONB)
    summary: Mapped[dict] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class ReplayOutcome(Base):
    """Per replay, policy and model: requests, cold-start requests, replica starts and request wait (seconds)."""

    __tablename__ = "replay_outcomes"

    replay_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("replays.id", ondelete="CASCADE"),
                                           primary_key=True)
    policy: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    cold_requests: Mapped[int] = mapped_column(BigInteger, doc="Requests that arrived with no ready replica.")
    replica_starts: Mapped[int] = mapped_column(Integer, doc="Replicas that started and became ready.")
    wait_total_s: Mapped[float] = mapped_column(Float, doc="Seconds requests waited before service, summed.")
    wait_max_s: Mapped[float] = mapped_column(Float)


class ForecastErrorSum(Base):
    """Per horizon, target hour and model: minutes scored and the sums of |error|, actuals and forecasts.

    Written by :func:`forecaster.store.forecast_errors.score_hour` (migration 0010); the fleet ranking sums
    a window's hours (wMAPE = abs_error / actual, MAE = abs_error / scored_minutes, p_any's Brier score =
    p_any_sq_error / p_any_minutes).
    """

    __tablename__ = "forecast_errors"

    horizon_min: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    hour: Mapped[datetime] = mapped_column(TZ, primary_key=True)
    model_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    scored_minutes: Mapped[int] = mapped_column(SmallInteger)
    abs_error: Mapped[float] = mapped_column(Float, doc="Sum of |forecast - actual| (invocations).")
    actual: Mapped[float] = mapped_column(Float, doc="Sum of actual counts over the scored minutes.")
    forecast: Mapped[float] = mapped_column(Float, doc="Sum of point forecasts over the scored minutes.")
    p_any_minutes: Mapped[int] = mapped_column(SmallInteger, server_default="0",
                                               doc="Scored minutes whose run stored p_any (migration 0014).")
    p_any_sq_error: Mapped[float] = mapped_column(Float, server_default="0",
                                                  doc="Sum of (p_any - [actual > 0])^2 over those minutes.")
    p_any_sum: Mapped[float] = mapped_column(Float, server_default="0", doc="Sum of p_any over those minutes.")
    invoked_minutes: Mapped[int] = mapped_column(SmallInteger, server_default="0",
                                                 doc="Those minutes with an invocation.")


class ForecastErrorHour(Base):
    """One scored target hour of the error rollup: horizons, the ingest batch watermark, models, when."""

    __tablename__ = "forecast_error_hours"

    hour: Mapped[datetime] = mapped_column(TZ, primary_key=True)
    horizons_min: Mapped[list[int]] = mapped_column(ARRAY(SmallInteger))
    batch_watermark: Mapped[int] = mapped_column(BigInteger, doc="Newest ingest batch id the scoring saw.")
    models: Mapped[int] = mapped_column(Integer)
    scored_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    seconds: Mapped[float] = mapped_column(Float)
