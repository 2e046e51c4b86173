"""The report's numbers: one JSON-ready dict, embedded in the page and written by ``--json``.

* ``policies``: per policy, the simulator's own summary row (:meth:`SimResult.summary` plus the replay's extra:
  :func:`forecaster.simulation.runner.summary_table`), scored window only.
* ``comparison``: cold-start requests prewarm avoided against reactive and keep-alive, and the GPU-seconds and
  bytes it spent beyond each (negative: it spent less).
* ``models``: per model, requests, cold-start requests, GPU-seconds and bytes per policy, and the error of the
  forecast prewarm planned with (``FORECAST_AHEAD_MIN`` ahead; minutes where it was recorded).
* ``series``: the same in time bins for the plots (fleet, and per model: actual, forecast median and 80 % band,
  cold-start requests per policy).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

import numpy as np

from forecaster.report.replay import FORECAST_AHEAD_MIN, Replay

#: bin widths (minutes) the plots may use; the smallest that keeps a series at most MAX_POINTS long
BIN_CHOICES = (1, 5, 10, 15, 30, 60, 120, 240, 1440)
MAX_POINTS = 1500


def bin_minutes(scored_minutes: int) -> int:
    return next((b for b in BIN_CHOICES if scored_minutes / b <= MAX_POINTS), BIN_CHOICES[-1])


def _bins(values: np.ndarray, width: int) -> np.ndarray:
    """Sum over bins of ``width`` columns (the last bin may be shorter); NaN only where a bin is all NaN."""
    values = np.asarray(values, dtype="float64")
    n_bins = math.ceil(values.shape[-1] / width)
    padded = np.full((*values.shape[:-1], n_bins * width), np.nan)
    padded[..., :values.shape[-1]] = values
    shaped = padded.reshape(*values.shape[:-1], n_bins, width)
    out = np.nansum(shaped, axis=-1)
    return np.where(np.isnan(shaped).all(axis=-1), np.nan, out)


def _clean(value):
    """JSON-ready: numpy scalars to Python, NaN/inf to None, recursively."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, np.ndarray):
        return [_clean(v) for v in value.tolist()]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def _rounded(values: np.ndarray, digits: int) -> list:
    return [None if not np.isfinite(v) else (int(v) if digits == 0 else round(float(v), digits))
            for v in np.asarray(values, dtype="float64")]


def forecast_error(actual: np.ndarray, median: np.ndarray, low: np.ndarray, high: np.ndarray) -> dict:
    """MAE and WAPE of the median, and the share of minutes inside [q0.1, q0.9], over minutes with a forecast."""
    ok = np.isfinite(median)
    if not ok.any():
        return {"minutes": 0, "mae": None, "wape_pct": None, "coverage_80_pct": None}
    err = np.abs(actual[ok] - median[ok])
    total = float(actual[ok].sum())
    inside = (actual[ok] >= low[ok] - 1e-9) & (actual[ok] <= high[ok] + 1e-9)
    return {"minutes": int(ok.sum()), "mae": float(err.mean()),
            "wape_pct": float(100.0 * err.sum() / total) if total > 0 else None,
            "coverage_80_pct": float(100.0 * inside.mean())}


def build_numbers(run: Replay, *, generated_at: datetime | None = None, stage_seconds: dict | None = None) -> dict:
    """Every number the page shows (see the module docstring)."""
    h = run.history
    names = list(run.results)
    keep = run.keepalive
    scored = slice(h.since_col, h.counts.shape[1])
    actual = h.counts[:, scored]
    n_scored = actual.shape[1]
    sim_scored = slice(h.since_col - run.workload_start_col, None)
    rec = run.forecasts
    q = {level: rec.values[level][:, scored].astype("float64") for level in rec.values}
    per_model = []
    for i, model_id in enumerate(h.ids):
        row = {"model_id": str(model_id), "requests": int(run.results["prewarm"].requests[i])}
        for key, attr in (("cold_requests", "cold_requests"), ("gpu_seconds", "gpu_seconds_by_model"),
                          ("bytes_registry", "bytes_registry_by_model"),
                          ("bytes_object_store", "bytes_object_store_by_model")):
            row[key] = {p: float(getattr(run.results[p], attr)[i]) for p in names}
        row["cold_requests"] = {p: int(v) for p, v in row["cold_requests"].items()}
        row["avoided_vs_reactive"] = row["cold_requests"]["reactive"] - row["cold_requests"]["prewarm"]
        row["avoided_vs_keepalive"] = row["cold_requests"][keep] - row["cold_requests"]["prewarm"]
        row["forecast"] = forecast_error(actual[i], q[0.5][i], q[0.1][i], q[0.9][i])
        per_model.append(row)
    per_model.sort(key=lambda r: (-r["requests"], r["model_id"]))
    table = run.table
    comparison = {}
    for other in ("reactive", keep):
        comparison[other] = {
            "cold_requests_avoided": int(table[other]["cold_requests"] - table["prewarm"]["cold_requests"]),
            "gpu_seconds_extra": float(table["prewarm"]["gpu_seconds"] - table[other]["gpu_seconds"]),
            "bytes_extra": float(table["prewarm"]["bytes_total"] - table[other]["bytes_total"]),
        }
    width = bin_minutes(n_scored)
    t0 = h.since
    series = {
        "t0_s": int(t0.timestamp()), "bin_min": width, "ahead_min": FORECAST_AHEAD_MIN,
        "fleet": {
            "requests": _rounded(_bins(actual.sum(axis=0), width), 0),
            "forecast_q0.5": _rounded(_bins(np.where(rec.recorded[scored], np.nansum(q[0.5], axis=0), np.nan),
                                            width), 1),
            "cold_requests": {p: _rounded(_bins(run.results[p].cold_by_minute[:, sim_scored].sum(axis=0), width), 0)
                              for p in names},
            "gpu_seconds": {p: _rounded(_bins(run.results[p].gpu_seconds_by_minute[sim_scored], width), 0)
                            for p in names},
        },
        "models": {},
    }
    index = {str(m): i for i, m in enumerate(h.ids)}
    for row in per_model:
        i = index[row["model_id"]]
        series["models"][row["model_id"]] = {
            "actual": _rounded(_bins(actual[i], width), 0),
            "q0.5": _rounded(_bins(q[0.5][i], width), 2), "q0.1": _rounded(_bins(q[0.1][i], width), 2),
            "q0.9": _rounded(_bins(q[0.9][i], width), 2),
            "cold_requests": {p: _rounded(_bins(run.results[p].cold_by_minute[i, sim_scored], width), 0)
                              for p in names},
        }
    fleet_error = forecast_error(actual.reshape(-1), q[0.5].reshape(-1), q[0.1].reshape(-1), q[0.9].reshape(-1))
    prewarm_extra = table["prewarm"]
    info = {
        "generated_at": (generated_at or datetime.now(timezone.utc)).isoformat(timespec="seconds"),
        "since": h.since.isoformat(), "until": h.until.isoformat(), "models": len(h.ids),
        "scored_minutes": n_scored, "history_minutes": h.since_col,
        "stored_from": h.stored_from.isoformat() if h.stored_from else None,
        "stored_until": h.stored_until.isoformat() if h.stored_until else None,
        "fleet": {"nodes": h.fleet.n_nodes, "gpus_per_node": h.fleet.gpus_per_node},
        "policies": {"prewarm": "the product's default forecaster and planner settings",
                     "reactive": "Knative's pod autoscaler (KPA)", keep: f"fixed keep-alive of {keep.split('_')[1]} "
                     "minutes after each model's last request"},
        "forecaster": {"name": "ensemble", "retrains": prewarm_extra.get("retrains"),
                       "first_fit_at": (h.start + (run.fit_minute or 0) * np.timedelta64(1, "m")).isoformat()
                       if run.fit_minute is not None else None,
                       "minutes_from_empirical": int((rec.recorded[scored] & ~rec.by_ensemble[scored]).sum()),
                       "minutes_from_ensemble": int((rec.recorded[scored] & rec.by_ensemble[scored]).sum()),
                       "ahead_min": FORECAST_AHEAD_MIN, "error": fleet_error,
                       "detail": prewarm_extra.get("forecaster_report", {})},
        "notes": list(h.notes),
        "stage_seconds": {k: round(v, 2) for k, v in {**run.stage_seconds, **(stage_seconds or {})}.items()},
    }
    return _clean({"report": info, "policies": table, "comparison": comparison, "models": per_model,
                   "series": series})

