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
labels the product reads     ``cold_cost`` 0 .. 1e9, ``request_s``     refused where given, not
                             > 0, PromQL not empty, Kubernetes kinds   found wrong at plan or
                             and names (:func:`label_problem`)         actuation time
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
#: Shortest cold-start total accepted, seconds: a new replica is a process that starts, loads a model and passes a
#: readiness check, which takes longer than this; a total of 0 (or 1e-320) is a broken clock or an unset field (three
#: of them once drove the from-nothing prediction to 2.5 s). Phases may be 0 (an image already present).
MIN_COLD_START_S = 0.1
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


#: Longest request duration the label ``request_s`` accepts, seconds (as a cold-start SLO: one day).
MAX_REQUEST_S = 86_400.0
#: Kubernetes object names: a DNS-1123 subdomain (Deployments) and a DNS-1123 label (namespaces).
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
#: ``k8s_kind`` values the Kubernetes backend scales (forecaster.actuation.backends.kubernetes).
K8S_KINDS = ("Deployment", "InferenceService")


def _number_text(value: str, low: float, high: float, *, low_open: bool = False) -> bool:
    """Whether ``value`` is text holding a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``),
    as the readers parse it (``float`` of the stripped text)."""
    try:
        number = float(value.strip())
    except ValueError:
        return False
    return math.isfinite(number) and (number > low if low_open else number >= low) and number <= high


def label_problem(key: str, value: str) -> str | None:
    """Why ``value`` is not usable for ``key`` when the product reads that label, or None.

    The labels read by the code (README "Labels"): ``cold_cost`` (the planner, the report), ``request_s`` (the
    report), ``prometheus_query`` and ``prometheus_burst_query`` (the Prometheus ingest: a complete PromQL
    expression for the model, sent as it is), ``k8s_kind``, ``k8s_name`` and ``k8s_namespace`` (the Kubernetes
    and dry-run backends). Any other key is free text. The readers stay tolerant of rows stored before these checks
    (a value they cannot use: the default, logged); the messages never echo the value.
    """
    from forecaster.contracts.fleet import MAX_COLD_COST

    if key == "cold_cost":
        if not _number_text(value, 0.0, MAX_COLD_COST):
            return (f"label 'cold_cost' must be a number from 0 to {MAX_COLD_COST:g} (GPU-seconds one second of "
                    "cold-start wait is worth), as text such as \"5\"")
    elif key == "request_s":
        if not _number_text(value, 0.0, MAX_REQUEST_S, low_open=True):
            return (f"label 'request_s' must be a number of seconds above 0 and at most {MAX_REQUEST_S:g}, as text "
                    "such as \"1.5\"")
    elif key in ("prometheus_query", "prometheus_burst_query"):
        if not value.strip():
            return f"label {key!r} must be a PromQL expression, not empty (remove the label to use the template)"
        if "{model_id}" in value:
            return (f"label {key!r} is the model's complete PromQL expression, sent as it is: '{{model_id}}' is not "
                    "replaced in it (write the model's name, or use the template setting)")
    elif key == "k8s_kind":
        if value not in K8S_KINDS:
            return f"label 'k8s_kind' must be one of {', '.join(K8S_KINDS)}"
    elif key == "k8s_name":
        if len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value):
            return ("label 'k8s_name' must be a Kubernetes object name: at most 253 lower-case letters, digits, "
                    "'-' and '.', starting and ending with a letter or digit")
    elif key == "k8s_namespace":
        if len(value) > 63 or not _DNS_LABEL.fullmatch(value):
            return ("label 'k8s_namespace' must be a Kubernetes namespace: at most 63 lower-case letters, digits "
                    "and '-', starting and ending with a letter or digit")
    return None


def check_labels(labels: dict) -> dict:
    """Labels are at most :data:`MAX_LABELS` id keys with text values, and those the product reads hold what it
    accepts (:func:`label_problem`); else ValueError naming the label."""
    if not isinstance(labels, dict):
        raise ValueError("labels must be an object of text values")
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels, got {len(labels)}")
    for key, value in labels.items():
        check_id("label key", key)
        problem = text_problem(value, allow_empty=True)
        if problem:
            raise ValueError(f"label {key!r} {problem}")
        problem = label_problem(key, value)
        if problem:
            raise ValueError(problem)
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
