"""p_any of the product ensemble against the causal empirical hazard, on the minutes after its first fit.

Why the ensemble-driven prewarm holds sparse models so rarely (issue 11's closing note): the first 300 functions
of the Azure 2019 day, the ensemble fitted at minute 240 on minutes 0..239, one-minute-ahead ``p_any`` for
minutes 240..359 from both sources; per subset (sparse: under 20 % active minutes in the fit window) the mean
p_any on minutes with and without an invocation, the share of invoked minutes given p_any < 0.01, the Brier
score, and how often q0.99 > 0 on invoked minutes. Takes about 4 minutes on 2 cores.

    .venv/bin/python bench/p_any_check.py
"""
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from forecaster.planning.ensemble_source import EnsembleForecast  # noqa: E402
from forecaster.planning.forecasts import CountPanel, EmpiricalForecast  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
inv = pd.read_csv(Settings().traces_dir / "azure_functions_2019_sample1350" / "invocations_per_function_1day_1350fn.csv.gz")
counts = inv[[c for c in inv.columns if c.startswith("minute_")]].to_numpy(dtype="float64")[:300, :720]
ids = np.array([f"f{i}" for i in range(len(counts))], dtype=object)
start = pd.Timestamp("2019-07-15", tz="UTC")
panel = CountPanel(ids=ids, start=start, counts=counts)
ens = EnsembleForecast(panel, train_until_min=240, settings=Settings())
emp = EmpiricalForecast(panel)
rows = []
for t in range(240, 360):
    now = (start + pd.Timedelta(minutes=t)).to_pydatetime()
    for name, src in (("ensemble", ens), ("empirical", emp)):
        f = src.quantiles(now, 1)
        f = f.set_index("unique_id").reindex(ids)
        rows.append(pd.DataFrame({"source": name, "t": t, "p_any": f["p_any"].to_numpy(), "q0.99": f["q0.99"].to_numpy(),
                                  "actual": counts[:, t]}))
df = pd.concat(rows)
df["any"] = df["actual"] > 0
sparse = np.repeat((counts[:, :240] > 0).mean(axis=1) < 0.2, 1)
df["sparse"] = np.tile(sparse, 240)
for (name, sp), g in df.groupby(["source", "sparse"]):
    print(f"{name:10s} sparse={sp!s:5s} n={len(g):6d} mean p_any | invoked {g.loc[g['any'], 'p_any'].mean():.3f}"
          f" | idle {g.loc[~g['any'], 'p_any'].mean():.3f} | share p_any<0.01 on invoked {(g.loc[g['any'], 'p_any'] < 0.01).mean():.3f}"
          f" | Brier {((g['p_any'] - g['any']) ** 2).mean():.4f} | q0.99>0 on invoked {(g.loc[g['any'], 'q0.99'] > 0).mean():.3f}")
