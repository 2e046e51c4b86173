"""Validation of observed cold-start events (total and per-phase seconds)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

import pandas as pd

from forecaster.contracts.batches import IngestError
from forecaster.contracts.phases import CACHE_STATES, PHASES
from forecaster.store.fields import (MAX_COLD_START_S, MIN_COLD_START_S, MIN_TIMESTAMP, id_problem, safe_repr, safe_value,
                                      timestamp_text_problem)

REQUIRED = ("model_id", "node_id", "started_at", "total_seconds")
KNOWN_FIELDS = frozenset((*REQUIRED, *PHASES, "cache_state", "event_id"))
# Phases may overlap a little with each other (streamed loads); more than this is a bad event.
PHASE_SUM_TOLERANCE = 1.05


def parse_seconds(row: int, field: str, value: object, *, required: bool, minimum: float = 0.0) -> float | None:
    """A duration field in seconds: finite, >= 0, at most ``MAX_COLD_START_S``; None when absent and optional.

    ``minimum`` > 0 (the total: :data:`MIN_COLD_START_S`) also refuses a value below it (``zero_duration``).
    """
    if value is None:
        if required:
            raise IngestError("missing_field", "value is required", row=row, field=field)
        return None
    if isinstance(value, bool):
        raise IngestError("not_a_number", f"expected seconds, got {value!r}", row=row, field=field, value=value)
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:  # a JSON integer of 310 digits or more
        raise IngestError("duration_too_long", f"duration exceeds {MAX_COLD_START_S:g} s", row=row, field=field,
                          value=safe_value(value)) from None
    except (TypeError, ValueError):
        raise IngestError("not_a_number", f"expected seconds, got {value!r}", row=row, field=field,
                          value=value) from None
    if math.isnan(number):
        raise IngestError("nan", "value is NaN", row=row, field=field, value=value)
    if math.isinf(number):
        raise IngestError("infinite", "value is infinite", row=row, field=field, value=value)
    if number < 0:
        raise IngestError("negative_duration", f"duration is negative: {number:g}", row=row, field=field,
                          value=value)
    if minimum > 0 and number < minimum:
        raise IngestError("zero_duration", f"duration {number:g} s is shorter than {minimum:g} s, the shortest "
                          "possible cold start", row=row, field=field, value=safe_value(value))
    if number > MAX_COLD_START_S:
        raise IngestError("duration_too_long", f"duration {number:g} s is longer than {MAX_COLD_START_S:g} s "
                          "(one day)", row=row, field=field, value=safe_repr(value))
    return number


def validate_cold_starts(
    events: Iterable[Mapping[str, object]],
    *,
    now: datetime,
    max_future_skew_s: float = 300.0,
    known_models: set[str] | None = None,
) -> pd.DataFrame:
    """Check cold-start events; return them as a frame, or raise on the first bad one.

    Each event needs ``model_id``, ``node_id``, ``started_at`` (ISO time or
    datetime; naive means UTC) and ``total_seconds`` (at least :data:`MIN_COLD_START_S`); the phases in
    :data:`PHASES`, ``cache_state`` (one of :data:`CACHE_STATES`) and ``event_id`` are optional. ``event_id``
    tells apart starts of one model on one node at the same instant (two replicas of a scale-up; the collector
    sends the pod's uid); without it an event is its (model, node, start). An event repeated inside a batch (same
    model, node, start and ``event_id``) is rejected.

    Raises:
        IngestError: naming the 1-based row and the field.
    """
    limit = pd.Timestamp(now).tz_convert("UTC") + timedelta(seconds=max_future_skew_s)
    rows: list[dict[str, object]] = []
    seen: dict[tuple[str, str, pd.Timestamp], int] = {}
    for position, event in enumerate(events, start=1):
        if not isinstance(event, Mapping):
            raise IngestError("bad_row", f"expected an object, got {type(event).__name__}", row=position)
        unknown = sorted((str(k) for k in set(event) - KNOWN_FIELDS), key=str)
        if unknown:
            raise IngestError("unknown_field", f"unknown field; expected some of {sorted(KNOWN_FIELDS)}",
                              row=position, field=safe_repr(unknown[0]).strip("'"))
        for name in ("model_id", "node_id"):
            value = event.get(name)
            if not isinstance(value, str) or not value.strip():
                raise IngestError("missing_field", "a non-empty string is required", row=position, field=name,
                                  value=None if value is None else safe_value(value))
            problem = id_problem(value.strip())
            if problem:
                reason = "id_too_long" if "longer than" in problem else "bad_id"
                raise IngestError(reason, f"id {problem}", row=position, field=name, value=safe_value(value, 40))
        raw_start = event.get("started_at")
        if isinstance(raw_start, (int, float)) and not isinstance(raw_start, bool):
            raise IngestError("bad_timestamp", f"numeric time {raw_start!r} is ambiguous; send ISO 8601 text",
                              row=position, field="started_at", value=raw_start)
        if not isinstance(raw_start, (str, datetime)) or (isinstance(raw_start, str)
                                                          and timestamp_text_problem(raw_start)):
            shown = safe_repr(raw_start)
            raise IngestError("bad_timestamp", f"expected ISO 8601 text such as 2026-11-29T12:00:00Z, got {shown}",
                              row=position, field="started_at", value=shown)
        try:
            started = pd.Timestamp(raw_start)
        except (TypeError, ValueError, OverflowError):
            started = pd.NaT
        if started is pd.NaT or pd.isna(started):
            raise IngestError("bad_timestamp", f"cannot read {safe_repr(raw_start)} as a timestamp",
                              row=position, field="started_at", value=safe_repr(raw_start))
        started = started.tz_localize("UTC") if started.tzinfo is None else started.tz_convert("UTC")
        started = started.floor("us")  # what the store keeps: two starts within a microsecond are one event
        if started < pd.Timestamp(MIN_TIMESTAMP):
            raise IngestError("timestamp_too_early", f"start {started.isoformat()} is before "
                              f"{MIN_TIMESTAMP.date().isoformat()}, the earliest accepted", row=position,
                              field="started_at", value=started.isoformat())
        if started > limit:
            raise IngestError("future_timestamp", f"start {started.isoformat()} is in the future", row=position,
                              field="started_at", value=started.isoformat())
        model_id = str(event["model_id"]).strip()
        if known_models is not None and model_id not in known_models:
            raise IngestError("unknown_model", f"model {model_id!r} is not registered", row=position,
                              field="model_id", value=model_id)
        total = parse_seconds(position, "total_seconds", event.get("total_seconds"), required=True,
                              minimum=MIN_COLD_START_S)
        phases = {p: parse_seconds(position, p, event.get(p), required=False) for p in PHASES}
        phase_sum = sum(v for v in phases.values() if v is not None)
        if total is not None and phase_sum > total * PHASE_SUM_TOLERANCE + 1e-9:
            raise IngestError("inconsistent_phases",
                              f"phases add up to {phase_sum:g} s, more than the total {total:g} s",
                              row=position, field="total_seconds", value=total)
        cache_state = event.get("cache_state")
        if cache_state is not None and (not isinstance(cache_state, str) or cache_state not in CACHE_STATES):
            raise IngestError("bad_cache_state", f"expected one of {list(CACHE_STATES)}", row=position,
                              field="cache_state", value=safe_value(cache_state))
        event_id = event.get("event_id")
        if event_id is None:
            event_id = ""
        elif not isinstance(event_id, str) or not event_id.strip():
            raise IngestError("bad_event_id", "expected a non-empty string, or no event_id", row=position,
                              field="event_id", value=safe_value(event_id, 40))
        else:
            event_id = event_id.strip()
            problem = id_problem(event_id)
            if problem:
                raise IngestError("id_too_long" if "longer than" in problem else "bad_id", f"id {problem}",
                                  row=position, field="event_id", value=safe_value(event_id, 40))
        key = (model_id, str(event["node_id"]).strip(), started, event_id)
        if key in seen:
            raise IngestError("duplicate", f"same event as row {seen[key]}", row=position, field="started_at",
                              value=started.isoformat())
        seen[key] = position
        rows.append({"model_id": key[0], "node_id": key[1], "started_at": started.to_pydatetime(),
                     "total_seconds": total, **phases, "cache_state": cache_state, "event_id": event_id})
    return pd.DataFrame(rows, columns=["model_id", "node_id", "started_at", "total_seconds", *PHASES, "cache_state",
                                       "event_id"])
