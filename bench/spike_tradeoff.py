"""Spike recall against the q0.9 pinball loss on the ensemble's own validation tail: what an upper bound can buy.

Issue 13 asks for spike recall at q0.9 at least the best peer's, with the coverage bracket holding and without
giving up wQL. This benchmark asks, on data the ensemble may see (no test origin of ``bench/accuracy.py`` is
read), whether any of a few q0.9 constructions gives both. The ensemble is fitted on a dataset's fit window
(``refit=False``: members on the first ``T - V`` steps, as ``Ensemble.fit_panel`` does before its refit); its
validation tail then holds, per series, origin and horizon, the point forecast, the actual count and the quantile
heads' forecasts. Every construction below is conformalised the way the ensemble conformalises its own bounds:
per series and horizon, offsets learned on the odd validation origins bound the even ones and vice versa
(:func:`forecaster.forecast.ensemble._crossfit_bound`), so each is scored out of sample.

* ``ensemble``: the product's bound (per series, the residual quantiles or the conformalised q0.9 head, as the
  fitted ensemble chose on the same tail);
* ``residuals`` / ``heads``: each of its two sources alone;
* ``naive_anchor``, ``seasonal_anchor`` (the protocol's season, where it has one), ``recent_max_anchor`` (the
  largest count of the last 15 minutes): the peers' own construction, a simple forecast plus its conformal
  offset (``naive_anchor`` is the naive peer's bound, ``seasonal_anchor`` the seasonal naive's);
* ``mean(ensemble, X)``: the average of the two bounds (quantile averaging); ``max(ensemble, X)``: the larger.

Printed per subset (``all``, ``busy``): spike recall (EVALUATION.md's spikes, h >= 5 on per-minute data), the
coverage bracket [strict, inclusive] and wQL at q0.9 (2 x pinball / sum |actual|, the q0.9 part of wQL).

    python bench/spike_tradeoff.py [--datasets azure,huawei_dc4] [--members default|lightgbm] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.accuracy import DATASETS, load_panel, protocol_for  # noqa: E402
from forecaster.forecast.backtest import Protocol, busy_mask, pinball  # noqa: E402
from forecaster.forecast.ensemble import Ensemble, _crossfit_bound, default_members  # noqa: E402
from forecaster.forecast.members import Naive, SeasonalNaive  # noqa: E402
from forecaster.forecast.panel import Panel  # noqa: E402
from forecaster.forecast.trees import LightGBMMember  # noqa: E402

TAU = 0.9
#: minutes of history the recent-max anchor reads
RECENT_MAX_MIN = 15


class RecordingEnsemble(Ensemble):
    """The ensemble, keeping the validation tail's point forecasts, actuals and head forecasts it calibrates on."""

    def _calibrate_heads(self, point: np.ndarray, actual: np.ndarray, head_forecasts: dict) -> None:
        self.validation_ = {"point": point, "actual": actual, "heads": head_forecasts}
        super()._calibrate_heads(point, actual, head_forecasts)


def spikes_on(values: np.ndarray, origins: list[int], horizon: int, step_minutes: float,
              actual: np.ndarray) -> np.ndarray:
    """EVALUATION.md's spikes at the validation origins: actual > 2 x the mean of the 60 minutes before the
    target, actual >= 5, and the forecast made at least 5 minutes ahead (any horizon on 5-minute data)."""
    n = values.shape[0]
    window = max(1, int(round(60 / step_minutes)))
    min_h = 5 if step_minutes <= 1 else 1
    csum = np.concatenate([np.zeros((n, 1)), np.cumsum(np.nan_to_num(values), axis=1)], axis=1)
    target = np.asarray(origins)[:, None] + np.arange(horizon)[None, :]
    lo = np.clip(target - window, 0, None)
    trailing = (csum[:, target] - csum[:, lo]) / np.maximum(target - lo, 1)
    far_enough = (np.arange(1, horizon + 1) >= min_h)[None, None, :]
    return (actual > 2 * trailing) & (actual >= 5) & far_enough & ~np.isnan(actual)


def constructions(ensemble: RecordingEnsemble, panel: Panel, protocol: Protocol) -> dict[str, np.ndarray]:
    """Every q0.9 construction of the module docstring on the validation tail, ``(N, O, H)`` each."""
    v = ensemble.validation_
    point, actual, origins, h = v["point"], v["actual"], ensemble.validation_origins_, protocol.horizon
    ones = np.ones_like(point)
    residuals = _crossfit_bound(point, ones, actual, point, TAU, ensemble.min_residuals, True)
    out = {"residuals": residuals}
    if TAU in v["heads"]:
        conformal = ensemble.quantile_method_ != "heads_empirical"
        heads = _crossfit_bound(v["heads"][TAU], ones, actual, point, TAU, ensemble.min_residuals, conformal)
        out["heads"] = heads
        out["ensemble"] = np.where(ensemble.head_series_[:, None, None], heads, residuals)
    else:
        out["ensemble"] = residuals
    anchors = {"naive_anchor": Naive()}
    if protocol.season:
        anchors["seasonal_anchor"] = SeasonalNaive(protocol.season)
    for name, member in anchors.items():
        forecast = member.fit_panel(panel).forecast(panel, origins, h)
        out[name] = _crossfit_bound(forecast, ones, actual, forecast, TAU, ensemble.min_residuals, True)
    width = max(1, int(round(RECENT_MAX_MIN / panel.step_minutes)))
    recent = np.stack([np.nan_to_num(np.nanmax(np.where(np.isnan(panel.values[:, o - width:o]), -np.inf,
                                                         panel.values[:, o - width:o]), axis=1), neginf=0.0)
                       for o in origins], axis=1)
    recent = np.repeat(recent[:, :, None], h, axis=2)
    out["recent_max_anchor"] = _crossfit_bound(recent, ones, actual, recent, TAU, ensemble.min_residuals, True)
    for name in [k for k in out if k.endswith("_anchor")]:
        out[f"mean(ensemble, {name})"] = 0.5 * (out["ensemble"] + out[name])
        out[f"max(ensemble, {name})"] = np.maximum(out["ensemble"], out[name])
    return out


def score(bound: np.ndarray, actual: np.ndarray, spikes: np.ndarray, rows: np.ndarray) -> dict:
    """Spike recall, coverage bracket and wQL at q0.9 over the series ``rows``."""
    known = ~np.isnan(actual[rows])
    a, q, s = actual[rows][known], bound[rows][known], spikes[rows][known]
    return {"spikes": int(s.sum()),
            "spike_recall": float(np.mean(q[s] >= 0.8 * a[s])) if s.any() else None,
            "coverage_q90_strict": float(np.mean(a < q)), "coverage_q90": float(np.mean(a <= q)),
            "wql_q90": float(2 * pinball(a, q, TAU).sum() / max(np.abs(a).sum(), 1e-12))}


def run_dataset(name: str, traces: Path, members: str) -> dict:
    rel, fmt = DATASETS[name]
    full = load_panel(traces / rel, fmt)
    protocol = protocol_for(name, full)
    panel = full.head(protocol.fit_steps)  # the fit window only: no test origin is read
    chosen = default_members(protocol.horizon) if members == "default" else [LightGBMMember(horizon=protocol.horizon)]
    ensemble = RecordingEnsemble(chosen, horizon=protocol.horizon, refit=False,
                                 progress=lambda m: print(f"[{name}] {m}", file=sys.stderr, flush=True))
    started = time.perf_counter()
    ensemble.fit_panel(panel)
    fit_s = time.perf_counter() - started
    actual = ensemble.validation_["actual"]
    spikes = spikes_on(panel.values, ensemble.validation_origins_, protocol.horizon, panel.step_minutes, actual)
    busy = busy_mask(full, protocol)
    bounds = constructions(ensemble, panel, protocol)
    table = {subset: {label: score(bound, actual, spikes, rows) for label, bound in bounds.items()}
             for subset, rows in (("all", np.ones(panel.n_series, dtype=bool)), ("busy", busy))}
    return {"members": members, "fit_s": fit_s, "validation_origins": len(ensemble.validation_origins_),
            "fit_steps": protocol.fit_steps, "table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--datasets", default="azure,huawei_dc4")
    parser.add_argument("--members", choices=("default", "lightgbm"), default="default",
                        help="the product's members, or LightGBM alone (with the fallback and heads): quicker")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = {}
    for name in args.datasets.split(","):
        out[name] = result = run_dataset(name, args.traces, args.members)
        print(f"\n## {name}: validation tail of the fit window (steps 0..{result['fit_steps'] - 1}), "
              f"{result['validation_origins']} origins, members {args.members} (fit {result['fit_s']:.0f} s)")
        for subset, rows in result["table"].items():
            frame = pd.DataFrame(rows).T[["spikes", "spike_recall", "coverage_q90_strict", "coverage_q90",
                                           "wql_q90"]].astype(float)
            frame["spikes"] = frame["spikes"].astype(int)
            print(f"-- {subset}")
            print(frame.to_string(float_format=lambda v: f"{v:.4f}"))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
