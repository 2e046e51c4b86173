"""The plan step's two cold-cost weightings on the Azure Functions day, in closed form: what each buys, what each costs.

``PREWARM_PLANNER_COLD_COST_WEIGHTING`` decides what a cold start is worth to the planner: ``request`` charges the
wait of the requests it delays (every request alike), ``model`` multiplies each model's cold cost by the fleet's
mean request rate over its own (every model's share of cold requests alike; the default). This script applies the
minute protocol's hold rule (:func:`forecaster.simulation.minute.planner_loaded`: one replica of ``memory / 1 GB``
GPUs, a 60 s cold start, ``count_queued_wait`` off) in closed form, a function held in minute ``t`` when
``p * kappa * w >= gpus * (1 - p)``, with ``w`` from :func:`forecaster.planning.step.weighted_cold_costs` and the
rates the replays give the forecast (:class:`forecaster.contracts.forecast.TrailingRequestRates` over the
product's look-back), on a fixed grid of ``kappa``, and reads each curve at the hybrid histogram's waste and p75 as
``bench/policies.py`` does. ``p`` is the causal one-minute ``p_any`` of ``--forecaster`` (``bench/p75_allocation.py``
computes it the same way). Nothing is picked: every grid point is printed.

    .venv/bin/python bench/cold_cost_weighting.py [--forecaster empirical|ensemble] [--p-any-cache PATH]

Measured (2026-12-07, empirical source, under a minute beside two benchmarks): hybrid histogram p75 20.0 % at
189.2 % waste; ``model``: p75 at the hybrid's waste 12.5 %, overall cold % there 0.27, waste at the hybrid's p75
146.2 %; ``request``: 24.8 %, 0.19, 214.8 %. So the per-model weighting is what beats the hybrid histogram on the protocol's
per-function p75; the per-request weighting leaves fewer requests cold overall and more functions mostly cold.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from p75_allocation import cached_p_any, read_day  # noqa: E402

from forecaster.contracts.forecast import TrailingRequestRates  # noqa: E402
from forecaster.planning.step import weighted_cold_costs  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
from forecaster.simulation.curves import cost_at, value_at  # noqa: E402
from forecaster.simulation.minute import hybrid_loaded, keepalive_loaded, score_loaded  # noqa: E402

KAPPAS = np.exp(np.linspace(np.log(1e-3), np.log(1e4), 36))  # fixed before the run


def weights(counts: np.ndarray, weighting: str, lookback_min: int) -> np.ndarray:
    """(functions, minutes) cold-cost weights the plan step applies in each minute."""
    rates = TrailingRequestRates(counts, lookback_min)
    out = np.empty(counts.shape)
    for t in range(counts.shape[1]):
        out[:, t] = weighted_cold_costs(np.ones(len(counts)), rates.at(t), weighting)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forecaster", choices=("ensemble", "empirical"), default="empirical")
    parser.add_argument("--p-any-cache", type=Path, default=None,
                        help="Read p_any from this .npy when it exists, else compute and write it there.")
    args = parser.parse_args()
    settings = Settings()
    counts, mb = read_day(settings.traces_dir)
    started = time.perf_counter()
    p_any = cached_p_any(counts, args.forecaster, args.p_any_cache)
    print(f"p_any ({args.forecaster}): {time.perf_counter() - started:.0f} s")
    gpus = (mb / 1024.0)[:, None]
    base = score_loaded(counts, mb, keepalive_loaded(counts, 10)).wasted_memory_mb_min
    hybrid = score_loaded(counts, mb, hybrid_loaded(counts))
    hybrid_waste = 100.0 * hybrid.wasted_memory_mb_min / base
    print(f"hybrid histogram: p75 cold {hybrid.cold_pct_p75:.2f} % at waste {hybrid_waste:.1f} %")
    for weighting in ("model", "request"):
        w = weights(counts, weighting, settings.forecast_lookback_min)
        curve, overall = [], []
        print(f"\n{weighting}: kappa, p75 cold %, waste %, overall cold %")
        for j, kappa in enumerate(KAPPAS):
            score = score_loaded(counts, mb, p_any * kappa * w >= gpus * (1.0 - p_any))
            waste = 100.0 * score.wasted_memory_mb_min / base
            curve.append((waste, score.cold_pct_p75))
            overall.append((waste, score.cold_pct_overall))
            if j % 3 == 0:
                print(f"  {kappa:9.3g}  {score.cold_pct_p75:5.1f}  {waste:6.1f}  {score.cold_pct_overall:5.2f}")
        at_waste, at_p75 = value_at(curve, hybrid_waste), cost_at(curve, hybrid.cold_pct_p75)
        print(f"  at the hybrid's waste: p75 cold {at_waste:.1f} %, overall cold {value_at(overall, hybrid_waste):.2f} %"
              f"; waste at the hybrid's p75: " + ("out of range" if at_p75 is None else f"{at_p75:.1f} %"))


if __name__ == "__main__":
    main()
