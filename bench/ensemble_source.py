"""Cost and calibration of the ensemble forecast source on a replay (default: the shared Azure day).

What the policy benchmarks pay for ``--forecaster ensemble``: the product's
default ensemble (``forecaster.forecast.sharded.production_model``) fitted at
the warm-up end (minute 240) and every 6 simulated hours after it (600, 960,
1320), each fit on the minutes before it; every minute from 240 on forecast
``--horizon`` minutes ahead, in blocks of 60 origins. Printed: seconds per fit
and for all forecasts, each per 1,000 series, and, as a check of the causal
forecasts on the minutes they were made for (these minutes are never used to
choose anything), the coverage of q0.9 / q0.95 / q0.99 as the bracket
[P(y < q), P(y <= q)] over all models, minutes and horizons (mostly minutes
without invocations, where any q >= 0 covers), and P(y <= q) over the minutes
with at least one invocation, next to the causal ``EmpiricalForecast`` on the
same minutes. Origins every 5 minutes from the warm-up end.

    .venv/bin/python bench/ensemble_source.py [--members default|lightgbm|fallback] [--json out.json]

Measured on the Azure day (1,350 series, H = 10; 2 cores shared with other
jobs, load average 5-7, so read the seconds as upper bounds):

* default members: fits at 240 / 600 / 960 / 1320 took 225 / 690 / 679 /
  610 s (167 / 511 / 503 / 452 s per 1,000 series); forecasting all 1,200
  origins took 153 s (113 s per 1,000 series, 94 ms per origin per 1,000
  series); 39 minutes in all, paid once per trace and shared by every policy
  that replays it. Cache 371 MB.
* fallback member only: fits 4-7 s per 1,000 series, forecasts 5.7 s per
  1,000 series for the whole replay.
* coverage (origins every 5 minutes from 240, h = 1..10, [P(y < q), P(y <= q)]):
  ensemble q0.9 [0.29, 0.982], q0.95 [0.32, 0.984], q0.99 [0.40, 0.990];
  on minutes with an invocation q0.9 0.896, q0.95 0.910, q0.99 0.941. The
  empirical source: q0.9 [0.14, 0.989], q0.95 [0.19, 0.992], q0.99 [0.37,
  0.996]; on invoked minutes 0.934 / 0.954 / 0.977: the ensemble's upper
  levels are calibrated over all minutes but lower than the empirical
  source's on the minutes that matter for cold starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forecaster.contracts.forecast import FORECAST_LEVELS, quantile_column
from forecaster.ingest.traces import read_trace
from forecaster.planning.ensemble_source import EnsembleForecast
from forecaster.planning.forecasts import CountPanel, EmpiricalForecast
from forecaster.settings import Settings

AZURE = ROOT.parent / "shared" / "traces" / "azure_functions_2019_sample1350" / \
    "invocations_per_function_1day_1350fn.csv.gz"


def load_panel(path: Path) -> CountPanel:
    trace = read_trace(path)
    raw = trace.raw.copy()
    raw["y"] = pd.to_numeric(raw["y"], errors="coerce").fillna(0.0)
    return CountPanel.from_long(raw[["unique_id", "ds", "y"]])


def members_for(name: str):
    if name == "default":
        return None
    if name == "fallback":
        return []
    if name == "lightgbm":
        from forecaster.forecast.trees import LightGBMMember

        return [LightGBMMember(horizon=60)]
    raise SystemExit(f"unknown --members {name!r}")


def coverage(source, panel: CountPanel, first: int, horizon: int, every: int) -> dict:
    """Coverage brackets of the upper levels over origins first, first + every, ... (all horizons)."""
    levels = (0.9, 0.95, 0.99)
    weak, strict, invoked = ({q: [] for q in levels} for _ in range(3))
    for col in range(first, panel.n_minutes - horizon + 1, every):
        frame = source.frame_at(col, horizon)
        actual = panel.counts[:, col:col + horizon].reshape(-1)  # frame rows: model-major, then minute
        for q in levels:
            bound = frame[quantile_column(q)].to_numpy()
            weak[q].append(np.sum(actual <= bound))
            strict[q].append(np.sum(actual < bound))
            invoked[q].append(np.sum((actual <= bound) & (actual > 0)))
    points = sum(1 for _ in range(first, panel.n_minutes - horizon + 1, every)) * panel.counts.shape[0] * horizon
    active = sum(np.sum(panel.counts[:, c:c + horizon] > 0) for c in range(first, panel.n_minutes - horizon + 1,
                                                                             every))
    out = {f"q{q}": [round(float(sum(strict[q]) / points), 4), round(float(sum(weak[q]) / points), 4)]
           for q in levels}
    out |= {f"q{q}_on_invoked_minutes": round(float(sum(invoked[q]) / max(active, 1)), 4) for q in levels}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=AZURE)
    parser.add_argument("--members", default="default")
    parser.add_argument("--horizon", type=int, default=10)
    parser.add_argument("--train-until", type=int, default=240)
    parser.add_argument("--retrain-every", type=int, default=360)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    panel = load_panel(args.trace)
    n = len(panel.ids)
    print(f"{args.trace.name}: {n} series x {panel.n_minutes} minutes; members {args.members}", flush=True)
    source = EnsembleForecast(panel, train_until_min=args.train_until, retrain_every_min=args.retrain_every,
                              members=members_for(args.members), settings=Settings.model_construct(),
                              levels=FORECAST_LEVELS, horizon_min=args.horizon,
                              progress=lambda line: print(f"  {time.strftime('%H:%M:%S')} {line}", flush=True))
    started = time.perf_counter()
    report = source.precompute()
    wall = time.perf_counter() - started
    per_k = 1000.0 / n
    report |= {
        "series": n, "minutes": panel.n_minutes, "members": args.members, "horizon_min": args.horizon,
        "wall_seconds": round(wall, 1),
        "fit_seconds_per_1000_series": [round(s * per_k, 1) for s in source.fit_seconds],
        "forecast_seconds_per_1000_series": round(source.forecast_seconds * per_k, 1),
        "forecast_ms_per_origin_per_1000_series": round(1000 * source.forecast_seconds * per_k
                                                        / max(source.forecast_origins, 1), 2),
        "cache_mb": round(sum(a.nbytes for _, arrays in source._blocks.values() for a in arrays.values()) / 2**20, 1),
    }
    started = time.perf_counter()
    report["coverage_ensemble"] = coverage(source, panel, args.train_until, args.horizon, 5)
    report["coverage_empirical"] = coverage(EmpiricalForecast(panel, levels=FORECAST_LEVELS), panel,
                                            args.train_until, args.horizon, 5)
    report["coverage_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
