"""The one shape every ingest path produces before anything is written.

A :class:`CountBatch` says two things about a set of serving models:

* ``counts``: how many invocations each model had in each step (one row per
  ``(unique_id, ds)``; zero-count steps may be left out), and
* ``windows``: for each model, the half-open time range ``[start, end)`` that
  the batch *covers*. Inside a covered window a step without a row is a true
  zero; outside every window a step is unknown.

Writing a batch replaces whatever the store held for those models inside those
windows, so ingesting the same batch twice never double-counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

COUNT_COLUMNS = ("unique_id", "ds", "y")
MAX_VALUE_CHARS = 80
WINDOW_COLUMNS = ("unique_id", "start", "end")


class IngestError(ValueError):
    """A batch was rejected; nothing of it was written.

    Attributes:
        reason: short machine-readable reason (``negative_count``, ``nan`` ...).
        row: 1-based data row in the source (file line minus header, or the
            position in a pushed batch), when one row is to blame.
        field: the column or field that is wrong.
        value: the offending value, as text.
    """

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        row: int | None = None,
        field: str | None = None,
        value: object = None,
    ) -> None:
        self.reason = reason
        self.row = row
        self.field = field
        text = None if value is None else str(value)
        # the offending value, shortened: an error must never echo a whole (possibly huge) input back
        self.value = text if text is None or len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS] + "..."
        where = []
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field {field!r}")
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly form, used by the CLI and the API's 422 responses."""
        return {
            "reason": self.reason,
            "row": self.row,
            "field": self.field,
            "value": self.value,
            "message": str(self),
        }


@dataclass(frozen=True)
class CountBatch:
    """Validated per-model counts plus the windows they cover.

    Attributes:
        source: where the data came from (``trace:azure2019``, ``prometheus``,
            ``push`` ...); coverage is recorded per source.
        step_seconds: the width of one step (60 for per-minute data, 300 for
            5-minute bins). Every ``ds`` is aligned to it.
        counts: columns ``unique_id`` (str), ``ds`` (UTC timestamps, start of
            the step), ``y`` (int64 >= 0); unique per ``(unique_id, ds)``.
        windows: columns ``unique_id``, ``start``, ``end`` (UTC); one row per
            model; every count lies inside its model's window.
    """

    source: str
    step_seconds: int
    counts: pd.DataFrame
    windows: pd.DataFrame

    @property
    def model_ids(self) -> list[str]:
        return sorted(self.windows["unique_id"].unique().tolist())

    @property
    def total_invocations(self) -> int:
        return int(self.counts["y"].sum()) if len(self.counts) else 0

    @property
    def covered_steps(self) -> int:
        """Number of (model, step) cells the batch speaks for, zeros included."""
        span = (self.windows["end"] - self.windows["start"]).dt.total_seconds()
        return int((span // self.step_seconds).sum())
