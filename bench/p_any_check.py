"""p_any of the product ensemble against the planner's causal empirical hazard, on the minutes after its first fit.

The Azure 2019 day's functions (all 1,350 by default; ``--functions 300`` is the development sample, which
turned out unrepresentative: see the hazard pool in ``forecaster/forecast/hazard.py``); the product ensemble (``EnsembleForecast``, production defaults)
fitted at minute 240 on minutes 0..239; one-minute-ahead ``p_any`` for minutes 240..599 from both sources.
Two views:

1. calibration, per subset (sparse: under 20 % active minutes before minute 240): mean p_any on minutes with and
   without an invocation, the share of invoked minutes given p_any < 0.01, the Brier score;
2. the planner's use: the minute protocol holds a function in minute t when ``p * kappa / rate >= 1 - p``
   (its cold cost weighted by the inverse of its invocation rate so far, as ``planner_loaded`` does); for a
   fixed grid of ``kappa``, the 75th percentile over functions of their cold % and the idle minutes held.
   Brier scores hardly see probabilities of 1e-4 vs 1e-3, but for a function called once an hour that is the
   difference between holding it all day and not.

Takes about 5 minutes on 2 cores at 1,350 functions.

    .venv/bin/python bench/p_any_check.py [--functions N]
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from forecaster.planning.ensemble_source import EnsembleForecast  # noqa: E402
from forecaster.planning.forecasts import CountPanel, EmpiricalForecast  # noqa: E402
from forecaster.settings import Settings  # noqa: E402

FIT_MIN, END_MIN = 240, 600
KAPPAS = (1, 3, 10, 30, 100, 300)
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--functions", type=int, default=1350, help="The first N functions of the day (default all).")
N_FUNCTIONS = parser.parse_args().functions

inv = pd.read_csv(Settings().traces_dir / "azure_functions_2019_sample1350" / "invocations_per_function_1day_1350fn.csv.gz")
counts = inv[[c for c in inv.columns if c.startswith("minute_")]].to_numpy(dtype="float64")[:N_FUNCTIONS, :720]
ids = np.array([f"f{i}" for i in range(len(counts))], dtype=object)
start = pd.Timestamp("2019-07-15", tz="UTC")
panel = CountPanel(ids=ids, start=start, counts=counts)
sources = {"ensemble": EnsembleForecast(panel, train_until_min=FIT_MIN, settings=Settings()),
           "empirical": EmpiricalForecast(panel)}
p_any = {name: np.zeros((len(ids), END_MIN - FIT_MIN)) for name in sources}
for t in range(FIT_MIN, END_MIN):
    now = (start + pd.Timedelta(minutes=t)).to_pydatetime()
    for name, source in sources.items():
        frame = source.quantiles(now, 1).set_index("unique_id").reindex(ids)
        p_any[name][:, t - FIT_MIN] = frame["p_any"].to_numpy()
invoked = counts[:, FIT_MIN:END_MIN] > 0
sparse = (counts[:, :FIT_MIN] > 0).mean(axis=1) < 0.2
rate = (np.cumsum(counts, axis=1)[:, FIT_MIN - 1:END_MIN - 1] + 1.0) / (np.arange(FIT_MIN, END_MIN) + 1.0)
for name, p in p_any.items():
    for subset, rows in (("sparse", sparse), ("busy", ~sparse)):
        pi, yi = p[rows], invoked[rows]
        print(f"{name:10s} {subset:6s} mean p_any | invoked {pi[yi].mean():.3f} | idle {pi[~yi].mean():.4f}"
              f" | share p_any<0.01 on invoked {(pi[yi] < 0.01).mean():.3f} | Brier {((pi - yi) ** 2).mean():.4f}")
for name, p in p_any.items():
    line = []
    for kappa in KAPPAS:
        held = p >= 1.0 / (1.0 + kappa / rate)
        calls = invoked.sum(axis=1)
        cold = ((~held) & invoked).sum(axis=1)[calls > 0] / calls[calls > 0]
        line.append(f"kappa {kappa}: p75 cold {100 * np.percentile(cold, 75):.1f}% idle {int((held & ~invoked).sum())}")
    print(f"{name:10s} " + " | ".join(line))
