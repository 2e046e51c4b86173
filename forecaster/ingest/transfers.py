"""Validation of transfer observations (pre-pulls and pre-loads a node agent carried out).

One module, clear messages (mlforecast's ``data_validation.py``): each bad
field is refused with an :class:`~forecaster.contracts.batches.IngestError`
naming the 1-based row and the field. Times outside
``[EARLIEST_STARTED_AT, now + max_future_skew_s]`` are refused: a clock that
reports ``0001-01-01`` or next year would otherwise poison every rate the
latency model learns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone

import pandas as pd

from forecaster.contracts.batches import IngestError
from forecaster.contracts.phases import CACHE_STATES
from forecaster.ingest.coldstarts import parse_seconds
from forecaster.ingest.validate import MAX_ID_LENGTH
from forecaster.store.transfers import TRANSFER_COLUMNS, TRANSFER_PHASES

KINDS = ("prepull", "preload")
#: The tier each kind may name: a pre-pull lands an image; a pre-load puts weights on disk, in host or GPU memory.
TIERS = {"prepull": ("image",), "preload": ("disk", "host", "gpu")}
REQUIRED = ("kind", "model_id", "node_id", "ref", "started_at", "seconds")
KNOWN_FIELDS = frozenset((*REQUIRED, "tier", "bytes", *TRANSFER_PHASES, "cache_state"))
#: No transfer observed by prewarm can have started before this (UTC).
EARLIEST_STARTED_AT = datetime(2000, 1, 1, tzinfo=timezone.utc)
#: Phases may overlap a little (a streamed load); more than this over ``seconds`` is a bad observation.
PHASE_SUM_TOLERANCE = 1.05
#: The largest transfer believed (bytes): 100 TB. Larger is a unit error.
MAX_BYTES = 10**14


def _text(row: int, field: str, value: object, *, limit: int | None = MAX_ID_LENGTH) -> str:
    if not isinstance(value, str) or not value.strip():
        raise IngestError("missing_field", "a non-empty string is required", row=row, field=field, value=value)
    if limit is not None and len(value.strip()) > limit:
        raise IngestError("id_too_long", f"longer than {limit} characters", row=row, field=field,
                          value=value[:40] + "...")
    return value.strip()


def _bytes(row: int, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise IngestError("not_a_number", f"expected a byte count, got {value!r}", row=row, field="bytes",
                          value=value)
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value) or value != int(value)):
        raise IngestError("not_a_number", f"expected a whole byte count, got {value!r}", row=row, field="bytes",
                          value=value)
    if value < 0 or value > MAX_BYTES:
        raise IngestError("out_of_range", f"bytes must be in [0, {MAX_BYTES}], got {value!r}", row=row,
                          field="bytes", value=value)
    return int(value)


def _started_at(row: int, value: object, *, now: datetime, max_future_skew_s: float) -> pd.Timestamp:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise IngestError("bad_timestamp", f"numeric time {value!r} is ambiguous; send ISO 8601 text",
                          row=row, field="started_at", value=value)
    try:
        started = pd.Timestamp(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise IngestError("bad_timestamp", f"cannot read {value!r} as a timestamp ({exc})", row=row,
                          field="started_at", value=value) from None
    if started is pd.NaT or pd.isna(started):
        raise IngestError("bad_timestamp", f"cannot read {value!r} as a timestamp", row=row, field="started_at",
                          value=value)
    started = started.tz_localize("UTC") if started.tzinfo is None else started.tz_convert("UTC")
    if started < pd.Timestamp(EARLIEST_STARTED_AT):
        raise IngestError("ancient_timestamp", f"start {started.isoformat()} is before "
                          f"{EARLIEST_STARTED_AT.date().isoformat()}", row=row, field="started_at",
                          value=started.isoformat())
    limit = pd.Timestamp(now).tz_convert("UTC") + timedelta(seconds=max_future_skew_s)
    if started > limit:
        raise IngestError("future_timestamp", f"start {started.isoformat()} is in the future", row=row,
                          field="started_at", value=started.isoformat())
    return started


def validate_transfers(
    events: Iterable[Mapping[str, object]],
    *,
    now: datetime,
    max_future_skew_s: float = 300.0,
    known_models: set[str] | None = None,
) -> pd.DataFrame:
    """Check transfer observations; return them as a frame (columns of the ``transfers`` table), or raise.

    Each needs ``kind`` (prepull | preload), ``model_id``, ``node_id``, ``ref``
    (image reference or weights URI), ``started_at`` (ISO 8601 or datetime;
    naive means UTC) and ``seconds`` (the whole transfer). Optional: ``tier``
    (a pre-pull's is ``image``; a pre-load's disk | host | gpu, default disk),
    ``bytes`` (bytes moved), the phases of :data:`TRANSFER_PHASES` in seconds,
    and ``cache_state`` (what the node held before). A transfer repeated inside
    the batch (same model, node, kind and start) is refused.

    Raises:
        IngestError: naming the 1-based row and the field.
    """
    rows: list[dict[str, object]] = []
    seen: dict[tuple, int] = {}
    for position, event in enumerate(events, start=1):
        if not isinstance(event, Mapping):
            raise IngestError("bad_row", f"expected an object, got {type(event).__name__}", row=position)
        unknown = sorted(set(event) - KNOWN_FIELDS)
        if unknown:
            raise IngestError("unknown_field", f"unknown field; expected some of {sorted(KNOWN_FIELDS)}",
                              row=position, field=str(unknown[0]))
        kind = event.get("kind")
        if kind not in KINDS:
            raise IngestError("bad_kind", f"expected one of {list(KINDS)}", row=position, field="kind", value=kind)
        model_id = _text(position, "model_id", event.get("model_id"))
        node_id = _text(position, "node_id", event.get("node_id"))
        ref = _text(position, "ref", event.get("ref"), limit=4096)
        if known_models is not None and model_id not in known_models:
            raise IngestError("unknown_model", f"model {model_id!r} is not registered", row=position,
                              field="model_id", value=model_id)
        tier = event.get("tier") or TIERS[str(kind)][0]
        if tier not in TIERS[str(kind)]:
            raise IngestError("bad_tier", f"a {kind} lands in one of {list(TIERS[str(kind)])}", row=position,
                              field="tier", value=tier)
        started = _started_at(position, event.get("started_at"), now=now, max_future_skew_s=max_future_skew_s)
        seconds = parse_seconds(position, "seconds", event.get("seconds"), required=True)
        phases = {p: parse_seconds(position, p, event.get(p), required=False) for p in TRANSFER_PHASES}
        if kind == "prepull" and phases["weight_fetch_s"] is not None:
            raise IngestError("inconsistent_phases", "a pre-pull fetches no weights", row=position,
                              field="weight_fetch_s", value=phases["weight_fetch_s"])
        if kind == "preload" and phases["image_pull_s"] is not None:
            raise IngestError("inconsistent_phases", "a pre-load pulls no image", row=position,
                              field="image_pull_s", value=phases["image_pull_s"])
        phase_sum = sum(v for v in phases.values() if v is not None)
        if seconds is not None and phase_sum > seconds * PHASE_SUM_TOLERANCE + 1e-9:
            raise IngestError("inconsistent_phases", f"phases add up to {phase_sum:g} s, more than the "
                              f"transfer's {seconds:g} s", row=position, field="seconds", value=seconds)
        cache_state = event.get("cache_state")
        if cache_state is not None and cache_state not in CACHE_STATES:
            raise IngestError("bad_cache_state", f"expected one of {list(CACHE_STATES)}", row=position,
                              field="cache_state", value=cache_state)
        key = (model_id, node_id, kind, started)
        if key in seen:
            raise IngestError("duplicate", f"same transfer as row {seen[key]}", row=position, field="started_at",
                              value=started.isoformat())
        seen[key] = position
        rows.append({"model_id": model_id, "node_id": node_id, "kind": kind, "tier": tier, "ref": ref,
                     "bytes": _bytes(position, event.get("bytes")), "started_at": started.to_pydatetime(),
                     "seconds": seconds, **phases, "cache_state": cache_state})
    frame = pd.DataFrame(rows, columns=list(TRANSFER_COLUMNS))
    frame["bytes"] = frame["bytes"].astype("Int64")
    return frame
