"""The LSTM member on CPU and on CUDA: fit time, forecast time, agreement, and a GPU-trained model served on CPU.

The LSTM member picks CUDA whenever torch sees a GPU (``device=None``), so a nightly retrain on a GPU node trains
there, and its pickled model may be loaded by a forecast job or API without one. This script checks that path on
the shipped sample (the 100 busiest functions of the Azure Functions 2019 day, per minute):

1. fits the member (production defaults, ``horizon`` 60) on minutes 0..1199 on the CPU, and on CUDA when torch
   sees a GPU, timing each fit and each forecast (origins 1200, 1260, 1320, 1380; 60 minutes ahead);
2. scores both against the actual counts (MAE over all series, origins and horizons; the naive last value beside
   them as a yardstick) and prints the mean difference between the two forecasts relative to the mean count:
   the two fits draw the same windows and start from the same weights, but floating-point order differs over
   320 optimiser steps, so they are two comparable models, not the same numbers;
3. pickles the CUDA-trained member, loads it where torch sees no GPU (``torch.cuda.is_available`` patched to
   False, as on a CPU-only API node), and reports where its weights land and how far its forecasts are from the
   GPU's.

Without a GPU only step 1's CPU half runs. Medians of ``--repeats`` forecasts are printed; the fits run once each.

    python bench/lstm_device.py [--repeats 3] [--json out.json]
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from forecaster.forecast.lstm import LSTMMember  # noqa: E402
from forecaster.forecast.members import Naive  # noqa: E402
from forecaster.forecast.panel import Panel  # noqa: E402

FIT_MINUTES = 1200
ORIGINS = [1200, 1260, 1320, 1380]
HORIZON = 60


def sample_panel() -> Panel:
    """The shipped Azure 2019 sample (100 functions x 1,440 minutes) as a panel."""
    from forecaster.data import AZURE2019_TOP100, sample_path

    wide = pd.read_csv(sample_path(AZURE2019_TOP100))
    minutes = [c for c in wide.columns if c.startswith("minute_")]
    return Panel.from_wide(wide["HashFunction"].astype(str).to_numpy(), wide[minutes].to_numpy(dtype="float64"),
                           start="2019-07-15", step="1min")


def actuals(panel: Panel) -> np.ndarray:
    """(N, origins, H) the counts each forecast is scored against."""
    return np.stack([panel.values[:, o:o + HORIZON] for o in ORIGINS], axis=1)


def timed_forecasts(member, panel: Panel, repeats: int) -> tuple[np.ndarray, float]:
    """The member's forecasts and the median seconds of ``repeats`` runs."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = member.forecast(panel, ORIGINS, HORIZON)
        seconds.append(time.perf_counter() - started)
    return out, float(np.median(seconds))


def run(repeats: int = 3) -> dict:
    import torch

    panel = sample_panel()
    fit = panel.head(FIT_MINUTES)
    truth = actuals(panel)
    scale = float(np.nanmean(truth))
    naive = Naive().fit_panel(fit).forecast(panel, ORIGINS, HORIZON)
    report: dict = {"series": panel.n_series, "fit_minutes": FIT_MINUTES, "origins": ORIGINS, "horizon": HORIZON,
                    "torch": torch.__version__, "cuda_available": bool(torch.cuda.is_available()),
                    "mae_naive": float(np.nanmean(np.abs(naive - truth)))}
    forecasts = {}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        started = time.perf_counter()
        # the GPU run leaves the device to the member (None), as production does: it must pick CUDA itself
        member = LSTMMember(horizon=HORIZON, device="cpu" if device == "cpu" else None,
                            n_jobs=torch.get_num_threads()).fit_panel(fit)
        fit_s = time.perf_counter() - started
        out, forecast_s = timed_forecasts(member, panel, repeats)
        forecasts[device] = (member, out)
        report[device] = {"fit_s": fit_s, "forecast_s_median": forecast_s, "epochs_run": member.epochs_run_,
                          "final_loss": member.losses_[-1], "finite": bool(np.isfinite(out).all()),
                          "mae": float(np.nanmean(np.abs(out - truth))),
                          "parameters_on": str(next(member.network_.parameters()).device)}
    if "cuda" in forecasts:
        cpu_out, cuda_out = forecasts["cpu"][1], forecasts["cuda"][1]
        # the two fits' forecasts apart, as a share of the mean count (the same scale as their MAEs)
        report["cpu_vs_cuda_mean_abs_diff_over_mean_count"] = float(np.mean(np.abs(cpu_out - cuda_out)) / scale)
        report["fit_speedup_cuda_over_cpu"] = report["cpu"]["fit_s"] / report["cuda"]["fit_s"]
        blob = pickle.dumps(forecasts["cuda"][0])
        available = torch.cuda.is_available
        torch.cuda.is_available = lambda: False  # a CPU-only node loads what a GPU node trained
        try:
            loaded = pickle.loads(blob)
            served = loaded.forecast(panel, ORIGINS, HORIZON)
        finally:
            torch.cuda.is_available = available
        report["gpu_trained_served_on_cpu"] = {
            "parameters_on": str(next(loaded.network_.parameters()).device),
            "max_abs_diff_vs_cuda": float(np.max(np.abs(served - cuda_out))),
            "pickle_bytes": len(blob)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="Forecast runs per device (median reported).")
    parser.add_argument("--json", type=Path, default=None, help="Write the figures as JSON here.")
    args = parser.parse_args()
    report = run(args.repeats)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
