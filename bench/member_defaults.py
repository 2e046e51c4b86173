"""Ensemble members' design defaults, re-made on the ensemble's validation split inside the fit window (issue 13).

Each comparison pits a member's current default against candidate settings, the member *alone*, fitted and scored
exactly as ``Ensemble.fit_panel`` fits and scores it (:mod:`bench.validation_split`: fitted on the first ``T - V``
steps of the fit window, scored on rolling origins every 12 steps of the tail ``V = min(max(240, T // 5), T // 2)``,
horizons 1..60); no test origin is read. Comparisons (:data:`COMPARISONS`):

* ``arima_order``: ARIMA ``(1, 1, 1)`` on ``log1p`` (the default when it was run) vs ``(2, 0, 1)`` with a mean on
  ``log1p`` and on raw counts (deterministic: one run);
* ``local_level``: LightGBM with ``local_level=True`` (default) vs ``False``;
* ``strategy``: LightGBM ``strategy="direct"`` (default) vs ``"recursive"``;
* ``xgboost_size``: XGBoost depth 6, 200 trees, 250,000 rows, 64 bins, learning rate 0.08 (the default when it was
  run) vs LightGBM-like depth 8, 300 trees, 400,000 rows, 256 bins, learning rate 0.05.

Tree members run with seeds 0..2 (the seed draws the training rows and the estimator's subsamples). Data: the
Azure Functions 2019 day's fit window (minutes 0..1079 of ``bench/accuracy.py``'s protocol) and Huawei DC4's
(23 days of 5-minute steps in that protocol, of which the last 3 days, steps 5760..6623, are kept: cost).

Printed and saved per dataset, comparison, setting and seed: mean per-series MAE, mean per-series MAE relative to
the fallback member's, median MASE over active series, fit and forecast wall seconds (and process CPU seconds: the
machine is shared). Aggregates use, per comparison, the series that every setting covers in every seed (ARIMA
covers at most the 50 busiest). Results are saved to ``--json`` after every run, and a rerun with the same
``--json`` skips the runs already there.

The decision rule (:data:`DECISION_RULE`, :data:`RULE_MARGIN`) was written before anything was scored and is
applied literally by :func:`decide`. The run of issue 13 (all four comparisons, both datasets: 38 min wall on the 2
shared cores at load average 5-8) made ARIMA ``(2, 0, 1)`` on ``log1p`` and the larger XGBoost the defaults and
kept ``strategy="direct"`` and ``local_level=True``; the figures are in the members' docstrings
(:mod:`forecaster.forecast.arima`, :mod:`forecaster.forecast.trees`).

    nice -n 10 .venv/bin/python bench/member_defaults.py --json member_defaults.json \
        [--datasets huawei_dc4,azure] [--comparisons arima_order,local_level,strategy,xgboost_size] \
        [--recursive-series N] [--traces DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.validation_split import HORIZON, ValidationSplit, load_fit_window, make_split, member_mae, summary
from forecaster.forecast.arima import ARIMAMember
from forecaster.forecast.members import Member
from forecaster.forecast.panel import Panel
from forecaster.forecast.trees import LightGBMMember, XGBoostMember

#: a candidate must beat the default's mean relative MAE by more than this share (0.01 = 1%)
RULE_MARGIN = 0.01
#: fixed before any run was scored; :func:`decide` applies it
DECISION_RULE = (
    "The current default stays unless a candidate's mean per-series MAE relative to the fallback member is lower "
    "than the default's by more than 1% (candidate < 0.99 x default) on both datasets and in every seed pair (seed "
    "s of the candidate against seed s of the default; ARIMA is deterministic: one pair); then the candidate becomes "
    "the default. If several qualify, the one with the lowest mean of that figure over datasets and seeds. The "
    "figure is taken over the series that every setting of the comparison covers in every seed. The tree members' "
    "shared defaults (strategy, local_level) are decided on the LightGBM member, the member they were first "
    "measured on."
)
SEEDS = (0, 1, 2)
DATASETS = ("huawei_dc4", "azure")


@dataclass(frozen=True)
class Setting:
    """One member configuration: a name, a factory ``seed -> unfitted member``, and whether the seed matters."""

    name: str
    make: Callable[[int], Member]
    seeded: bool = True


SETTINGS = {
    s.name: s
    for s in (
        Setting("arima (1,1,1) log1p", lambda seed: ARIMAMember(order=(1, 1, 1)), seeded=False),
        Setting("arima (2,0,1) log1p", lambda seed: ARIMAMember(order=(2, 0, 1)), seeded=False),
        Setting("arima (2,0,1) raw", lambda seed: ARIMAMember(order=(2, 0, 1), log_transform=False), seeded=False),
        Setting("lightgbm direct local_level", lambda seed: LightGBMMember(
            strategy="direct", horizon=HORIZON, random_state=seed, local_level=True)),
        Setting("lightgbm direct no local_level",
                lambda seed: LightGBMMember(horizon=HORIZON, random_state=seed, local_level=False)),
        Setting("lightgbm recursive local_level",
                lambda seed: LightGBMMember(strategy="recursive", horizon=HORIZON, random_state=seed)),
        Setting("xgboost d6 200 trees 250k rows 64 bins",
                lambda seed: XGBoostMember(horizon=HORIZON, random_state=seed, max_train_rows=250_000,
                                           params={"max_depth": 6, "n_estimators": 200, "max_bin": 64,
                                                   "learning_rate": 0.08})),
        Setting("xgboost d8 300 trees 400k rows 256 bins",
                lambda seed: XGBoostMember(horizon=HORIZON, random_state=seed, max_train_rows=400_000,
                                           params={"max_depth": 8, "n_estimators": 300, "max_bin": 256,
                                                   "learning_rate": 0.05})),
    )
}
#: comparison -> (the default when the comparison was run, candidates), cheapest first; every setting spells out the
#: knob it tests, so that a changed class default does not change what a setting means
COMPARISONS = {
    "arima_order": ("arima (1,1,1) log1p", ["arima (2,0,1) log1p", "arima (2,0,1) raw"]),
    "local_level": ("lightgbm direct local_level", ["lightgbm direct no local_level"]),
    "strategy": ("lightgbm direct local_level", ["lightgbm recursive local_level"]),
    "xgboost_size": ("xgboost d6 200 trees 250k rows 64 bins", ["xgboost d8 300 trees 400k rows 256 bins"]),
}


def run_key(dataset: str, setting: str, seed: int, subset: int | None) -> str:
    return f"{dataset}|{setting}|{seed}|{subset or 'all'}"


def run_setting(split: ValidationSplit, setting: Setting, seed: int) -> dict:
    """Fit one setting on the split's training steps and score it; per-series MAE kept for the aggregates."""
    member = setting.make(seed)
    wall, cpu = time.perf_counter(), time.process_time()
    member.fit_panel(split.train)
    fit_s, fit_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    wall, cpu = time.perf_counter(), time.process_time()
    mae = member_mae(split, member)
    forecast_s, forecast_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    record = {"fit_s": round(fit_s, 2), "forecast_s": round(forecast_s, 2), "fit_cpu_s": round(fit_cpu_s, 2),
              "forecast_cpu_s": round(forecast_cpu_s, 2), **summary(split, mae)}
    if isinstance(member, ARIMAMember):
        record |= {"arima_fitted": len(member.rows_), "arima_failures": len(member.failures_),
                   "arima_skipped": len(member.skipped_)}
    record["mae"] = [None if not np.isfinite(v) else float(v) for v in mae]
    return record


def subset_series(panel: Panel, n: int | None) -> Panel:
    """``n`` series evenly spaced by position (``bench/accuracy.py``'s rule: chosen before any data is read)."""
    from bench.accuracy import subset_series as by_position

    return by_position(panel, n)


def comparison_table(split: ValidationSplit, runs: dict, dataset: str, comparison: str, subset: int | None) -> list:
    """Rows (setting, seed, aggregates) over the series every setting of ``comparison`` covers in every seed."""
    default, candidates = COMPARISONS[comparison]
    names = [default, *candidates]
    records = {(n, s): runs[run_key(dataset, n, s, subset)] for n in names for s in seeds_of(n)
               if run_key(dataset, n, s, subset) in runs}
    if len(records) < sum(len(seeds_of(n)) for n in names):
        return []
    maes = {k: np.array([np.nan if v is None else v for v in r["mae"]]) for k, r in records.items()}
    common = np.logical_and.reduce([np.isfinite(m) for m in maes.values()])
    rows = []
    for (name, seed), record in records.items():
        rows.append({"setting": name, "default": name == default, "seed": seed, **summary(split, maes[name, seed], common),
                     "fit_s": record["fit_s"], "forecast_s": record["forecast_s"],
                     "fit_cpu_s": record["fit_cpu_s"], "forecast_cpu_s": record["forecast_cpu_s"]})
    return rows


def seeds_of(setting: str) -> tuple[int, ...]:
    return SEEDS if SETTINGS[setting].seeded else (0,)


def decide(comparison: str, tables: dict[str, list]) -> dict:
    """Apply :data:`DECISION_RULE` to one comparison's tables (dataset -> rows of :func:`comparison_table`)."""
    default, candidates = COMPARISONS[comparison]
    verdicts = {}
    for candidate in candidates:
        pairs, values = [], []
        for dataset in DATASETS:
            rows = {(r["setting"], r["seed"]): r["mae_rel_fallback"] for r in tables.get(dataset, [])}
            for seed in seeds_of(candidate):
                mine, theirs = rows.get((candidate, seed)), rows.get((default, seed if SETTINGS[default].seeded else 0))
                pairs.append(mine is not None and theirs is not None and mine < (1.0 - RULE_MARGIN) * theirs)
                values.append(np.nan if mine is None else mine)
        complete = len(pairs) == len(DATASETS) * len(seeds_of(candidate))
        verdicts[candidate] = {"qualifies": bool(complete and all(pairs)), "pairs_won": int(sum(pairs)),
                               "pairs": len(pairs), "mean_rel": float(np.nanmean(values))}
    qualified = [c for c, v in verdicts.items() if v["qualifies"]]
    winner = min(qualified, key=lambda c: verdicts[c]["mean_rel"]) if qualified else default
    return {"default": default, "winner": winner, "changes": winner != default, "candidates": verdicts}


def print_table(dataset: str, comparison: str, rows: list) -> None:
    print(f"\n## {dataset}: {comparison}")
    print(f"{'setting':42s} {'seed':>4s} {'series':>6s} {'MAE':>10s} {'MAE/fallback':>12s} {'MASE med act':>12s} "
          f"{'fit s':>7s} {'fcst s':>7s}")
    for r in rows:
        print(f"{r['setting']:42s} {r['seed']:4d} {r['series']:6d} {r['mae_mean']:10.5f} {r['mae_rel_fallback']:12.4f} "
              f"{r['mase_median_active']:12.4f} {r['fit_s']:7.1f} {r['forecast_s']:7.1f}")
    for name in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == name]
        print(f"{name:42s} mean {np.mean([r['mae_mean'] for r in mine]):10.5f} "
              f"{np.mean([r['mae_rel_fallback'] for r in mine]):12.4f} "
              f"{np.mean([r['mase_median_active'] for r in mine]):12.4f} "
              f"{np.mean([r['fit_s'] for r in mine]):7.1f} {np.mean([r['forecast_s'] for r in mine]):7.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--json", type=Path, required=True, help="results; runs already in it are skipped")
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--comparisons", default=",".join(COMPARISONS))
    parser.add_argument("--recursive-series", type=int, default=None,
                        help="score the strategy comparison (both settings) on N series evenly spaced by position")
    args = parser.parse_args(argv)
    saved = json.loads(args.json.read_text()) if args.json.exists() else {}
    runs: dict = saved.get("runs", {})
    datasets = args.datasets.split(",")
    comparisons = args.comparisons.split(",")
    splits = {}
    for dataset in datasets:
        panel = load_fit_window(dataset, args.traces)
        splits[dataset, None] = make_split(panel, HORIZON)
        print(f"[{dataset}] {panel.n_series} series, fit window {panel.n_steps} steps; members fitted on "
              f"{splits[dataset, None].train.n_steps}, {len(splits[dataset, None].origins)} validation origins",
              file=sys.stderr, flush=True)
    out = {"rule": DECISION_RULE, "rule_margin": RULE_MARGIN, "horizon": HORIZON, "runs": runs,
           "splits": {d: {"series": s.panel.n_series, "fit_window_steps": s.panel.n_steps,
                          "train_steps": s.train.n_steps, "origins": s.origins} for (d, _), s in splits.items()}}
    for comparison in comparisons:
        subset = args.recursive_series if comparison == "strategy" else None
        default, candidates = COMPARISONS[comparison]
        for dataset in datasets:
            if (dataset, subset) not in splits:
                splits[dataset, subset] = make_split(subset_series(splits[dataset, None].panel, subset), HORIZON)
            for name in [default, *candidates]:
                for seed in seeds_of(name):
                    key = run_key(dataset, name, seed, subset)
                    if key in runs:
                        continue
                    runs[key] = run_setting(splits[dataset, subset], SETTINGS[name], seed)
                    print(json.dumps({"run": key} | {k: v for k, v in runs[key].items() if k != "mae"}), flush=True)
                    args.json.write_text(json.dumps(out))
    tables, decisions = {}, {}
    for comparison in comparisons:
        subset = args.recursive_series if comparison == "strategy" else None
        tables[comparison] = {}
        for dataset in datasets:
            rows = comparison_table(splits[dataset, subset], runs, dataset, comparison, subset)
            tables[comparison][dataset] = rows
            if rows:
                print_table(dataset + (f" ({subset} series by position)" if subset else ""), comparison, rows)
        decisions[comparison] = decide(comparison, tables[comparison])
        print(f"decision {comparison}: {json.dumps(decisions[comparison])}")
    out |= {"tables": tables, "decisions": decisions}
    args.json.write_text(json.dumps(out))
    print(f"\nrule: {DECISION_RULE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
