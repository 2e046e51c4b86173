"""RandomForest member: validation MAE inside the fit window for 10, 20, 30 and 40 trees (issue 15's question).

The split is the ensemble's own (``Ensemble.fit_panel`` with the product's 60 horizons; :mod:`bench.validation_split`,
which ``bench/member_defaults.py`` shares): the member is fitted on the first ``T - V`` steps of the fit window and
scored on rolling origins every 12 steps of the tail ``V = min(max(240, T // 5), T // 2)``; no test origin is read. With one seed, the first ``k`` trees of a 40-tree
forest are exactly a ``k``-tree forest (scikit-learn draws the trees' seeds in order), so one fit per seed scores
every size; seeds 0..2 show the noise. Printed per seed and size: mean per-series MAE and the mean per-series MAE
relative to the fallback member's (series where the fallback's MAE > 0).

    .venv/bin/python bench/rf_trees.py [--traces DIR] [--history HISTORY.pkl] [--json out.json]

Default data: the Azure Functions 2019 day's fit window (minutes 0..1079 of ``bench/accuracy.py``'s protocol).
``--history``: a pickled :class:`forecaster.report.history.History` instead (its first 1,440 minutes, the report's
first fit window).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench.validation_split import HORIZON, load_fit_window, make_split, member_mae, summary
from forecaster.forecast.panel import Panel
from forecaster.forecast.trees import RandomForestMember

TREES = (10, 20, 30, 40)


def fit_window(args) -> tuple[str, Panel]:
    if args.history:
        history = pickle.load(open(args.history, "rb"))
        counts = np.asarray(history.counts[:, :1440], dtype=np.float64)
        return str(args.history), Panel(np.asarray(history.ids, dtype=object), history.start, pd.Timedelta(minutes=1),
                                        counts)
    return "azure", load_fit_window("azure", args.traces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--history", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    name, panel = fit_window(args)
    split = make_split(panel, HORIZON)
    rows = []
    for seed in (0, 1, 2):
        member = RandomForestMember(horizon=HORIZON, random_state=seed)
        started = time.perf_counter()
        member.fit_panel(split.train)
        seconds = time.perf_counter() - started
        trees = list(member.model_.estimators_)
        for k in TREES:
            member.model_.estimators_, member.model_.n_estimators = trees[:k], k
            scores = summary(split, member_mae(split, member))
            row = {"seed": seed, "trees": k, "mae_mean": scores["mae_mean"],
                   "mae_rel_fallback": scores["mae_rel_fallback"], "fit_s_40_trees": round(seconds, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for k in TREES:
        mine = [r for r in rows if r["trees"] == k]
        print(f"{name}: {k} trees: mean MAE {np.mean([r['mae_mean'] for r in mine]):.5f}, "
              f"relative to the fallback {np.mean([r['mae_rel_fallback'] for r in mine]):.4f} (mean of 3 seeds)")
    if args.json:
        args.json.write_text(json.dumps({"data": name, "series": panel.n_series, "fit_steps": split.train.n_steps,
                                         "origins": len(split.origins), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
