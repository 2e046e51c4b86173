"""Ingest paths end to end: read -> validate -> write, each one transaction with retry.

These are the functions the CLI, the scheduler's ingest job and (later) the
HTTP API call. Each takes the engine, the settings and ``now`` explicitly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pandas as pd
from sqlalchemy import Connection, Engine

from forecaster.contracts.batches import CountBatch, IngestError
from forecaster.ingest.coldstarts import validate_cold_starts
from forecaster.ingest.transfers import validate_transfers
from forecaster.store.fields import id_problem, safe_repr, safe_value
from forecaster.ingest.validate import build_count_batch
from forecaster.settings import Settings
from forecaster.store.catalog import known_model_ids, set_burst_factors
from forecaster.store.coldstarts import write_cold_starts
from forecaster.store.db import run_with_retry
from forecaster.store.invocations import WriteResult, asked_through, coverage_ends, covered_within, \
    record_asked_through, write_count_batch
from forecaster.store.transfers import write_transfers

log = logging.getLogger(__name__)


def _register(settings: Settings, register: bool | None) -> bool:
    return settings.auto_register_models if register is None else register


#: Fields of one pushed count row; anything else is refused (``unknown_field``), never silently ignored.
PUSH_ROW_FIELDS = ("model_id", "minute", "count")
#: An optional field of a pushed row: the most requests of any 10-second bucket of the row's minute, which moves
#: the model's burst factor (:mod:`forecaster.contracts.bursts`).
PUSH_PEAK_FIELD = "peak_10s"
#: SQLSTATE 23505 (unique_violation): two writers copied the same (model, minute) at once; the whole
#: transaction is rerun and then sees the other's committed rows (last writer wins, never a 500).
UNIQUE_VIOLATION = "23505"


def write_with_retry(engine: Engine, settings: Settings, batch: CountBatch, *, register: bool,
                     report_zeroed: bool = False, lock_timeout_s: float | None = None,
                     then: Callable[[Connection], int] | None = None) -> WriteResult:
    """Write a batch, retrying the whole transaction when the database drops out or a concurrent writer won."""
    return run_with_retry(
        lambda: write_count_batch(engine, batch, register_models=register, report_zeroed=report_zeroed,
                                  lock_timeout_s=lock_timeout_s, then=then),
        attempts=settings.db_retry_attempts,
        base_delay_s=settings.db_retry_base_delay_s,
        what=f"ingest {batch.source}",
        also_retry=(UNIQUE_VIOLATION,),
    )


def ingest_frame(
    engine: Engine,
    settings: Settings,
    raw: pd.DataFrame,
    *,
    source: str,
    step_seconds: int,
    now: datetime,
    windows: pd.DataFrame | None = None,
    register: bool | None = None,
    report_zeroed: bool = False,
    lock_timeout_s: float | None = None,
    then: Callable[[Connection], int] | None = None,
) -> WriteResult:
    """Validate a raw long frame (``unique_id, ds, y``) and write it.

    ``report_zeroed`` makes the result say which stored non-zero minutes the
    batch turned into zeros (pushes: the sender sees a warning);
    ``lock_timeout_s`` bounds the wait for another writer of the same models
    (pushes; then SQLSTATE 55P03, answered 503 busy); ``then`` writes more in
    the batch's transaction (:func:`~forecaster.store.invocations.write_count_batch`).
    """
    register_models = _register(settings, register)
    batch = _validate(engine, settings, raw, source=source, step_seconds=step_seconds, now=now, windows=windows,
                      register_models=register_models)
    return write_with_retry(engine, settings, batch, register=register_models, report_zeroed=report_zeroed,
                            lock_timeout_s=lock_timeout_s, then=then)


def _read_with_retry(engine: Engine, settings: Settings, read: Callable[[], object], what: str):
    """A read of the ingest path, retried as the write is: the database going away just before it must not end
    an ingest that the write would have carried through."""
    return run_with_retry(read, attempts=settings.db_retry_attempts, base_delay_s=settings.db_retry_base_delay_s,
                          what=what)


def _validate(engine: Engine, settings: Settings, raw: pd.DataFrame, *, source: str, step_seconds: int,
              now: datetime, windows: pd.DataFrame | None, register_models: bool) -> CountBatch:
    """The validated batch of ``raw`` (registered models only, unless ``register_models``)."""
    known = None if register_models else _read_with_retry(engine, settings, lambda: known_model_ids(engine),
                                                          f"models of {source}")
    return build_count_batch(
        raw,
        source=source,
        step_seconds=step_seconds,
        now=now,
        max_future_skew_s=settings.max_future_skew_s,
        known_models=known,
        windows=windows,
        max_span_days=settings.max_batch_span_days,
    )


def ingest_trace_file(
    engine: Engine,
    settings: Settings,
    path: Path,
    *,
    now: datetime,
    fmt: str | None = None,
    start: datetime | None = None,
    step_seconds: int = 60,
    model_id: str | None = None,
    register: bool | None = None,
) -> WriteResult:
    """Ingest one trace file in any supported format (see :mod:`forecaster.ingest.traces`)."""
    from forecaster.ingest.traces import read_trace

    # zero cells of a wide file are left to the windows (a raw row per cell took ~90x the file's size)
    trace = read_trace(Path(path), fmt=fmt, start=start, step_seconds=step_seconds, model_id=model_id,
                       keep_zeros=False)
    register_models = _register(settings, register)
    # validated first: the overlap is read with the batch's checked windows (a model id PostgreSQL cannot hold,
    # NUL, ended here in a database error rather than the validator's message)
    batch = _validate(engine, settings, trace.raw, source=trace.source, step_seconds=trace.step_seconds, now=now,
                      windows=trace.windows, register_models=register_models)
    overlap = [] if trace.windows is None else _read_with_retry(
        engine, settings, lambda: covered_within(engine, batch.windows, source=trace.source,
                                                 step_seconds=trace.step_seconds), f"coverage of {trace.source}")
    result = write_with_retry(engine, settings, batch, register=register_models, report_zeroed=True)
    if overlap and not result.duplicate:
        result = replace(result, warnings=result.warnings + (_overlap_warning(overlap, trace.source),))
    if not trace.burst_factors:
        return result
    # after the counts, so that a model the batch registered is in the catalogue; a run that fails here has
    # stored its counts, and running it again stores the factors (the counts are then a duplicate batch)
    stored = run_with_retry(lambda: _store_burst_factors(engine, trace.burst_factors),
                            attempts=settings.db_retry_attempts, base_delay_s=settings.db_retry_base_delay_s,
                            what=f"burst factors of {trace.source}")
    return replace(result, burst_factors_stored=stored)


def _overlap_warning(overlap: list[tuple[str, datetime, datetime]], source: str) -> str:
    """What a trace file replaced of what its source had stored: a file that continues another (a trace split in
    parts) replaces the minutes they share with its own part of them."""
    steps = sum(int((end - begin).total_seconds()) // 60 for _, begin, end in overlap)
    model, begin, end = overlap[0]
    models = len({m for m, _, _ in overlap})
    more = f" and {models - 1} more models" if models > 1 else ""
    return (f"this file covers {steps} model-minutes that {source} had already stored, and replaced them: model "
            f"{model!r} from {begin.isoformat()} to {end.isoformat()}{more}. If it continues another file of the "
            "same trace, the minute the two share now holds only this file's part of it: ingest a trace as one file")


def _store_burst_factors(engine: Engine, factors: dict[str, float]) -> int:
    with engine.begin() as conn:
        return set_burst_factors(conn, factors)


def push_counts(
    engine: Engine,
    settings: Settings,
    rows: Iterable[Mapping[str, object]],
    *,
    now: datetime,
    source: str = "push",
    windows: pd.DataFrame | None = None,
    register: bool | None = None,
) -> WriteResult:
    """Ingest a pushed batch of ``{"model_id", "minute", "count"}`` objects.

    Unless ``windows`` says otherwise, the batch covers each model from its
    first to its last minute, so minutes left out in between are zeros.
    """
    rows = list(rows)
    if not rows:
        raise IngestError("empty_batch", "the batch holds no rows")
    checked_ids: dict[object, str | None] = {}  # a batch repeats each id once per minute: check each once
    for position, row in enumerate(rows, start=1):
        if not isinstance(row, Mapping):
            raise IngestError("bad_row", f"expected an object, got {type(row).__name__}", row=position)
        unknown = sorted((str(k) for k in row if k not in PUSH_ROW_FIELDS and k != PUSH_PEAK_FIELD), key=str)
        if unknown:
            raise IngestError("unknown_field", f"unknown field {safe_repr(unknown[0])}; a row has exactly "
                              f"{list(PUSH_ROW_FIELDS)}, and optionally {PUSH_PEAK_FIELD!r}", row=position,
                              field=safe_repr(unknown[0]).strip("'"))
        for name in PUSH_ROW_FIELDS:
            if name not in row:
                raise IngestError("missing_field", "field is required", row=position, field=name)
        model_id = row["model_id"]
        try:
            problem = checked_ids[model_id]
        except (KeyError, TypeError):  # TypeError: an unhashable id (a list) is checked, and refused, each time
            blank = model_id is None or (isinstance(model_id, str) and not model_id.strip())
            problem = None if blank else id_problem(model_id)  # blank ids: "missing_model" from the validator
            if isinstance(model_id, str):
                checked_ids[model_id] = problem
        if problem:
            reason = "id_too_long" if isinstance(model_id, str) and "longer than" in problem else "bad_model_id"
            raise IngestError(reason, f"model id {problem}", row=position, field="model_id",
                              value=safe_value(model_id))
        if not isinstance(row["minute"], (str, datetime)):
            raise IngestError("bad_timestamp", f"expected ISO 8601 text, got {type(row['minute']).__name__}",
                              row=position, field="minute", value=safe_repr(row["minute"]))
    raw = pd.DataFrame(
        {
            "unique_id": [r["model_id"] for r in rows],
            "ds": [r["minute"] for r in rows],
            "y": pd.Series([r["count"] for r in rows], dtype=object),
        }
    )
    # Field names of the push schema in error messages.
    try:
        peaks = _pushed_peaks(raw, rows)
        return ingest_frame(engine, settings, raw, source=source, step_seconds=60, now=now, windows=windows,
                            register=register, report_zeroed=True,
                            lock_timeout_s=settings.push_lock_timeout_s or None,
                            then=_burst_writer(*peaks) if peaks is not None else None)
    except IngestError as exc:
        renamed = {"unique_id": "model_id", "ds": "minute", "y": "count"}.get(exc.field or "", exc.field)
        if renamed != exc.field:
            message = str(exc).replace(f"field {exc.field!r}", f"field {renamed!r}")
            err = IngestError(exc.reason, message.split(": ", 1)[-1], row=exc.row, field=renamed, value=exc.value)
            raise err from None
        raise


def _pushed_peaks(raw: pd.DataFrame, rows: list[Mapping[str, object]]) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """The counts and 10-second peaks (``unique_id, ds, y`` frames, ``ds`` the minute) of the pushed rows that carry
    ``peak_10s``, checked: a whole number from 0 to the row's count, and the only row of its minute (rows inside
    one minute are summed, and their peaks cannot be). None when no row carries one."""
    from forecaster.ingest.validate import parse_counts, parse_timestamps

    carry = np.array([PUSH_PEAK_FIELD in r for r in rows], dtype=bool)
    if not carry.any():
        return None
    positions = np.flatnonzero(carry)
    peak_raw = pd.DataFrame({"y": pd.Series([rows[i][PUSH_PEAK_FIELD] for i in positions], dtype=object),
                             "row": positions + 1, "field": PUSH_PEAK_FIELD})
    try:
        peaks = parse_counts(peak_raw)
    except IngestError as exc:  # the count's checks, said of the peak
        message = str(exc).split(": ", 1)[-1].replace("count", PUSH_PEAK_FIELD, 1)
        raise IngestError(exc.reason, message, row=exc.row, field=exc.field, value=exc.value) from None
    counts = pd.to_numeric(raw["y"].iloc[positions], errors="coerce").to_numpy(dtype="float64")
    with np.errstate(invalid="ignore"):
        over = np.flatnonzero(peaks > counts)
    if len(over):
        k = int(over[0])
        raise IngestError("peak_above_count", f"peak_10s {int(peaks[k])} is more than the minute's count "
                          f"{safe_repr(rows[positions[k]]['count'])}", row=int(positions[k]) + 1,
                          field=PUSH_PEAK_FIELD, value=int(peaks[k]))
    minutes = parse_timestamps(raw).dt.floor("min")
    cell = pd.DataFrame({"unique_id": raw["unique_id"].astype(str).to_numpy(), "ds": minutes.to_numpy()})
    shared = cell.duplicated(keep=False).to_numpy() & carry
    if shared.any():
        k = int(np.flatnonzero(shared)[0])
        raise IngestError("peak_in_shared_minute", f"a row with {PUSH_PEAK_FIELD} must be the only row of its "
                          "minute: the counts of rows inside one minute are summed, their peaks cannot be",
                          row=k + 1, field=PUSH_PEAK_FIELD, value=safe_value(rows[k][PUSH_PEAK_FIELD]))
    picked = cell.iloc[positions].reset_index(drop=True)
    return picked.assign(y=counts), picked.assign(y=peaks.astype("float64"))


def _push_events(engine: Engine, settings: Settings, events: Iterable[Mapping[str, object]], *, now: datetime,
                 source: str, register: bool | None, validate, write, what: str) -> dict:
    """Validate a pushed batch of observations and write it in one retried transaction."""
    register_models = _register(settings, register)
    known = None if register_models else _read_with_retry(engine, settings, lambda: known_model_ids(engine),
                                                          f"models of {what}")
    frame = validate(events, now=now, max_future_skew_s=settings.max_future_skew_s, known_models=known)
    if frame.empty:
        raise IngestError("empty_batch", f"the batch holds no {what}")
    return run_with_retry(
        lambda: write(engine, frame, source=source, register_models=register_models),
        attempts=settings.db_retry_attempts,
        base_delay_s=settings.db_retry_base_delay_s,
        what=f"ingest {what}",
        # ON CONFLICT updates of one event by two pushes at once: rerun the loser, never a 500
        also_retry=(UNIQUE_VIOLATION,),
    )


def push_cold_starts(engine: Engine, settings: Settings, events: Iterable[Mapping[str, object]], *, now: datetime,
                     source: str = "push", register: bool | None = None) -> dict:
    """Validate and store observed cold starts; re-sending an event updates it in place."""
    return _push_events(engine, settings, events, now=now, source=source, register=register,
                        validate=validate_cold_starts, write=write_cold_starts, what="cold starts")


#: How many rejected rows :func:`store_observed_cold_starts` describes one by one (the rest are counted).
REJECTED_ROWS_SHOWN = 10


def store_observed_cold_starts(engine: Engine, settings: Settings, events: Iterable[Mapping[str, object]], *,
                               now: datetime, source: str, register: bool | None = None) -> dict:
    """Store the cold starts a backend observed: each row on its own merits, the first observation of each kept.

    Unlike :func:`push_cold_starts` (the REST route: all or nothing, a re-send updates), one bad row (a pod of a
    model not in the catalogue, an impossible duration) must not keep the others of a collector run out of the
    store: rows are validated one by one, the good ones written in one retried transaction, the rejected ones
    counted by reason. Rows are told apart by the table's key, (model, node, start, ``event_id``): two replicas
    created in the same second on one node (``creationTimestamp`` has whole seconds) differ in ``event_id`` (the
    pod's uid) and are both stored, with or without another bad row in the run; a row repeating another's key is
    rejected as ``duplicate`` (the first kept). A row already stored is left as it is (first observation
    wins): the collector sees each pod on every run, and a restarted pod's later figures are not its cold start.

    Returns:
        ``{"inserted", "already_stored", "rejected"}`` and, when rows were rejected, ``rejected_reasons``
        (reason -> count) and ``rejected_rows`` (the first :data:`REJECTED_ROWS_SHOWN`: 1-based row, reason,
        field, message).
    """
    events = list(events)
    register_models = _register(settings, register)
    known = None if register_models else known_model_ids(engine)

    def validate(batch: list) -> pd.DataFrame:
        return validate_cold_starts(batch, now=now, max_future_skew_s=settings.max_future_skew_s, known_models=known)

    rejected: list[dict] = []
    try:
        frame = validate(events)  # the usual case: every row good, validated at once
    except IngestError:
        frames: list[pd.DataFrame] = []
        first_row: dict[tuple, int] = {}
        for position, event in enumerate(events, start=1):
            try:
                one = validate([event])
            except IngestError as exc:
                message = str(exc).split(": ", 1)[-1] if exc.row is not None else str(exc)
                rejected.append({"row": position, "reason": exc.reason, "field": exc.field, "message": message})
                continue
            # the table's key (migration 0019): two replicas created in the same second on one node differ in
            # event_id (the pod's uid) and are two cold starts; the same key twice is the same event sent twice
            key = (one.at[0, "model_id"], one.at[0, "node_id"], one.at[0, "started_at"], one.at[0, "event_id"])
            if key in first_row:
                rejected.append({"row": position, "reason": "duplicate", "field": "started_at",
                                 "message": f"same model, node, start and event_id as row {first_row[key]}; the "
                                            "first is kept"})
                continue
            first_row[key] = position
            frames.append(one)
        frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    result = {"inserted": 0, "already_stored": 0}
    if not frame.empty:
        result = run_with_retry(
            lambda: write_cold_starts(engine, frame, source=source, register_models=register_models,
                                      keep_stored=True),
            attempts=settings.db_retry_attempts, base_delay_s=settings.db_retry_base_delay_s,
            what="store observed cold starts")
    result["rejected"] = len(rejected)
    if rejected:
        reasons: dict[str, int] = {}
        for row in rejected:
            reasons[row["reason"]] = reasons.get(row["reason"], 0) + 1
        result["rejected_reasons"] = reasons
        result["rejected_rows"] = rejected[:REJECTED_ROWS_SHOWN]
        log.warning("%d of %d observed cold starts (%s) rejected: %s", len(rejected), len(events), source,
                    ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    return result


def push_transfers(engine: Engine, settings: Settings, events: Iterable[Mapping[str, object]], *, now: datetime,
                   source: str = "push", register: bool | None = None) -> dict:
    """Validate and store transfer observations (pre-pulls, pre-loads); re-sending one updates it in place.

    Transfers go to the ``transfers`` table, never to ``cold_starts``: no
    replica waited on them (see :mod:`forecaster.ingest.transfers`).
    """
    return _push_events(engine, settings, events, now=now, source=source, register=register,
                        validate=validate_transfers, write=write_transfers, what="transfers")


PROMETHEUS_SOURCE = "prometheus"
#: Failing models whose error the ingest's summary spells out (``query_errors``); ``query_error_models`` counts
#: them all. A template that fails for every model of a large fleet would otherwise fill each job run's record.
QUERY_ERRORS_SHOWN = 100


def _prometheus_watermarks(engine: Engine, model_ids: list[str]) -> dict[str, datetime]:
    """Per model, the end of the last minute Prometheus ingest covered."""
    return coverage_ends(engine, model_ids, source=PROMETHEUS_SOURCE, step_seconds=60)


#: Most (model, minute) rows one Prometheus batch holds. The models that resume at one minute are written in
#: batches of at most this many rows, each model's span in chunks of at most the source's points per query, so a
#: catch-up of 100,000 models after a day's outage keeps memory (about 50 MB of frames) and transactions bounded.
PROMETHEUS_BATCH_ROWS = 500_000


def ingest_prometheus(engine: Engine, settings: Settings, *, now: datetime, source=None, burst_source=None
                      ) -> dict:
    """Pull the minutes since each model's watermark from Prometheus and write them.

    Minutes newer than ``now - prometheus_lag_s`` are left for the next run, so
    late scrapes are not frozen in as zeros; a model never ingested starts
    ``prometheus_backfill_minutes`` back. A model with a watermark resumes there, however long prewarm, its
    database or the scheduler was down, but at most ``prometheus_max_catch_up_minutes`` back (Prometheus keeps
    15 days by default) and never in a day the retention job has rolled up (:func:`_catch_up_floor`); the minutes
    before that are given up, and those no earlier run asked for are counted in ``catch_up_skipped_minutes``
    (model-minutes) and ``catch_up_skipped_models``, and logged. A long span is read and written in bounded
    batches (:data:`PROMETHEUS_BATCH_ROWS`, :func:`_ingest_prometheus_span`).

    Models with a burst query (``PREWARM_PROMETHEUS_BURST_QUERY_TEMPLATE``, or the label
    ``prometheus_burst_query``) also have each minute's busiest 10-second count read, and their stored burst
    factor moves by the new minutes (:mod:`forecaster.contracts.bursts`) in the transaction that stores the
    counts. Both queries are asked before a batch is written: Prometheus going away leaves the minutes not written
    yet for the next run. A burst query Prometheus rejects leaves that model's factor as it was and is reported in
    ``burst_errors``; its counts are written. A peak above its minute's count is read as the count
    (:func:`_clip_peaks`) and counted in ``peaks_clipped``.

    One model's query that Prometheus rejects (a ``prometheus_query`` label with a PromQL error, more than one
    series, NaN) costs that model only: it is named in ``query_errors`` and logged, its watermark stays where it
    was, so the next run asks for the same minutes again (after the label is fixed, for a permanent error), and
    the other models are written. Prometheus itself unreachable (:class:`PrometheusUnavailable`) stops the run:
    what is not written yet is left to the next run.

    Args:
        source: a ``PrometheusSource``; built from the settings when omitted.
        burst_source: the ``PrometheusSource`` of the burst queries; built from the settings when omitted.

    Returns:
        Summary with ``models``, ``rows_written``, ``invocations``, ``skipped``, ``burst_factors_updated``,
        ``burst_errors`` (model id -> Prometheus' message), ``peaks_clipped`` (minutes whose peak was above
        their count), ``query_errors`` (model id -> ``error_type``, ``permanent`` and ``error``, the message; at
        most :data:`QUERY_ERRORS_SHOWN` models), ``query_error_models`` (how many models failed),
        ``catch_up_skipped_models`` and ``catch_up_skipped_minutes``.
    """
    from forecaster.ingest.prometheus import PROMETHEUS_MAX_POINTS, PrometheusSource
    from forecaster.store.catalog import list_models

    if source is None:
        if not settings.prometheus_url:
            raise ValueError("PREWARM_PROMETHEUS_URL is not set")
        source = PrometheusSource(settings.prometheus_url, settings.prometheus_query_template,
                                  timeout_s=settings.prometheus_timeout_s)
    summary: dict = {"models": 0, "rows_written": 0, "invocations": 0, "skipped": 0, "burst_factors_updated": 0,
                     "burst_errors": {}, "peaks_clipped": 0, "query_errors": {}, "query_error_models": 0,
                     "catch_up_skipped_models": 0, "catch_up_skipped_minutes": 0}
    models = list_models(engine)
    if not models:
        return summary
    end = (now - timedelta(seconds=settings.prometheus_lag_s)).replace(second=0, microsecond=0)
    overrides = {m.id: m.labels["prometheus_query"] for m in models if m.labels.get("prometheus_query")}
    by_start = _prometheus_starts(engine, settings, {m.id: source.query_for(m.id, overrides) for m in models}, end,
                                  summary)
    burst_overrides = {m.id: m.labels["prometheus_burst_query"] for m in models
                       if m.labels.get("prometheus_burst_query")}
    template = settings.prometheus_burst_query_template
    with_bursts = {m.id for m in models} if template else set(burst_overrides)
    if with_bursts and burst_source is None:
        burst_source = PrometheusSource(source.base_url, template or source.query_template,
                                        timeout_s=settings.prometheus_timeout_s)
    chunk_minutes = int(getattr(source, "max_points_per_query", PROMETHEUS_MAX_POINTS))
    written: set[str] = set()
    for start, ids in sorted(by_start.items()):
        span_minutes = min(int((end - start).total_seconds()) // 60, chunk_minutes)
        per_batch = max(1, PROMETHEUS_BATCH_ROWS // span_minutes)
        for first in range(0, len(ids), per_batch):
            _ingest_prometheus_span(
                engine, settings, source, ids[first:first + per_batch], start, end, now=now,
                chunk_minutes=chunk_minutes, overrides=overrides, burst_source=burst_source,
                burst_ids=with_bursts, burst_overrides=burst_overrides, summary=summary, written=written)
    summary["models"] = len(written)
    summary["skipped"] = len(models) - len(written)
    if summary["query_error_models"] > len(summary["query_errors"]):
        log.warning("Prometheus queries of %d more models failed (not named: the summary names %d)",
                    summary["query_error_models"] - len(summary["query_errors"]), QUERY_ERRORS_SHOWN)
    return summary


def _catch_up_floor(engine: Engine, settings: Settings, end: datetime) -> datetime:
    """The earliest minute a run asks Prometheus for: ``prometheus_max_catch_up_minutes`` before ``end``, and
    after the newest day the retention job rolled up (it keeps no per-minute counts, and refuses them)."""
    from forecaster.store.retention import last_rolled_up_day

    floor = end - timedelta(minutes=settings.prometheus_max_catch_up_minutes)
    rolled = last_rolled_up_day(engine)
    if rolled is not None:
        after = datetime(rolled.year, rolled.month, rolled.day, tzinfo=timezone.utc) + timedelta(days=1)
        floor = max(floor, after)
    return floor


def _prometheus_starts(engine: Engine, settings: Settings, queries: dict[str, str], end: datetime, summary: dict
                       ) -> dict[datetime, list[str]]:
    """The models to read, grouped by the minute each starts at (so that one fetch serves many models).

    A model resumes at its watermark, a model never ingested ``prometheus_backfill_minutes`` before ``end``,
    neither before :func:`_catch_up_floor`. Minutes of a watermark older than the floor are given up; those
    after the newest watermark of all models were never asked for by an earlier run (prewarm was down), and are
    counted in ``summary`` and logged. A model idle for weeks has an old watermark too, but the runs since asked
    for its minutes and found no sample: it resumes where the last run that found nothing stopped
    (:func:`~forecaster.store.invocations.asked_through`), so its minutes are neither asked nor counted again
    every run; under another query than that run's (``queries``: model id -> the query asked now; a corrected
    label), from its watermark again."""
    model_ids = list(queries)
    floor = _catch_up_floor(engine, settings, end)
    backfill_start = end - timedelta(minutes=settings.prometheus_backfill_minutes)
    marks = {m: t.astimezone(timezone.utc) for m, t in _prometheus_watermarks(engine, model_ids).items()}
    asked = asked_through(engine, queries, source=PROMETHEUS_SOURCE)
    newest = max(marks.values(), default=floor)
    by_start: dict[datetime, list[str]] = {}
    for model_id in model_ids:
        start = marks.get(model_id, backfill_start)
        if model_id in asked:  # an earlier run asked up to there and found no sample
            start = max(start, asked[model_id].astimezone(timezone.utc))
        if start < floor:
            never_asked = floor - max(start, newest) if model_id in marks else timedelta(0)
            if never_asked > timedelta(0):
                summary["catch_up_skipped_models"] += 1
                summary["catch_up_skipped_minutes"] += int(never_asked.total_seconds()) // 60
            start = floor
        if start < end:
            by_start.setdefault(start, []).append(model_id)
    if summary["catch_up_skipped_models"]:
        log.warning("Prometheus ingest resumes %d models at %s, the catch-up bound "
                    "(PREWARM_PROMETHEUS_MAX_CATCH_UP_MINUTES=%d, or after the newest rolled-up day): %d model-minutes "
                    "before it are not read", summary["catch_up_skipped_models"], floor.isoformat(),
                    settings.prometheus_max_catch_up_minutes, summary["catch_up_skipped_minutes"])
    return by_start


def _ingest_prometheus_span(engine: Engine, settings: Settings, source, ids: list[str], start: datetime,
                            end: datetime, *, now: datetime, chunk_minutes: int, overrides: dict[str, str],
                            burst_source, burst_ids: set[str], burst_overrides: dict[str, str], summary: dict,
                            written: set[str]) -> None:
    """Read ``ids`` from ``start`` to ``end`` and write them, ``chunk_minutes`` at a time, one batch per chunk.

    The chunks read what one fetch of the whole span would (:meth:`PrometheusSource.fetch`: a model's first
    contiguous run of sampled minutes, a leading gap skipped): a model without a sample yet goes on to the next
    chunk, a model covered to a chunk's end goes on from there, and a model whose coverage stops inside a chunk,
    or would start a chunk late, stops; the next run resumes it at the end of its coverage. A model without any
    sample up to ``end`` (and no query error) has ``end`` recorded as asked, where the next run starts.
    ``written`` collects the models written."""
    pending = list(ids)
    reached: set[str] = set()  # covered from their first sample in this run up to the chunk's start
    lo = start
    while pending and lo < end:
        hi = min(lo + timedelta(minutes=chunk_minutes), end)
        errors: dict = {}
        raw, windows = source.fetch(pending, lo, hi, query_overrides=overrides, errors=errors)
        _record_query_errors(summary, errors)
        late = (windows["unique_id"].isin(reached) & (windows["start"] != lo)).to_numpy()
        if late.any():  # written, such a window would hide the gap before it inside the coverage: stop there
            stopped = set(windows["unique_id"][late])
            windows = windows[~late].reset_index(drop=True)
            raw = raw[~raw["unique_id"].isin(stopped)].reset_index(drop=True)
            raw["row"] = np.arange(1, len(raw) + 1, dtype="int64")
        if not windows.empty:
            peaks = _fetch_peaks(burst_source, [i for i in windows["unique_id"] if i in burst_ids], lo, hi,
                                 burst_overrides, summary["burst_errors"])
            peaks, clipped = _clip_peaks(raw, peaks)
            summary["peaks_clipped"] += clipped
            result = ingest_frame(engine, settings, raw, source=PROMETHEUS_SOURCE, step_seconds=60, now=now,
                                  windows=windows, register=False, then=_burst_writer(raw, peaks))
            summary["rows_written"] += result.rows_written
            summary["invocations"] += result.invocations
            summary["burst_factors_updated"] += result.burst_factors_stored
            written.update(windows["unique_id"])
        ends = dict(zip(windows["unique_id"], windows["end"]))
        going_on = []
        for model_id in pending:
            if model_id in errors:
                continue
            if model_id in ends:
                if ends[model_id] == hi:
                    going_on.append(model_id)
                    reached.add(model_id)
            elif model_id not in reached:
                going_on.append(model_id)
        pending = going_on
        lo = hi
    # asked up to the end and found no sample: the next run starts at the end (a model scaled to zero has no series)
    record_asked_through(engine, {m: source.query_for(m, overrides) for m in pending if m not in reached},
                         source=PROMETHEUS_SOURCE, through=end)


def _record_query_errors(summary: dict, errors: dict) -> None:
    """Name the models whose query Prometheus rejected (``errors``: model id -> ``PrometheusQueryError``) in the
    summary and the log; nothing of theirs is written, so their watermarks stay and the next run asks again."""
    for model_id, exc in errors.items():
        summary["query_error_models"] += 1
        if len(summary["query_errors"]) >= QUERY_ERRORS_SHOWN:
            continue
        kind = "fix its query" if exc.permanent else "asked again next run"
        log.warning("Prometheus query of model %r failed (%s; %s), its minutes are not written: %s", model_id,
                    exc.error_type, kind, exc)
        summary["query_errors"][model_id] = {"error_type": exc.error_type, "permanent": exc.permanent,
                                             "error": str(exc)}


def _fetch_peaks(burst_source, model_ids: list[str], start: datetime, end: datetime, overrides: dict[str, str],
                 errors: dict[str, str]) -> pd.DataFrame:
    """Each minute's busiest 10-second count of ``model_ids`` (``unique_id, ds, y``), asked one model at a time
    so that a burst query Prometheus rejects costs that model's factor only (``errors`` names it)."""
    from forecaster.ingest.prometheus import PrometheusQueryError

    parts = []
    for model_id in model_ids:
        try:
            peaks, _ = burst_source.fetch([model_id], start, end, query_overrides=overrides)
        except PrometheusQueryError as exc:
            log.warning("burst query of model %r failed, its burst factor stays as it was: %s", model_id, exc)
            errors[model_id] = str(exc)
            continue
        parts.append(peaks[["unique_id", "ds", "y"]])
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["unique_id", "ds", "y"])


def _clip_peaks(counts: pd.DataFrame, peaks: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """``peaks`` (``unique_id, ds, y``) with each minute's peak at most that minute's count in ``counts``, and how
    many peaks were above it.

    A minute's busiest 10 seconds cannot hold more requests than the whole minute, but a sampled peak can read
    more: ``increase()`` extrapolates to its window's edges, and a burst query whose range also takes in the last
    bucket of the minute before (``[1m:10s]`` on Prometheus 2.x, see
    :data:`~forecaster.ingest.prometheus.EXAMPLE_BURST_QUERY_TEMPLATE`) counts that bucket's burst again. Such a
    peak is read as the count, all of the minute in one bucket; the count shows in the job's summary, so that a
    burst query that keeps overshooting is seen."""
    if peaks.empty:
        return peaks, 0
    count = peaks[["unique_id", "ds"]].merge(counts[["unique_id", "ds", "y"]], on=["unique_id", "ds"],
                                             how="left")["y"].to_numpy(dtype="float64")  # NaN: no count
    peak = peaks["y"].to_numpy(dtype="float64")
    with np.errstate(invalid="ignore"):
        over = peak > count
    if not over.any():
        return peaks, 0
    return peaks.assign(y=np.where(over, count, peak).astype(peaks["y"].dtype)), int(over.sum())


def _burst_writer(counts: pd.DataFrame, peaks: pd.DataFrame) -> Callable[[Connection], int] | None:
    """The write that moves the burst factors by the minutes that have both a count and a peak (``unique_id, ds,
    y`` frames), oldest first (:func:`~forecaster.store.catalog.advance_burst_factors`)."""
    from forecaster.store.catalog import advance_burst_factors

    if peaks.empty:
        return None
    both = counts[["unique_id", "ds", "y"]].merge(peaks.rename(columns={"y": "peak"}), on=["unique_id", "ds"])
    if both.empty:
        return None
    requests = both.pivot(index="unique_id", columns="ds", values="y").sort_index(axis=1)
    peak = both.pivot(index="unique_id", columns="ds", values="peak").reindex_like(requests)
    ids = [str(i) for i in requests.index]
    minutes = pd.DatetimeIndex(requests.columns)
    req, top = requests.to_numpy(dtype="float64"), peak.to_numpy(dtype="float64")  # NaN: not given
    return lambda conn: advance_burst_factors(conn, ids, minutes, req, top)
