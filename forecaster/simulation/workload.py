"""Workloads for the simulator: request arrival times per model, and the same as per-minute counts.

* Per-minute traces (``azure2019``, ``huawei5min``, ``long``) are read with
  :func:`forecaster.ingest.traces.read_trace` and each step's count is spread
  evenly within its step (``spread="even"``: request ``k`` of ``c`` at
  ``(k + 0.5) / c`` of the step) or uniformly at random (``"uniform"``).
* Per-request traces (``azure_llm2023``, ``mooncake``, ``azure2021``) keep each
  request's own timestamp (``read_trace`` bins them to minutes, so their times
  are read here from the same files).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from forecaster.ingest.traces import AZURE2021_DEFAULT_START, MOONCAKE_DEFAULT_START, _open_text, detect_format, \
    read_trace
from forecaster.planning.forecasts import CountPanel

PER_REQUEST_FORMATS = ("azure_llm2023", "mooncake", "azure2021")


@dataclass(frozen=True)
class Workload:
    """Requests of ``N`` models over ``[0, duration_s)`` seconds after ``start``.

    Attributes:
        ids: (N,) model ids.
        start: UTC time of second 0 (a minute boundary).
        duration_s: simulated span, whole minutes.
        times: (R,) request arrival seconds, sorted.
        model: (R,) model index of each request.
        panel: per-minute counts of the same requests (what forecasters see).
    """

    ids: np.ndarray
    start: pd.Timestamp
    duration_s: float
    times: np.ndarray
    model: np.ndarray
    panel: CountPanel

    @property
    def n_models(self) -> int:
        return len(self.ids)

    @classmethod
    def from_requests(cls, ids: np.ndarray, model: np.ndarray, times: np.ndarray, start: pd.Timestamp,
                      duration_s: float | None = None) -> "Workload":
        """From request times (seconds after ``start``) and model indices."""
        order = np.argsort(times, kind="stable")
        times = np.asarray(times, dtype="float64")[order]
        model = np.asarray(model, dtype=np.int64)[order]
        n_min = int(np.ceil((duration_s if duration_s is not None else (times[-1] + 1e-9 if len(times) else 60))
                            / 60.0))
        n_min = max(n_min, 1)
        counts = np.zeros((len(ids), n_min))
        np.add.at(counts, (model, np.minimum((times // 60).astype(np.int64), n_min - 1)), 1.0)
        start = pd.Timestamp(start)
        return cls(ids=np.asarray(ids, dtype=object), start=start, duration_s=n_min * 60.0, times=times, model=model,
                   panel=CountPanel(ids=np.asarray(ids, dtype=object), start=start, counts=counts))

    @classmethod
    def from_counts(cls, panel: CountPanel, *, step_s: float = 60.0, spread: str = "even",
                    seed: int = 0) -> "Workload":
        """Spread per-step counts within each step; ``panel.counts`` columns are steps of ``step_s``."""
        counts = np.rint(panel.counts).astype(np.int64)
        rows, cols = np.nonzero(counts)
        reps = counts[rows, cols]
        model = np.repeat(rows, reps)
        step_start = np.repeat(cols * step_s, reps)
        # index of each request within its step
        first = np.repeat(np.cumsum(reps) - reps, reps)
        k = np.arange(len(model)) - first
        if spread == "even":
            offset = (k + 0.5) / np.repeat(reps, reps)
        elif spread == "uniform":
            offset = np.random.default_rng(seed).random(len(model))
        else:
            raise ValueError(f"spread must be 'even' or 'uniform', got {spread!r}")
        times = step_start + offset * step_s
        return cls.from_requests(panel.ids, model, times, panel.start, duration_s=counts.shape[1] * step_s)

    def window(self, first_s: float, last_s: float) -> "Workload":
        """Requests in ``[first_s, last_s)``, re-based to start at ``first_s`` (a whole minute)."""
        keep = (self.times >= first_s) & (self.times < last_s)
        return Workload.from_requests(self.ids, self.model[keep], self.times[keep] - first_s,
                                      self.start + pd.Timedelta(seconds=first_s), duration_s=last_s - first_s)


def _llm2023_times(path: Path) -> tuple[np.ndarray, pd.Timestamp]:
    frame = pd.read_csv(path, usecols=["TIMESTAMP"])
    stamps = pd.to_datetime(frame["TIMESTAMP"], utc=True, format="ISO8601")
    start = stamps.min().floor("60s")
    return ((stamps - start).dt.total_seconds()).to_numpy(), start


def _mooncake_times(path: Path) -> tuple[np.ndarray, pd.Timestamp]:
    with _open_text(path) as fh:
        ms = [json.loads(line)["timestamp"] for line in fh if line.strip()]
    return np.asarray(ms, dtype="float64") / 1000.0, pd.Timestamp(MOONCAKE_DEFAULT_START)


def load_workload(path: str | Path, *, fmt: str | None = None, model_id: str | None = None,
                  spread: str = "even", seed: int = 0) -> Workload:
    """Read any supported trace as a workload (see the module docstring)."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt in ("azure_llm2023", "mooncake"):
        times, start = _llm2023_times(path) if fmt == "azure_llm2023" else _mooncake_times(path)
        uid = model_id or read_trace(path, fmt=fmt).raw["unique_id"].iat[0]
        return Workload.from_requests(np.array([uid], dtype=object), np.zeros(len(times), dtype=np.int64), times,
                                      start)
    if fmt == "azure2021":
        frame = pd.read_csv(path, dtype={"func": str})
        begin = frame["end_timestamp"].to_numpy(dtype="float64") - frame["duration"].to_numpy(dtype="float64")
        ids, model = np.unique(frame["func"].astype(str).to_numpy(), return_inverse=True)
        shift = min(0.0, float(np.floor(begin.min() / 60.0) * 60.0))
        start = pd.Timestamp(AZURE2021_DEFAULT_START) + pd.Timedelta(seconds=shift)
        return Workload.from_requests(ids.astype(object), model, begin - shift, start)
    trace = read_trace(path, fmt=fmt)
    raw = trace.raw.copy()
    raw["y"] = pd.to_numeric(raw["y"], errors="coerce").fillna(0.0)
    panel = CountPanel.from_long(raw[["unique_id", "ds", "y"]])
    if trace.step_seconds != 60:
        # keep the step's requests spread within it, and the per-minute panel that results
        steps = CountPanel(ids=panel.ids, start=panel.start,
                           counts=panel.counts[:, ::trace.step_seconds // 60])
        return Workload.from_counts(steps, step_s=float(trace.step_seconds), spread=spread, seed=seed)
    return Workload.from_counts(panel, spread=spread, seed=seed)
