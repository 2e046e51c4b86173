"""Forecast speed of the ensemble's weighting rules: one fitted ensemble, forecast with each rule's weights.

The rules choose different members per series, and the members differ in forecast cost (LightGBM is the slowest),
so the default rule sets the forecast job's speed. This fits the product ensemble once on the Azure day's fit window
(``bench/accuracy.py``'s protocol, about 7 minutes on 2 cores), then times ``bench/accuracy.py``'s ``speed`` (60-minute
quantile forecasts for 10,000 series) with the fitted ``shrunk`` weights (the default) and with the ``best`` rule's
weights recomputed from the same validation errors, alternating, ``--rounds`` times each, and prints the medians,
their ratio and the share of series per member.

    .venv/bin/python bench/weighting_speed.py [--traces DIR] [--rounds 3]

Measured (2026-12-04, on 2354d7b, alone on 2 cores, 5.4 min): ``shrunk`` 6.88 s, ``best`` 4.21 s, ratio 1.63;
LightGBM's part 3.4-4.2 s against 0.38-0.39 s (it forecasts 66 % of the series under ``shrunk``, 8 % under ``best``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.accuracy import DATASETS, load_panel, protocol_for, rule_weights, speed  # noqa: E402
from forecaster.forecast.ensemble import Ensemble, default_members  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path, fmt = DATASETS["azure"]
    panel = load_panel(args.traces / path, fmt)
    protocol = protocol_for("azure", panel)
    started = time.perf_counter()
    ensemble = Ensemble(default_members(protocol.horizon), horizon=protocol.horizon)
    ensemble.fit_panel(panel.head(protocol.fit_steps))
    print(f"fit {time.perf_counter() - started:.0f} s, default weighting {ensemble.weighting!r}", flush=True)
    every = list(range(len(ensemble.member_names_)))
    rules = {ensemble.weighting: ensemble.weights_.copy()}
    for rule in ("shrunk", "best"):
        if rule not in rules:
            ensemble.weighting = rule
            rules[rule] = rule_weights(ensemble, every)
    seconds: dict[str, list[float]] = {rule: [] for rule in rules}
    for k in range(args.rounds):
        for rule, weights in rules.items():
            ensemble.weights_ = weights
            figures = speed(panel, ensemble)
            seconds[rule].append(figures["ensemble_seconds"])
            print(f"round {k + 1} {rule}: {figures['ensemble_seconds']:.2f} s; per member "
                  + ", ".join(f"{m} {v:.2f}" for m, v in figures["member_seconds"].items()), flush=True)
    for rule, weights in rules.items():
        share = {m: round(float((weights.argmax(axis=1) == j).mean()), 3) for j, m in enumerate(ensemble.member_names_)}
        print(f"{rule}: median {np.median(seconds[rule]):.2f} s; share of series per member {share}")
    print(f"ratio shrunk / best: {np.median(seconds['shrunk']) / np.median(seconds['best']):.2f}")


if __name__ == "__main__":
    main()
