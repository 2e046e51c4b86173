"""Long-idle p_any: the hazard's tail as it is against a calibrated tail, and what holding on it buys the planner.

A diagnosis for issues 13 and 14, not a figure that speaks for prewarm. Beyond ``max_age`` (240 minutes) the idle-time
hazard (``forecaster/forecast/hazard.py``) uses a geometric tail whose prior reads ``prior_weight * h0`` events over
``prior_weight / h0`` steps: ``h0`` squared for a series with no long gap of its own. The calibrated prior is
``prior_weight`` events. This script takes the planner's causal empirical source
(:class:`~forecaster.planning.forecasts.EmpiricalForecast`) on the Azure 2019 day, its one-minute-ahead ``p_any``
for every minute as it is (``current``), and the same with the tail written the calibrated way and the pooled
table's unseen cells carried forward as ``IdleTimeHazard`` does (``calibrated``: computed here from the same state,
the product code is not changed; the variant the planner replays of stops 32 and 33 ran), and prints:

1. **Reliability beyond 240 idle minutes** (scored minutes 240..1439), split by whether the series has had a long
   gap of its own: mean ``p_any`` of each tail against the share of minutes with a call. Whether the squared
   prior's ranking by own long gaps is real shows here.
2. **What a held minute buys, by idle age**: calls caught per held minute (the share of minutes with a call), and
   the value of a call to the minute protocol's per-function cold % (``1 / n``, ``n`` the function's scored
   invocations) against the planner's estimate of it there (``1 / (rate * 1200)``, the weight
   :func:`forecaster.simulation.minute.planner_loaded` gives, ``rate`` its calls per minute so far).
3. **The hold rule in closed form** (as ``bench/p75_allocation.py``: held when ``p * kappa / rate >= gpus *
   (1 - p)``, over a fixed grid of ``kappa``; ``kappa`` is the product's cold cost times the mean rate there) with each tail, read at fixed waste levels by interpolation: p75 cold %,
   the mean over functions of their cold % (what the rate-weighted cold cost minimises) and the overall cold %.

About a minute on one core.

    .venv/bin/python bench/long_idle.py

Measured (2026-12-03, 10 s; the planner replays with the calibrated tail are in issue 14's notes of stops 32, 33):

* beyond 240 idle minutes, series with no long gap of their own: ``current`` 0.000034, ``calibrated`` 0.000615,
  observed 0.000615 (425,828 minutes, 262 calls); with one: 0.000185 / 0.000718 / 0.000785 (62,458 minutes, 49
  calls). The squared prior ranks series by their own long gaps far more than the data does;
* a held minute beyond 240 idle minutes catches 0.0006 calls on series seen before (about 1,600 held minutes per
  call; 0.0012 with the never-called series), against 0.0073 at 60-240 minutes and 0.039 at 10-60; the
  planner's weight over-reads a long-idle call's value by 1.8x (1.2-1.4x at shorter ages);
* the closed form at 100 / 150 / 189 % waste, p75 cold %: current 28.6 / 19.9 / 12.5, calibrated 33.4 / 15.8 /
  10.5; mean per-function cold %: 20.9 / 15.1 / 13.4 against 22.5 / 15.1 / 12.2; overall cold %: 1.16 / 0.48 /
  0.27 against 1.88 / 0.90 / 0.59. The calibrated tail buys p75 and the mean only at the high-waste end, and
  costs the overall cold % everywhere: its waste goes to long-idle functions whose calls are few and whose timing
  nothing foretells. (The planner replays differ from this closed form where the actuator times releases, and
  the product default is the ensemble, whose stack reads the tail differently: the minute protocol's p75 at the
  hybrid's waste went from 7.7 to 13.6 % with it.)
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.p75_allocation import KAPPAS, calls_per_minute_so_far, per_function, read_day, run_rule  # noqa: E402
from forecaster.forecast.hazard import activity_bin, age_bin, carry_forward, hazard  # noqa: E402
from forecaster.planning.forecasts import CountPanel, EmpiricalForecast  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
from forecaster.simulation.minute import WARMUP_MIN, keepalive_loaded, score_loaded  # noqa: E402

WASTE_LEVELS_PCT = (100.0, 150.0, 189.2)  # 189.2: the hybrid histogram's waste on this day
AGE_BANDS_MIN = ((1, 2), (2, 10), (10, 60), (60, 240), (240, 10**9))


def both_tails(counts: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """One-minute-ahead p_any of the empirical source with its tail and with the calibrated one (functions x
    minutes), the idle age at each minute and whether the series had a long gap of its own by then."""
    ids = np.array([f"f{i}" for i in range(len(counts))], dtype=object)
    source = EmpiricalForecast(CountPanel(ids=ids, start=pd.Timestamp("2019-07-15", tz="UTC"), counts=counts))
    current, calibrated = np.zeros(counts.shape), np.zeros(counts.shape)
    ages, own_long = np.zeros(counts.shape), np.zeros(counts.shape, dtype=bool)
    k, max_age = source.prior_weight, source.max_age
    for t in range(counts.shape[1]):
        current[:, t] = source.p_any_at(t, 1)[:, 0]  # one step ahead: the hazard at the current age
        age = source._ages(t)
        pooled = carry_forward(source.pool_events_, source.pool_exposure_)
        h0 = pooled[activity_bin(source.active_), age_bin(age)]
        n_over = source.hist_[:, max_age + 1]
        tail = (n_over + k) / (source.excess_ + k / np.maximum(h0, 1e-6))
        within = hazard(source.hist_, source.excess_, source.active_, age, pooled, max_age=max_age, prior_weight=k)
        calibrated[:, t] = np.where(age > max_age, tail, within)
        ages[:, t], own_long[:, t] = np.where(source.last_ >= 0, age, np.inf), n_over > 0
    return {"current": current, "calibrated": calibrated}, ages, own_long


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    started = time.perf_counter()
    counts, mb = read_day(Settings().traces_dir)
    p_any, ages, own_long = both_tails(counts)
    print(f"p_any of both tails for {counts.shape[0]} functions x {counts.shape[1]} minutes: "
          f"{time.perf_counter() - started:.0f} s")
    scored = slice(WARMUP_MIN, None)
    called = (counts > 0)[:, scored]
    age = ages[:, scored]

    print("\n1. reliability beyond 240 idle minutes (series seen before; one minute ahead)")
    long_gap = own_long[:, scored]
    for label, mask in (("no long gap of its own", ~long_gap), ("a long gap of its own", long_gap)):
        m = mask & (age > 240) & np.isfinite(age)
        print(f"  {label:23s}: {m.sum():7d} minutes, {called[m].sum():4d} calls; mean p_any current "
              f"{p_any['current'][:, scored][m].mean():.6f}, calibrated {p_any['calibrated'][:, scored][m].mean():.6f};"
              f" observed {called[m].mean():.6f}")

    print("\n2. what a held minute buys, by idle age (all scored minutes; never-called series in the last band)")
    n_scored = counts[:, scored].sum(axis=1)
    rate = calls_per_minute_so_far(counts)
    minutes = counts.shape[1] - WARMUP_MIN
    age_or_large = np.nan_to_num(age, posinf=10**8)  # never-called series: older than any band's start
    for lo, hi in AGE_BANDS_MIN:
        band = (age_or_large >= lo) & (age_or_large < hi)
        f, t = np.nonzero(band & called)
        weight = 1.0 / (rate[:, scored][f, t] * minutes)
        value = 1.0 / n_scored[f]
        print(f"  idle [{lo}, {hi if hi < 10**9 else 'inf'}) min: {band.sum():8d} minutes, calls caught per held "
              f"minute {called[band].mean():.4f}; a call's value 1/n {value.mean():.4f}, the planner's weight "
              f"{weight.mean():.4f} ({weight.mean() / value.mean():.2f}x)")

    print("\n3. the hold rule in closed form, read at fixed waste (interpolated on the kappa grid)")
    gpus = mb / 1024.0
    base = score_loaded(counts, mb, keepalive_loaded(counts, 10)).wasted_memory_mb_min
    for name, p in p_any.items():
        rows = []
        for kappa in KAPPAS:
            loaded = run_rule(counts, p, rate, gpus, kappa)
            score = score_loaded(counts, mb, loaded)
            pct, _, active = per_function(counts, mb, loaded, base)
            rows.append((100.0 * score.wasted_memory_mb_min / base, score.cold_pct_p75, pct[active].mean(),
                         score.cold_pct_overall))
        rows = np.array(sorted(rows))
        for level in WASTE_LEVELS_PCT:
            p75, mean, overall = (np.interp(level, rows[:, 0], rows[:, j]) for j in (1, 2, 3))
            print(f"  {name:10s} waste {level:5.1f} %: p75 cold {p75:5.2f} %, mean per-function cold {mean:5.2f} %, "
                  f"overall cold {overall:4.2f} %")
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
