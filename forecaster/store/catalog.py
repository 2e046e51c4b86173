"""The serving-model catalogue: what is served, and what a replica needs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import numpy as np
import pandas as pd
from sqlalchemy import Connection, Engine, Row, func, select, text, update
from sqlalchemy.dialects.postgresql import insert

from forecaster.contracts.batches import IngestError
from forecaster.contracts.bursts import MAX_BURST_FACTOR, smooth_burst_factors
from forecaster.store.fields import MAX_LABELS
from forecaster.store.tables import ServingModel


@dataclass
class ServingModelSpec:
    """What a user registers for a model (sizes in bytes, SLO in seconds)."""

    id: str
    image_ref: str | None = None
    image_size_bytes: int | None = None
    weights_uri: str | None = None
    weights_size_bytes: int | None = None
    gpus_per_replica: int = 1
    replica_rps: float | None = None
    cold_start_slo_s: float | None = None
    labels: dict = field(default_factory=dict)
    #: peak 10-second request rate over the minute's mean (:mod:`forecaster.contracts.bursts`); None: even
    burst_factor: float | None = None

    def __post_init__(self) -> None:
        """Refuse what the store cannot hold or the planner cannot use (bounds: forecaster.store.fields)."""
        from forecaster.store import fields as bounds

        if not isinstance(self.id, str) or not self.id.strip():
            raise ValueError("model id must not be empty")
        bounds.check_id("model id", self.id)
        bounds.check_text("image_ref", self.image_ref, max_length=1024)
        bounds.check_text("weights_uri", self.weights_uri)
        for name in ("image_size_bytes", "weights_size_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
            bounds.check_number(name, value, low=0, high=bounds.MAX_SIZE_BYTES)
        if self.gpus_per_replica is None or self.gpus_per_replica < 0:
            raise ValueError(f"gpus_per_replica must be >= 0, got {self.gpus_per_replica}")
        bounds.check_number("gpus_per_replica", self.gpus_per_replica, low=0, high=64)
        for name, low, high in (("replica_rps", bounds.MIN_REPLICA_RPS, bounds.MAX_REPLICA_RPS),
                                ("cold_start_slo_s", bounds.MIN_SLO_S, bounds.MAX_SLO_S)):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
            bounds.check_number(name, value, low=low, high=high)
        bounds.check_labels(self.labels)
        bounds.check_number("burst_factor", self.burst_factor, low=1.0, high=MAX_BURST_FACTOR)


#: The spec columns a registration may set, besides ``id`` and ``labels`` (the fields of :class:`ServingModelSpec`).
SPEC_COLUMNS = ("image_ref", "image_size_bytes", "weights_uri", "weights_size_bytes", "gpus_per_replica",
                "replica_rps", "cold_start_slo_s", "burst_factor")


def _replace_statement(rows: list[dict]):
    """INSERT the rows whole; an id already stored has every spec column replaced (``updated_at`` now)."""
    stmt = insert(ServingModel).values(rows)
    update_ = {c: stmt.excluded[c] for c in rows[0] if c != "id"}
    update_["updated_at"] = text("now()")
    return stmt.on_conflict_do_update(index_elements=["id"], set_=update_)


def upsert_models(conn: Connection, specs: Iterable[ServingModelSpec]) -> int:
    """Register models or replace their whole specs; returns how many rows were written."""
    rows = [asdict(s) for s in specs]
    if not rows:
        return 0
    conn.execute(_replace_statement(rows))
    return len(rows)


def put_model(conn: Connection, spec: ServingModelSpec) -> Row:
    """Register ``spec``, or replace the whole stored spec of its id (``PUT /v1/models/{id}``); returns the row as
    this statement wrote it (``RETURNING``), so that another writer of the same model, committing in between,
    never shows in the answer."""
    return conn.execute(_replace_statement([asdict(spec)]).returning(*ServingModel.__table__.c)).one()


def register_model(conn: Connection, model_id: str, changes: dict, labels: dict | None = None
                   ) -> tuple[bool, Row]:
    """Create ``model_id`` from ``changes`` (spec columns; the others at their defaults) and ``labels``, or, when it
    is registered, set only the columns ``changes`` gives and the keys ``labels`` gives (its other columns, labels
    and burst factor stay as stored). A None in ``changes`` means "not given". Returns (created, the row as
    written). Each given value is checked as :class:`ServingModelSpec` checks it; ValueError otherwise."""
    changes = {k: v for k, v in changes.items() if v is not None}
    unknown = sorted(set(changes) - set(SPEC_COLUMNS))
    if unknown:
        raise ValueError(f"not a spec column: {', '.join(unknown)}")
    labels = dict(labels or {})
    spec = ServingModelSpec(id=model_id, labels=labels, **changes)  # checks the given values (defaults: valid)
    columns = ServingModel.__table__.c
    created = conn.execute(insert(ServingModel).values(asdict(spec)).on_conflict_do_nothing(index_elements=["id"])
                           .returning(*columns)).one_or_none()
    if created is not None:
        return True, created
    stored = conn.execute(select(ServingModel.labels).where(ServingModel.id == model_id).with_for_update()).scalar_one()
    values: dict = dict(changes)
    if labels:
        merged = {**(stored or {}), **labels}
        if len(merged) > MAX_LABELS:
            raise ValueError(f"at most {MAX_LABELS} labels, got {len(merged)} with those stored")
        values["labels"] = merged
    if not values:  # nothing given: the row as it is
        return False, conn.execute(select(*columns).where(ServingModel.id == model_id)).one()
    values["updated_at"] = func.now()
    return False, conn.execute(update(ServingModel).where(ServingModel.id == model_id).values(**values)
                               .returning(*columns)).one()


def set_burst_factors(conn: Connection, factors: dict[str, float]) -> int:
    """Store measured burst factors (:mod:`forecaster.contracts.bursts`) of the catalogued models among
    ``factors``; returns how many were stored. Ids not in the catalogue are left out, as their counts are."""
    if not factors:
        return 0
    ids = sorted(factors)
    values = [min(max(float(factors[i]), 1.0), MAX_BURST_FACTOR) for i in ids]
    return conn.execute(text(
        "UPDATE serving_models m SET burst_factor = v.b, updated_at = now() "
        "FROM unnest(CAST(:ids AS text[]), CAST(:values AS double precision[])) AS v(id, b) WHERE m.id = v.id"),
        {"ids": ids, "values": values}).rowcount


def advance_burst_factors(conn: Connection, model_ids: list[str], minute_starts: pd.DatetimeIndex,
                          minute_requests: np.ndarray, minute_peak_bucket: np.ndarray) -> int:
    """Move the stored burst factors of ``model_ids`` by minutes of counts and 10-second peaks
    ((models, minutes) arrays, NaN where a model has no count or no peak; the minutes ``minute_starts`` in
    ascending order; :func:`forecaster.contracts.bursts.smooth_burst_factors`); returns how many factors moved.

    Each minute moves a factor once: a minute that starts before the model's ``burst_through`` (a re-sent or
    corrected minute, or one that comes late) is left out, and ``burst_through`` advances to the end of the model's
    newest minute given. The rows are locked while read, so two writers never both start from the same factor.
    Call it in the transaction that stores those minutes' counts."""
    if not len(model_ids):
        return 0
    rows = {r[0]: (r[1], r[2]) for r in conn.execute(text(
        "SELECT id, burst_factor, burst_through FROM serving_models WHERE id = ANY(CAST(:ids AS text[])) "
        "ORDER BY id FOR UPDATE"), {"ids": list(model_ids)})}
    ids = [i for i in model_ids if i in rows]
    keep_rows = np.array([i in rows for i in model_ids], dtype=bool)
    starts = pd.DatetimeIndex(minute_starts)
    start_ns = (starts.tz_localize("UTC") if starts.tz is None else starts.tz_convert("UTC")).as_unit("ns").asi8
    requests = np.asarray(minute_requests, dtype="float64")[keep_rows]
    peaks = np.asarray(minute_peak_bucket, dtype="float64")[keep_rows]
    given = ~np.isnan(requests) & ~np.isnan(peaks)
    through_ns = np.array([pd.Timestamp(rows[i][1]).value if rows[i][1] is not None else np.iinfo(np.int64).min
                           for i in ids], dtype=np.int64)
    fresh = given & (start_ns[None, :] >= through_ns[:, None])
    prior = np.array([np.nan if rows[i][0] is None else float(rows[i][0]) for i in ids])
    factors, moved = smooth_burst_factors(prior, np.where(fresh, requests, 0.0), np.where(fresh, peaks, 0.0))
    has = given.any(axis=1)
    if has.any():
        newest = np.where(given, start_ns[None, :], np.iinfo(np.int64).min).max(axis=1)
        ends = [pd.Timestamp(int(ns), tz="UTC").to_pydatetime() + timedelta(minutes=1) for ns in newest[has]]
        conn.execute(text(
            "UPDATE serving_models m SET burst_through = greatest(m.burst_through, v.e) "
            "FROM unnest(CAST(:ids AS text[]), CAST(:ends AS timestamptz[])) AS v(id, e) WHERE m.id = v.id"),
            {"ids": [i for i, h in zip(ids, has) if h], "ends": ends})
    return set_burst_factors(conn, {i: float(f) for i, f, m in zip(ids, factors, moved) if m})


#: Models one INSERT of :func:`register_missing` adds (a few bound parameters each, far under the protocol's limit).
REGISTER_CHUNK = 5_000


def register_missing(conn: Connection, model_ids: Iterable[str], *, labels: dict | None = None) -> list[str]:
    """Auto-register ids not yet in the catalogue (defaults for every spec field)."""
    ids = sorted(set(model_ids))
    added: list[str] = []
    # in chunks: a multi-row INSERT binds parameters per model, and PostgreSQL's protocol allows 65,535 in one
    # statement (22,000 new models at once failed, and the error read as the database being away)
    for first in range(0, len(ids), REGISTER_CHUNK):
        stmt = (
            insert(ServingModel)
            .values([{"id": i, "labels": labels or {}} for i in ids[first:first + REGISTER_CHUNK]])
            .on_conflict_do_nothing(index_elements=["id"])
            .returning(ServingModel.id)
        )
        added += [r[0] for r in conn.execute(stmt)]
    return sorted(added)


def missing_model_ids(conn: Connection, model_ids: Iterable[str]) -> list[str]:
    """The ids of ``model_ids`` that are not in the catalogue, sorted."""
    return list(conn.execute(
        text("SELECT w.id FROM unnest(CAST(:ids AS text[])) AS w(id) "
             "LEFT JOIN serving_models m ON m.id = w.id WHERE m.id IS NULL ORDER BY w.id"),
        {"ids": sorted(set(model_ids))},
    ).scalars())


def known_model_ids(engine: Engine | Connection) -> set[str]:
    def _query(conn: Connection) -> set[str]:
        return set(conn.execute(select(ServingModel.id)).scalars())

    if isinstance(engine, Connection):
        return _query(engine)
    with engine.connect() as conn:
        return _query(conn)


def list_models(engine: Engine) -> list[ServingModel]:
    from sqlalchemy.orm import Session

    with Session(engine) as session:
        return list(session.scalars(select(ServingModel).order_by(ServingModel.id)))


def read_catalogue_sizes(conn: Connection) -> list[tuple]:
    """``(id, replica_rps, image_size_bytes, weights_size_bytes)`` of every model, for the API's snapshot.

    ``replica_rps`` is what one replica serves when requests come at the model's burst factor
    (:mod:`forecaster.contracts.bursts`): the catalogue's rate divided by the factor, so that a recommendation
    serves its quantile at the burst's peak rate. (The plan job sizes a bursty minute between that and the
    even-arrival size, by the queue the burst builds: :func:`forecaster.planning.planner._burst_queue_sizes`.)"""
    return conn.execute(text("SELECT id, replica_rps / coalesce(burst_factor, 1.0), image_size_bytes, "
                             "weights_size_bytes FROM serving_models ORDER BY id")).all()


def require_models(conn: Connection, model_ids: Iterable[str], *, register: bool, source: str) -> None:
    """Register ``model_ids`` missing from the catalogue (``register``), else refuse the batch naming the first."""
    ids = sorted(set(model_ids))
    if register:
        register_missing(conn, ids, labels={"registered_by": source})
    missing = missing_model_ids(conn, ids)
    if missing:
        raise IngestError("unknown_model", f"model {missing[0]!r} is not registered", field="model_id",
                          value=missing[0])
