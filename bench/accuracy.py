"""Forecast accuracy benchmark: the rolling-origin, no-refit protocol of ``../shared/EVALUATION.md`` section 1.

Usage:
    python bench/accuracy.py [--traces DIR] [--datasets azure,huawei_dc4] [--json PATH] [--no-refit]
    python bench/accuracy.py --trace PATH --format F [--json PATH]

For each dataset it fits the ensemble once on the fit window (members, weights
and conformal quantiles learned inside it), forecasts every origin without
refitting, and prints one table per subset (``all``, ``busy``) with the
ensemble, each member (with its own conformal q0.1 / q0.9 from the same
validation tail) and the peers measured in the same run:

* ``naive`` and ``moving_average_60``, with empirical per-series, per-horizon
  error quantiles from rolling origins inside the fit window (the same
  conformal code as the ensemble, with the peer as its only member);
* ``seasonal_naive`` where the protocol has a season (Huawei: one day);
* ``autoarima``, ``autoets`` (statsforecast) and ``lightgbm_global``
  (mlforecast) when the ``bench`` extra is installed (``bench/peers.py``:
  fitted once, ``forward`` / ``update`` at each origin, failed fits fall back
  to naive and are counted); otherwise, or with ``--skip-library-peers``,
  they are listed as skipped.

Then the targets of issue 3 (ensemble vs best peer), a paired per-series
comparison, and two speed figures: 60-minute quantile forecasts for 10,000
series (the Azure series tiled, fitted ensemble, one origin) against the
fastest peer, and the ensemble's retrain time on the fit window.
Data is read through the ingest path (``read_trace`` + ``build_count_batch``),
so the benchmark sees exactly what the store would hold.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from forecaster.forecast.backtest import (  # noqa: E402
    BacktestResult,
    Protocol,
    azure_protocol,
    evaluate,
    fit_scale,
    generic_protocol,
    huawei_protocol,
    run_backtest,
)
from forecaster.forecast.ensemble import Ensemble, default_members  # noqa: E402
from forecaster.forecast.members import MovingAverage, Naive, SeasonalNaive, actuals  # noqa: E402
from forecaster.forecast.panel import Panel  # noqa: E402
from forecaster.ingest.traces import read_trace  # noqa: E402
from forecaster.ingest.validate import build_count_batch  # noqa: E402

from bench.peers import missing_libraries, run_peers  # noqa: E402

DATASETS = {
    "azure": ("azure_functions_2019_sample1350/invocations_per_function_1day_1350fn.csv.gz", "azure2019"),
    "huawei_dc4": ("huawei_cloud_5min_dc4/datacentre_4.csv.gz", "huawei5min"),
}
LIBRARY_PEERS = ("autoarima", "autoets", "lightgbm_global")
COLUMNS = ["mase_median", "mase", "mase_h{a}", "mase_h{b}", "mase_h{c}", "wql", "coverage_q90", "spike_recall",
           "seconds_per_1000_series"]


def load_panel(path: Path, fmt: str | None) -> Panel:
    """Read a trace through the ingest path; steps inside a model's coverage without a count are 0."""
    trace = read_trace(path, fmt=fmt)
    batch = build_count_batch(
        trace.raw, source=trace.source, step_seconds=trace.step_seconds,
        now=datetime(2100, 1, 1, tzinfo=timezone.utc), windows=trace.windows,
    )
    step = pd.Timedelta(seconds=batch.step_seconds)
    start, end = batch.windows["start"].min(), batch.windows["end"].max()
    n_steps = int((end - start) / step)
    ids = np.array(sorted(batch.windows["unique_id"].astype(str)), dtype=object)
    row = pd.Index(ids)
    values = np.full((len(ids), n_steps), np.nan)
    for uid, lo, hi in batch.windows[["unique_id", "start", "end"]].itertuples(index=False):
        values[row.get_loc(str(uid)), int((lo - start) / step) : int((hi - start) / step)] = 0.0
    counts = batch.counts
    if len(counts):
        r = row.get_indexer(counts["unique_id"].astype(str))
        c = ((counts["ds"] - start) / step).astype(int).to_numpy()
        values[r, c] = counts["y"].to_numpy(dtype=np.float64)
    return Panel(ids, pd.Timestamp(start), step, values)


def protocol_for(name: str, panel: Panel) -> Protocol:
    if name == "azure":
        return azure_protocol(panel.n_steps)
    if name.startswith("huawei"):
        return huawei_protocol(panel.n_steps)
    return generic_protocol(panel.n_steps, panel.step_minutes, name)


def peers(protocol: Protocol) -> dict[str, Ensemble]:
    """The protocol's simple peers, each with empirical intervals from the fit window."""
    per_hour = max(1, int(round(60 / protocol.step_minutes)))
    out = {"naive": Naive(), "moving_average_60": MovingAverage(per_hour)}
    if protocol.season:
        out["seasonal_naive"] = SeasonalNaive(protocol.season)
    return {
        name: Ensemble([member], horizon=protocol.horizon, fallback=False, refit=False)
        for name, member in out.items()
    }


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_dataset(name: str, panel: Panel, refit: bool, library_peers: bool = True) -> tuple[BacktestResult, dict]:
    protocol = protocol_for(name, panel)
    say(f"[{name}] {panel.n_series} series x {panel.n_steps} steps; fit {protocol.fit_steps} steps, "
        f"{len(protocol.origins)} origins, horizons 1..{protocol.horizon}")
    ensemble = Ensemble(
        default_members(protocol.horizon), horizon=protocol.horizon, refit=refit, progress=lambda m: say(f"[{name}] {m}")
    )
    forecasts = run_backtest(ensemble, panel, protocol, members=True)
    for peer_name, peer in peers(protocol).items():
        started = time.perf_counter()
        forecasts[peer_name] = run_backtest(peer, panel, protocol)["ensemble"]
        say(f"[{name}] peer {peer_name}: {time.perf_counter() - started:.1f} s")
    if library_peers and not missing_libraries():
        forecasts |= run_peers(panel, protocol, forecasts["naive"], say=lambda m: say(f"[{name}] {m}"))
    skipped = [p for p in LIBRARY_PEERS if p not in forecasts]
    result = evaluate(panel, protocol, forecasts)
    extra = {
        "ensemble": ensemble,
        "protocol": protocol,
        "forecasts": forecasts,
        "fit_seconds": forecasts["ensemble"].extra["fit_seconds"],
        "skipped_peers": skipped,
        "peer_failures": {p: forecasts[p].extra.get("failed_series", 0) for p in LIBRARY_PEERS if p in forecasts},
    }
    return result, extra


def zero_coverage(panel: Panel, protocol: Protocol, forecasts, subset_mask: np.ndarray) -> str:
    """Coverage of q0.9 split into steps with no invocation (covered by any bound >= 0) and the others."""
    actual = actuals(panel.values, protocol.origins, protocol.horizon)[subset_mask]
    q90 = forecasts.q90[subset_mask]
    known = ~np.isnan(actual)
    zero = known & (actual == 0)
    nonzero = known & (actual > 0)
    return (f"coverage_q90 where actual > 0: {np.mean(actual[nonzero] <= q90[nonzero]):.3f}; share of points with "
            f"actual = 0 (covered by any bound >= 0): {zero.sum() / known.sum():.3f}")


def paired(panel: Panel, protocol: Protocol, result: BacktestResult, subset_mask: np.ndarray, peer: str) -> str:
    """Per-series MASE of the ensemble vs one peer: wins / ties / losses and the median ratio."""
    table = result.table
    per_series = table.groupby(["method", "unique_id"])[["abs_error", "points"]].sum()
    mae = (per_series["abs_error"] / per_series["points"]).unstack(0)
    scale = pd.Series(fit_scale(panel, protocol), index=panel.ids)
    chosen = pd.Index(panel.ids[subset_mask & (scale.to_numpy() > 0)])
    ours, theirs = mae.loc[chosen, "ensemble"], mae.loc[chosen, peer]
    wins, losses = int((ours < theirs - 1e-12).sum()), int((ours > theirs + 1e-12).sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (ours / theirs).replace([np.inf], np.nan).dropna()
    return (f"paired vs {peer}: ensemble better on {wins}, worse on {losses}, tied on {len(chosen) - wins - losses} "
            f"series; median MAE ratio {ratio.median():.3f}")


def print_tables(name: str, panel: Panel, result: BacktestResult, extra: dict, figures: dict) -> None:
    protocol = extra["protocol"]
    a, b, c = protocol.report_horizons
    columns = [col.format(a=a, b=b, c=c) for col in COLUMNS]
    busy = (result.table.drop_duplicates("unique_id").set_index("unique_id").loc[panel.ids, "busy"]).to_numpy()
    peer_names = [p for p in ("naive", "moving_average_60", "seasonal_naive", *LIBRARY_PEERS)
                  if p in extra["forecasts"]]
    for subset in ("all", "busy"):
        rows = result.summary[result.summary["subset"] == subset].set_index("method")
        key = f"{name}/{subset}"
        print(f"\n## {key}: {int(rows.loc['ensemble', 'series'])} series, {len(protocol.origins)} origins x "
              f"{protocol.horizon} horizons (fit once on steps 0..{protocol.fit_steps - 1}, no refit at origins)")
        print(rows[columns].to_string(float_format=lambda v: f"{v:.4f}"))
        if extra["skipped_peers"]:
            print("library peers skipped (bench extra not installed, failed, or --skip-library-peers): "
                  + ", ".join(extra["skipped_peers"]))
        if extra["peer_failures"]:
            print("library peers, series that fell back to naive (failed fit or forecast): " + ", ".join(
                f"{p} {k}" for p, k in extra["peer_failures"].items()))
        fastest = min(peer_names, key=lambda p: rows.loc[p, "seconds_per_1000_series"])
        print(f"time per 1000 series: ensemble {rows.loc['ensemble', 'seconds_per_1000_series']:.1f} s, "
              f"fastest peer {fastest} {rows.loc[fastest, 'seconds_per_1000_series']:.1f} s")
        # JSON keys are fixed (mase_h1, mase_h5, mase_h15) and hold the protocol's three report horizons
        json_key = dict(zip(columns, [c.format(a=1, b=5, c=15) for c in COLUMNS], strict=True))
        figures[key] = {
            method: {json_key[col]: _num(rows.loc[method, col]) for col in columns}
            | {"series": int(rows.loc[method, "series"])}
            for method in rows.index
        }
        best_mase = min(peer_names, key=lambda p: rows.loc[p, "mase_median"])
        best_wql = min(peer_names, key=lambda p: rows.loc[p, "wql"])
        best_spike = max(peer_names, key=lambda p: np.nan_to_num(rows.loc[p, "spike_recall"], nan=-1))
        ens = rows.loc["ensemble"]
        gain = 1 - ens["mase_median"] / rows.loc[best_mase, "mase_median"]
        print(f"targets: median MASE {ens['mase_median']:.4f} vs best peer {best_mase} "
              f"{rows.loc[best_mase, 'mase_median']:.4f} -> {100 * gain:.1f}% lower (target >= 10%)")
        print(f"         wQL {ens['wql']:.4f} vs best peer {best_wql} {rows.loc[best_wql, 'wql']:.4f} "
              f"({'lower' if ens['wql'] < rows.loc[best_wql, 'wql'] else 'NOT lower'})")
        print(f"         coverage_q90 {ens['coverage_q90']:.3f} (target 0.85..0.95); spike recall "
              f"{ens['spike_recall']:.3f} vs best peer {best_spike} {rows.loc[best_spike, 'spike_recall']:.3f} "
              f"({100 * (ens['spike_recall'] - rows.loc[best_spike, 'spike_recall']):+.1f} points; target +10)")
        mask = busy if subset == "busy" else np.ones(panel.n_series, dtype=bool)
        print("         " + zero_coverage(panel, protocol, extra["forecasts"]["ensemble"], mask))
        print("         " + paired(panel, protocol, result, mask, best_mase))


def _num(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value


def speed(panel: Panel, ensemble: Ensemble, n_series: int = 10_000, horizon_minutes: int = 60) -> dict:
    """Seconds to produce ``horizon_minutes`` of quantile forecasts for ``n_series`` series at one origin.

    The series are the dataset's own, repeated; each copy keeps its original's
    id, so it gets the original's fitted weights, scales and quantiles and the
    members do the same work per series as in production.
    """
    repeats = math.ceil(n_series / panel.n_series)
    ids = np.tile(panel.ids, repeats)[:n_series]
    values = np.tile(panel.values, (repeats, 1))[:n_series]
    big = Panel.from_wide(ids, values, start=panel.start, step=panel.step)
    h = max(1, int(round(horizon_minutes / panel.step_minutes)))
    started = time.perf_counter()
    arrays = ensemble.forecast(big, [big.n_steps], h)
    seconds = time.perf_counter() - started
    assert arrays["q0.9"].shape == (n_series, 1, h)
    peer = Naive().fit_panel(big)
    started = time.perf_counter()
    peer.forecast(big, [big.n_steps], h)
    return {"series": n_series, "horizon_steps": h, "ensemble_seconds": seconds,
            "fastest_peer": "naive", "fastest_peer_seconds": time.perf_counter() - started,
            "member_seconds": dict(ensemble.forecast_seconds_)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--datasets", default="azure", help="comma-separated: " + ", ".join(DATASETS))
    parser.add_argument("--trace", type=Path, help="run the protocol on this trace file instead")
    parser.add_argument("--format", dest="fmt", help="trace format for --trace (default: detect)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--no-refit", action="store_true", help="keep the members fitted before the validation tail")
    parser.add_argument("--speed-series", type=int, default=10_000)
    parser.add_argument("--skip-library-peers", action="store_true",
                        help="leave out autoarima, autoets and lightgbm_global (minutes on the Azure day)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    jobs = [(args.trace.name.split(".")[0], args.trace, args.fmt)] if args.trace else [
        (name, args.traces / DATASETS[name][0], DATASETS[name][1]) for name in args.datasets.split(",")
    ]
    figures: dict = {"datasets": {}, "speed": {}, "retrain_seconds": {}, "members": {}, "peer_failures": {}}
    for name, path, fmt in jobs:
        panel = load_panel(path, fmt)
        result, extra = run_dataset(name, panel, refit=not args.no_refit, library_peers=not args.skip_library_peers)
        print_tables(name, panel, result, extra, figures["datasets"])
        ensemble = extra["ensemble"]
        figures["retrain_seconds"][name] = extra["fit_seconds"]
        figures["peer_failures"][name] = extra["peer_failures"]
        figures["members"][name] = {
            "fit_seconds": ensemble.fit_seconds_, "failures": ensemble.failures_,
            "quantile_method": ensemble.quantile_method_, "quantile_scores": ensemble.quantile_scores_,
            "head_series_share": float(ensemble.head_series_.mean()),
            "mean_weight": dict(zip(ensemble.member_names_, ensemble.weights_.mean(axis=0).round(4).tolist(),
                                    strict=True)),
        }
        print(f"\nretrain (fit window, {'with' if not args.no_refit else 'without'} refit after validation): "
              f"{extra['fit_seconds']:.1f} s; per member: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in ensemble.fit_seconds_.items()))
        print("failures: " + (json.dumps(ensemble.failures_) if ensemble.failures_ else "none"))
        scores = ", ".join(f"{k} {v:.4g}" for k, v in ensemble.quantile_scores_.items())
        print(f"quantile bounds: {ensemble.quantile_method_} on {ensemble.head_series_.mean():.1%} of the series, "
              f"residual quantiles on the rest (chosen per series on the validation tail; cross-fitted pinball loss "
              f"q0.1 + q0.9 per point: {scores or 'no heads'})")
        print("share of series per chosen member: " + ", ".join(
            f"{k} {v:.3f}" for k, v in figures["members"][name]["mean_weight"].items()))
        if args.speed_series and panel.step_minutes <= 1:
            figures["speed"][name] = speed(panel, ensemble, args.speed_series)
            s = figures["speed"][name]
            print(f"speed: 60-minute quantile forecasts for {s['series']} series: {s['ensemble_seconds']:.2f} s "
                  f"(target <= 10 s; fastest peer naive {s['fastest_peer_seconds']:.3f} s); per member: "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in s["member_seconds"].items()))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=float))
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
