"""Bounds and checks of single fields, shared by every edge: the REST API, the CLI and the ingest paths.

One place says what an id, a size, a rate or a timestamp may be, so that the
API's 422, the CLI's exit code 2 and a rejected pushed batch give the same
answer for the same value. The bounds are the database column's type range,
narrowed to what a real fleet can mean:

==========================  =======================================  ==============================
field                        accepted                                 why
==========================  =======================================  ==============================
ids (model, node, label)     1-256 characters, no control characters  ``String(256)``; PostgreSQL
                             (C0, DEL, C1), no lone surrogates        refuses NUL, UTF-8 refuses
                                                                      surrogates
image / weights size         0 .. 2^50 bytes (1 PiB)                  ``bigint``; no model is larger
replica_rps                  1e-3 .. 1e6 requests per second          ``1e-300`` gave a 300-digit
                                                                      replica count
cold_start_slo_s             1e-3 .. 86,400 s (one day)               finite, positive
burst_factor                 1 .. 6                                   peak 10-s rate over the minute's
                                                                      mean: 6 = a minute in one bucket
cold-start durations         0 .. 86,400 s                            a day-long cold start is a bug
counts per step              0 .. 2^53                                exact in float64
timestamps                   ISO 8601 text (``2026-11-29T12:00Z``);   ``now``, ``today``, numbers and
                             no zone means UTC; from                  ``0001-01-01`` are refused
                             :data:`MIN_TIMESTAMP` to now + skew
==========================  =======================================  ==============================
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone

#: Longest model, node or label id the store keeps (``String(256)`` columns).
MAX_ID_LENGTH = 256
#: Longest free text stored (image reference, weights URI, label value, reasons), characters.
MAX_TEXT_LENGTH = 2048
#: Largest image or weights size accepted, bytes (1 PiB; ``bigint`` holds 2^63 - 1).
MAX_SIZE_BYTES = 2**50
#: Requests per second one replica sustains: accepted range.
MIN_REPLICA_RPS, MAX_REPLICA_RPS = 1e-3, 1e6
#: Cold-start SLO, seconds: accepted range.
MIN_SLO_S, MAX_SLO_S = 1e-3, 86_400.0
#: Longest cold start (total or one phase) accepted, seconds.
MAX_COLD_START_S = 86_400.0
#: Most labels on one model.
MAX_LABELS = 64
#: Range of a PostgreSQL ``bigint``.
BIGINT_MIN, BIGINT_MAX = -(2**63), 2**63 - 1
#: Earliest timestamp accepted anywhere (the oldest public trace is from 2019).
MIN_TIMESTAMP = datetime(2000, 1, 1, tzinfo=timezone.utc)

#: ISO 8601 date or date-time, optional fraction and zone (``Z``, ``+01:00``, ``+0100``); ``T`` or a space.
ISO_8601 = re.compile(
    r"\d{4}-\d{2}-\d{2}"
    r"(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d{1,9})?)?)?"
    r"(?:Z|z|[+-]\d{2}(?::?\d{2})?)?"
)
_SURROGATE = re.compile("[\ud800-\udfff]")
#: Unicode category Cc exactly: C0 controls (NUL included), DEL and the C1 controls.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def text_problem(value: object, *, max_length: int = MAX_TEXT_LENGTH, allow_empty: bool = False) -> str | None:
    """Why ``value`` cannot be stored as text, or None when it can.

    Refused: non-strings, empty or blank text (unless ``allow_empty``), more
    than ``max_length`` characters, control characters (NUL and the other C0
    and C1 codes, DEL: PostgreSQL refuses NUL, logs and terminals mangle the
    rest), and lone surrogates (not encodable as UTF-8).
    """
    if not isinstance(value, str):
        return f"expected text, got {type(value).__name__}"
    if not value.strip() and not allow_empty:
        return "must not be empty"
    if len(value) > max_length:
        return f"longer than {max_length} characters ({len(value)})"
    if _SURROGATE.search(value):
        return "contains a lone surrogate (not valid Unicode text)"
    control = _CONTROL.search(value)
    if control:
        return f"contains the control character U+{ord(control.group()):04X}"
    return None


def id_problem(value: object) -> str | None:
    """Why ``value`` is not a usable id (model, node, token name, label key), or None."""
    return text_problem(value, max_length=MAX_ID_LENGTH)


def check_text(name: str, value: str | None, *, max_length: int = MAX_TEXT_LENGTH) -> str | None:
    """``value`` unchanged, or ValueError naming ``name``; None passes."""
    if value is None:
        return None
    problem = text_problem(value, max_length=max_length)
    if problem:
        raise ValueError(f"{name} {problem}")
    return value


def check_id(name: str, value: str) -> str:
    """``value`` unchanged when it is a valid id, else ValueError naming ``name``."""
    problem = id_problem(value)
    if problem:
        raise ValueError(f"{name} {problem}")
    return value


def check_number(name: str, value: float | int | None, *, low: float, high: float,
                 low_open: bool = False) -> float | int | None:
    """``value`` when finite and in ``[low, high]`` (``(low, high]`` with ``low_open``), else ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value:g}")
    return value


def check_labels(labels: dict) -> dict:
    """Labels are at most :data:`MAX_LABELS` id keys with text values; else ValueError."""
    if not isinstance(labels, dict):
        raise ValueError("labels must be an object of text values")
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels, got {len(labels)}")
    for key, value in labels.items():
        check_id("label key", key)
        problem = text_problem(value, allow_empty=True)
        if problem:
            raise ValueError(f"label {key!r} {problem}")
    return labels


def timestamp_text_problem(value: str) -> str | None:
    """Why the text ``value`` is not an ISO 8601 timestamp, or None (words like ``now`` are refused)."""
    if not ISO_8601.fullmatch(value.strip()):
        return f"expected ISO 8601 text such as 2026-11-29T12:00:00Z, got {safe_repr(value)}"
    return None


def parse_timestamp(value: object) -> datetime:
    """A UTC datetime from ISO 8601 text or a datetime (no zone means UTC); ValueError otherwise.

    Only the form is checked here; :func:`check_timestamp_range` checks the bounds.
    """
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str):
        problem = timestamp_text_problem(value)
        if problem:
            raise ValueError(problem)
        text = re.sub(r"([.,]\d{6})\d+", r"\1", value.strip()).replace(",", ".")  # datetime keeps microseconds
        if text[-1] in "Zz":
            text = text[:-1] + "+00:00"
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"not a valid date or time: {safe_repr(value)}") from None
    else:
        raise ValueError(f"expected ISO 8601 text, got {type(value).__name__}")
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def check_timestamp_range(moment: datetime, *, latest: datetime | None = None) -> datetime:
    """``moment`` when from :data:`MIN_TIMESTAMP` to ``latest`` (when given), else ValueError."""
    if moment < MIN_TIMESTAMP:
        raise ValueError(f"{moment.isoformat()} is before {MIN_TIMESTAMP.date().isoformat()}, the earliest "
                         "time accepted")
    if latest is not None and moment > latest:
        raise ValueError(f"{moment.isoformat()} is after {latest.isoformat()}, the latest time accepted")
    return moment


def safe_value(value: object, limit: int = 80) -> str:
    """``value`` as short text for an error's ``value`` field: text as is (cut, control characters and
    surrogates escaped), anything else as its ``repr``."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    return "".join(c if c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF
                   else c.encode("ascii", "backslashreplace").decode("ascii") for c in text)


def safe_repr(value: object, limit: int = 40) -> str:
    """A short, JSON- and terminal-safe rendering of ``value`` for messages (never the whole input)."""
    text = repr(value)
    if len(text) > limit:
        text = text[:limit] + f"... ({len(text)} characters)"
    return text.encode("ascii", "backslashreplace").decode("ascii")
