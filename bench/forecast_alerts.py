"""How often ``PrewarmForecastErrorRising`` (deploy/prometheus-rules.yml) would fire on a real month of counts.

The rule reads the fleet's hourly wMAPE (``prewarm_forecast_wmape``, every model pooled) and fires when its mean
over 3 hours is above ``factor`` times the same 3 hours a day earlier, unless it is at or under ``factor`` times
those a week earlier (where a week of history exists), for an hour. Here the month is Huawei Cloud dc4 (8
channels, 5-minute counts, 30 days), the forecaster is the last value one step ahead (a stand-in: the rule
watches the product's ensemble, whose error moves with the same traffic), and "for an hour" is two hourly
evaluations in a row. Printed: the hourly wMAPE's spread, then per factor the share of hours the condition
holds, the share it fires, and how many separate firing episodes the month has.

    PREWARM_TRACES_DIR=... python bench/forecast_alerts.py [--traces DIR] [--factors 1.25,1.5,2]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.accuracy import DATASETS, load_panel  # noqa: E402

WINDOW_H = 3
DAY_H, WEEK_H = 24, 168


def hourly_wmape(values: np.ndarray, steps_per_hour: int) -> np.ndarray:
    """The fleet's wMAPE per hour of the last-value forecast one step ahead (sum |error| / sum count, pooled)."""
    counts = np.nan_to_num(values)
    error, actual = np.abs(counts[:, 1:] - counts[:, :-1]), counts[:, 1:]
    hours = error.shape[1] // steps_per_hour
    per_hour = (lambda x: x[:, :hours * steps_per_hour].reshape(len(x), hours, steps_per_hour).sum(axis=(0, 2)))
    return per_hour(error) / np.maximum(per_hour(actual), 1e-12)


def firing(wmape: np.ndarray, factor: float) -> tuple[np.ndarray, np.ndarray]:
    """(condition, firing) per hour: the rule's expression, and the expression true at this and the hour before."""
    hours = len(wmape)
    mean = np.full(hours, np.nan)
    for t in range(WINDOW_H - 1, hours):
        mean[t] = wmape[t - WINDOW_H + 1:t + 1].mean()
    condition = np.zeros(hours, dtype=bool)
    for t in range(DAY_H + WINDOW_H - 1, hours):
        week_known = t - WEEK_H >= WINDOW_H - 1
        condition[t] = mean[t] > factor * mean[t - DAY_H] and not (week_known and mean[t] <= factor * mean[t - WEEK_H])
    fired = np.zeros(hours, dtype=bool)
    fired[1:] = condition[1:] & condition[:-1]
    return condition, fired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=Path,
                        default=Path(os.environ.get("PREWARM_TRACES_DIR", REPO.parent / "shared" / "traces")))
    parser.add_argument("--factors", default="1.25,1.5,2")
    args = parser.parse_args()
    rel, fmt = DATASETS["huawei_dc4"]
    panel = load_panel(args.traces / rel, fmt)
    wmape = hourly_wmape(panel.values, int(round(60 / panel.step_minutes)))
    print(f"Huawei dc4: {panel.n_series} series, {len(wmape)} hours; hourly fleet wMAPE (last value, one step): "
          + ", ".join(f"q{q:g} {v:.3f}" for q, v in zip((0, 0.1, 0.5, 0.9, 1), np.quantile(wmape, [0, .1, .5, .9, 1]))))
    for factor in (float(f) for f in args.factors.split(",")):
        condition, fired = firing(wmape, factor)
        episodes = int(fired[0] + np.sum(fired[1:] & ~fired[:-1]))
        print(f"factor {factor:g}: condition holds {condition.mean():.3f} of hours, fires {fired.mean():.3f} of "
              f"hours, {episodes} firing episodes in {len(wmape) / 24:.0f} days")


if __name__ == "__main__":
    main()
