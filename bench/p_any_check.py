"""p_any of the product ensemble against the planner's causal empirical hazard, on the minutes after its first fit.

The Azure 2019 day's functions (all 1,350 by default; ``--functions 300`` is the development sample, which
turned out unrepresentative: see the hazard pool in ``forecaster/forecast/hazard.py``); the product ensemble (``EnsembleForecast``, production defaults)
fitted at minute 240 on minutes 0..239; one-minute-ahead ``p_any`` for minutes 240..599 from both sources.
Three views:

1. calibration, per subset (sparse: under 20 % active minutes before minute 240): mean p_any on minutes with and
   without an invocation, the share of invoked minutes given p_any < 0.01, the Brier score; then how the fit chose
   its ``p_any`` on its validation tail (:class:`~forecaster.forecast.p_any.PAnyModel`) and the Brier score per
   block of ``BLOCK_MIN`` minutes after the fit;
   and what the alert ``PrewarmPAnyMiscalibrated`` reads: per band of a function-hour's mean ``p_any``, the mean
   ``p_any`` over the invoked share over the last 3 hours, hour by hour;
2. the planner's use: the minute protocol holds a function in minute t when ``p * kappa / rate >= 1 - p``
   (its cold cost weighted by the inverse of its invocation rate so far, as ``planner_loaded`` does; ``kappa`` is
   the product's cold cost times the functions' mean rate, its ``model`` weighting); for a
   fixed grid of ``kappa``, the 75th percentile over functions of their cold % and the idle minutes held.
   Brier scores hardly see probabilities of 1e-4 vs 1e-3, but for a function called once an hour that is the
   difference between holding it all day and not.
3. reliability, by activity (invoked minutes of the first 240) and age (minutes since the last invoked one): mean
   p_any against the share of minutes invoked, one minute ahead and ``RELIABILITY_H`` minutes ahead (binned by the
   age at issue). It shows the idle-time hazard's geometric tail (ages beyond 240 minutes) reading the pooled
   hazard squared when a series has no long gap of its own (``forecaster/forecast/hazard.py``: the tail's prior
   events are ``prior_weight * h0`` over ``prior_weight / h0`` steps): p_any 0.0004 where 0.0016 of the minutes saw
   a call (20-59 invoked minutes, idle 3 hours or more). Written as ``prior_weight`` events it is calibrated there
   (0.0015), but the planner's curves got worse with it (minute protocol, 2026-12-03: p75 at the hybrid's waste
   13.6 % against 7.7 %, gap closed 0.39 against 0.75), so the formula is left as it is; ``bench/long_idle.py``
   compares the two tails on the empirical source and shows where the held minutes go.

Measured (2026-12-06, main 89af707 + this table, the ``shrunk`` default, 5 min): Brier sparse 0.0219 (ensemble)
against 0.0206 (empirical), **a loss**; busy 0.0500 against 0.0575. The fit took the stack everywhere (tail Brier
0.0244 against 0.0249 for the per-cell choice and 0.0362 for the hazard), and the sparse loss grows with the time
since the fit: 0.0139 / 0.0134, 0.0216 / 0.0204, 0.0303 / 0.0279 over minutes 240-359, 360-479, 480-599 (+4 %, +6 %,
+9 %). On the validation tail the stack had beaten the hazard in the sparse segments too (activity 0.02-0.1, one step
ahead: 0.0513 against 0.0756). A script run to minute 959 (not kept) read the fit at minute 600, one step ahead,
within 1.2 % of the hazard in the activity segments 0.02-0.3 per 120 minutes, and 6.5 % then under 1.5 % above it
in the rarely invoked one: the stack's edge on sparse series is not reliably out of sample.

**The loss on sparse functions is the short fit's** (2026-12-06, a37c78f, ``--fit-min``/``--end-min``, 5-7 min
each): with more history before the fit the ensemble's one-step ``p_any`` on sparse functions moves from a loss to
a win against the planner's source, and stays well ahead on busy ones:

=========================  ================  ================  ======================================
fit at minute (history)    sparse Brier      busy Brier        sparse, per 120 minutes after the fit
=========================  ================  ================  ======================================
240 (4 h), 240-599         0.0219 / 0.0206   0.0500 / 0.0575   +4 %, +6 %, +9 %
600 (10 h), 600-959        0.0245 / 0.0243   0.0517 / 0.0621   +2 %, 0 %, 0 %
1080 (18 h), 1080-1439     0.0133 / 0.0140   0.0453 / 0.0569   -4 %, -5 %, -10 %
=========================  ================  ================  ======================================

(ensemble / empirical). 1080 is the fit window of ``bench/accuracy.py``'s Azure protocol; its minutes 1080-1439 are
that protocol's test window, read here only to measure, nothing was chosen on them. The decision-curve view agrees
at 1080: at kappa 3 the ensemble's hold rule has 14.3 % p75 cold at 77.7 k idle minutes against the empirical
source's 24.6 % at 91.2 k (at kappa 1, 35.7 % at 39.7 k against 33.3 % at 48.2 k). Production retrains nightly on
days of history; the replays of ``bench/policies.py`` fit first at minute 240, where the sparse loss is.

What ``PrewarmPAnyMiscalibrated`` reads (3e78492): in the lowest band (a function-hour's mean ``p_any`` under 0.02) the
ensemble's ``p_any`` runs 1.2-5 times the invoked share after the 18-hour fit and 1.3-3 times after the 4-hour one;
the other bands stay within 0.65-1.17. The rule's factor of two fires on the 4-hour fit's first hours only.

Takes about 5 minutes on 2 cores at 1,350 functions (7 with ``--fit-min 1080``).

    .venv/bin/python bench/p_any_check.py [--functions N] [--fit-min 240] [--end-min 600]
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
from forecaster.store.dashboard import P_ANY_BAND_EDGES, p_any_band_names  # noqa: E402
from forecaster.settings import Settings  # noqa: E402

#: Default fit minute and end of the scored minutes (``--fit-min``, ``--end-min``).
FIT_MIN, END_MIN = 240, 600
KAPPAS = (1, 3, 10, 30, 100, 300)
#: Minutes per block of the Brier-by-time-since-the-fit table.
BLOCK_MIN = 120
#: The reliability table's second horizon (minutes ahead; a cold start's lead time on the fleet is a few minutes).
RELIABILITY_H = 5
#: PrewarmPAnyMiscalibrated's thresholds (deploy/prometheus-rules.yml): the factor p_any may be off by, and the
#: requests expected or seen in 3 hours below which a band is not judged.
ALERT_RATIO, ALERT_MIN_REQUESTS = 2.0, 50
#: Reliability bands: invoked minutes before the fit (of FIT_MIN) and minutes since the last invocation.
ACTIVITY_EDGES = (0, 1, 5, 20, 60, 240)
AGE_EDGES = (1, 10, 60, 180, 10**6)
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--functions", type=int, default=1350, help="The first N functions of the day (default all).")
parser.add_argument("--fit-min", type=int, default=FIT_MIN,
                    help="Minute of the ensemble's fit: it sees minutes before it (default 240; 1080 is the fit window "
                         "of bench/accuracy.py's Azure protocol).")
parser.add_argument("--end-min", type=int, default=END_MIN, help="End of the scored minutes (exclusive; at most 1440).")
args = parser.parse_args()
N_FUNCTIONS, FIT_MIN, END_MIN = args.functions, args.fit_min, min(args.end_min, 1440)
if not 0 < FIT_MIN < END_MIN:
    parser.error("--fit-min must be above 0 and below --end-min")

inv = pd.read_csv(Settings().traces_dir / "azure_functions_2019_sample1350" / "invocations_per_function_1day_1350fn.csv.gz")
counts = inv[[c for c in inv.columns if c.startswith("minute_")]].to_numpy(dtype="float64")[:N_FUNCTIONS, :END_MIN]
ids = np.array([f"f{i}" for i in range(len(counts))], dtype=object)
start = pd.Timestamp("2019-07-15", tz="UTC")
panel = CountPanel(ids=ids, start=start, counts=counts)
sources = {"ensemble": EnsembleForecast(panel, train_until_min=FIT_MIN, settings=Settings()),
           "empirical": EmpiricalForecast(panel)}
p_any = {name: np.zeros((len(ids), END_MIN - FIT_MIN)) for name in sources}
# p_any for the minute RELIABILITY_H - 1 steps after the first forecast one (target minute t + h - 1)
p_ahead = {name: np.full((len(ids), END_MIN - FIT_MIN), np.nan) for name in sources}
for t in range(FIT_MIN, END_MIN):
    now = (start + pd.Timedelta(minutes=t)).to_pydatetime()
    for name, source in sources.items():
        frame = source.quantiles(now, RELIABILITY_H)
        frame = frame.assign(step=frame.groupby("unique_id").cumcount())
        first = frame[frame.step == 0].set_index("unique_id").reindex(ids)
        p_any[name][:, t - FIT_MIN] = first["p_any"].to_numpy()
        if t + RELIABILITY_H - 1 < END_MIN:
            last = frame[frame.step == RELIABILITY_H - 1].set_index("unique_id").reindex(ids)
            p_ahead[name][:, t + RELIABILITY_H - 1 - FIT_MIN] = last["p_any"].to_numpy()
invoked = counts[:, FIT_MIN:END_MIN] > 0
sparse = (counts[:, :FIT_MIN] > 0).mean(axis=1) < 0.2
rate = (np.cumsum(counts, axis=1)[:, FIT_MIN - 1:END_MIN - 1] + 1.0) / (np.arange(FIT_MIN, END_MIN) + 1.0)
for name, p in p_any.items():
    for subset, rows in (("sparse", sparse), ("busy", ~sparse)):
        pi, yi = p[rows], invoked[rows]
        print(f"{name:10s} {subset:6s} mean p_any | invoked {pi[yi].mean():.3f} | idle {pi[~yi].mean():.4f}"
              f" | share p_any<0.01 on invoked {(pi[yi] < 0.01).mean():.3f} | Brier {((pi - yi) ** 2).mean():.4f}")
# how the fit chose its p_any (PAnyModel.method_: one estimate everywhere, or per activity segment and horizon band),
# and the Brier score by block of minutes since the fit: the choice is made on the fit's validation tail
fitted = sources["ensemble"]._model(FIT_MIN)  # the fit that served minutes FIT_MIN.. (cached: no refit)
for key, shard in (getattr(fitted, "shards_", None) or {"all": fitted}).items():
    chosen = getattr(shard, "p_any_model_", None)
    if chosen is not None:
        print(f"ensemble fit at minute {FIT_MIN}, shard {key}: p_any {chosen.method_}; validation tail Brier "
              + ", ".join(f"{k} {v:.4f}" for k, v in chosen.scores_.items())
              + (f"; cells {chosen.segment_methods_}" if chosen.segment_methods_ else ""))
for lo in range(0, END_MIN - FIT_MIN, BLOCK_MIN):
    block = slice(lo, min(lo + BLOCK_MIN, END_MIN - FIT_MIN))
    print(f"minutes {FIT_MIN + lo}-{FIT_MIN + block.stop - 1} Brier | " + " | ".join(
        f"{subset} " + " ".join(f"{name} {((p[rows, block] - invoked[rows, block]) ** 2).mean():.4f}"
                                 for name, p in p_any.items())
        for subset, rows in (("sparse", sparse), ("busy", ~sparse))))
# what the alert PrewarmPAnyMiscalibrated reads (deploy/prometheus-rules.yml): per band of a function-hour's mean
# p_any (forecaster.store.dashboard.P_ANY_BAND_EDGES), the mean p_any over the invoked share of those function-minutes,
# averaged over the last 3 hours as avg_over_time does; "!" where it would hold (off by more than ALERT_RATIO with at
# least ALERT_MIN_REQUESTS requests expected or seen in the 3 hours; it fires after an hour of that)
hours = (END_MIN - FIT_MIN) // 60
band_edges = (0.0, *P_ANY_BAND_EDGES, np.inf)
for name, p in p_any.items():
    hourly = p[:, :60 * hours].reshape(len(ids), hours, 60)
    hit = invoked[:, :60 * hours].reshape(len(ids), hours, 60)
    band_of = np.digitize(hourly.mean(axis=2), band_edges[1:-1])  # (functions, hours)
    cells = []
    for b, band in enumerate(p_any_band_names()):
        mean_p, share, minutes = (np.full(hours, np.nan) for _ in range(3))
        for k in range(hours):
            rows = band_of[:, k] == b
            if rows.any():
                mean_p[k], share[k], minutes[k] = hourly[rows, k].mean(), hit[rows, k].mean(), 60 * rows.sum()
        reads = []
        for k in range(hours):
            window = slice(max(0, k - 2), k + 1)
            if np.isnan(mean_p[window]).all():
                reads.append("-")
                continue
            m, v, n = (np.nanmean(x[window]) for x in (mean_p, share, minutes))
            ratio = m / v if v > 0 else np.inf
            holds = (ratio > ALERT_RATIO or ratio < 1 / ALERT_RATIO) and 3 * n * max(m, v) >= ALERT_MIN_REQUESTS
            reads.append(f"{ratio:.2f}{'!' if holds else ''}")
        cells.append(f"{band}: " + " ".join(reads))
    print(f"{name:10s} mean p_any / invoked share over 3 hours, per hour, by p_any band | " + " | ".join(cells))
for name, p in p_any.items():
    line = []
    for kappa in KAPPAS:
        held = p >= 1.0 / (1.0 + kappa / rate)
        calls = invoked.sum(axis=1)
        cold = ((~held) & invoked).sum(axis=1)[calls > 0] / calls[calls > 0]
        line.append(f"kappa {kappa}: p75 cold {100 * np.percentile(cold, 75):.1f}% idle {int((held & ~invoked).sum())}")
    print(f"{name:10s} " + " | ".join(line))

# Reliability by activity and age: is p_any too low at long idle ages for mid-activity functions (the fleet day's
# p75 misses are session starts after 1-3 hours idle; bench/fleet_margin.py)? Age: minutes since the last invoked
# minute before the target minute (causal), "never" when none since minute 0.
last_seen = np.full(len(ids), -10**6)
ages = np.zeros((len(ids), END_MIN - FIT_MIN))
for t in range(END_MIN):
    if t >= FIT_MIN:
        ages[:, t - FIT_MIN] = t - last_seen
    last_seen = np.where(counts[:, t] > 0, t, last_seen)
active_before = (counts[:, :FIT_MIN] > 0).sum(axis=1)
ages_at_issue = np.full_like(ages, -1.0)  # aligned to the target minute; -1 where the issue fell before FIT_MIN
ages_at_issue[:, RELIABILITY_H - 1:] = ages[:, :ages.shape[1] - (RELIABILITY_H - 1)] + (RELIABILITY_H - 1)
print(f"\nreliability: mean p_any against the invoked share of minutes, by invoked minutes of the first {FIT_MIN}"
      f" and minutes idle; horizons 1 and {RELIABILITY_H}")
for lo, hi in zip(ACTIVITY_EDGES[:-1], ACTIVITY_EDGES[1:]):
    rows = (active_before >= lo) & (active_before < hi)
    for alo, ahi in zip(AGE_EDGES[:-1], AGE_EDGES[1:]):
        cell = rows[:, None] & (ages >= alo) & (ages < ahi)
        if cell.sum() < 50:
            continue
        parts = [f"active {lo:>3}-{hi:<3} idle {alo:>4}-{'' if ahi >= 10**6 else ahi:<4} n {int(cell.sum()):>7}"
                 f" invoked {invoked[cell].mean():.4f}"]
        # horizon RELIABILITY_H: binned by the age when the forecast was issued, RELIABILITY_H - 1 minutes earlier
        ahead = rows[:, None] & (ages_at_issue >= alo) & (ages_at_issue < ahi)
        parts.append(f"h{RELIABILITY_H} n {int(ahead.sum()):>7} invoked {invoked[ahead].mean():.4f}")
        for name in sources:
            parts.append(f"{name} h1 {p_any[name][cell].mean():.4f} h{RELIABILITY_H} {p_ahead[name][ahead].mean():.4f}")
        print(" | ".join(parts))
