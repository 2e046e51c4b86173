"""Cold-start latency model figures: AWS Lambda's measured cold starts, and the simulator's events.

Usage:
    python bench/coldstart.py [--traces DIR] [--json PATH] [--configs N]

1. AWS Lambda (``aws_lambda_coldstarts_lambda_perf``): forecast each runtime
   configuration's next measured day; fit before 2025-06-01, conditioned on the
   latest lags after it (no refit). Members vs last value and trailing median.
2. Simulated cold starts: replica starts recorded by the fleet simulator on
   the Azure 2019 day (keep-alive 10 min, 1,350 models on the catalogue) and on
   the bursty Azure LLM code trace (reactive autoscaler); the first 60 % by start
   time fit the model, the rest are forecast walking forward in ten chunks
   (the model observes each chunk after forecasting it, without refitting).
   Baselines: last value and median of the last five of the same model and tier.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from forecaster.coldstart.lambda_perf import LAMBDA_FILE, evaluate_lambda  # noqa: E402
from forecaster.coldstart.model import ColdStartModel, baseline_predictions  # noqa: E402
from forecaster.settings import load_settings  # noqa: E402
from forecaster.contracts.fleetconfig import FleetConfig  # noqa: E402
from forecaster.simulation.runner import models_for, run_policies  # noqa: E402
from forecaster.simulation.workload import load_workload  # noqa: E402

AZURE_DAY = "azure_functions_2019_sample1350/invocations_per_function_1day_1350fn.csv.gz"
LLM_CODE = "azure_llm_inference_2023/AzureLLMInferenceTrace_code.csv"


def _errors(actual: np.ndarray, predicted: np.ndarray) -> dict:
    err = np.abs(np.asarray(predicted, dtype="float64") - actual)
    return {"mae_s": float(err.mean()), "mape_pct": float((err / actual).mean() * 100),
            "median_ape_pct": float(np.median(err / actual) * 100)}


def simulated_events_check(events: pd.DataFrame, config: FleetConfig, chunks: int = 10) -> dict:
    """Fit on the first 60 % of ``events`` by start, forecast the rest walking forward; model vs baselines."""
    events = events.sort_values("started_s").reset_index(drop=True)
    cut = int(len(events) * 0.6)
    train, test = events.iloc[:cut], events.iloc[cut:]
    started = time.perf_counter()
    model = ColdStartModel(config=config).fit(train)
    fit_s = time.perf_counter() - started
    predicted = []
    for part in np.array_split(np.arange(len(test)), chunks):
        piece = test.iloc[part]
        predicted.append(model.predict(piece)["total_seconds"].to_numpy())
        model.observe(piece)
    predicted = np.concatenate(predicted)
    base = baseline_predictions(train, test)
    actual = test["total_seconds"].to_numpy()
    prior = ColdStartModel(config=config, min_events=10 ** 9).fit(train).predict(test)["total_seconds"].to_numpy()
    return {"events_fit": int(len(train)), "events_test": int(len(test)), "fit_s": fit_s,
            "recent_weight": model.weight_,
            "by_state": test["cache_state"].value_counts().to_dict(),
            "methods": {"model": _errors(actual, predicted), "physics_prior": _errors(actual, prior),
                        "last_value": _errors(actual, base["last_value"].to_numpy()),
                        "trailing_median": _errors(actual, base["trailing_median"].to_numpy())}}


def run(traces: Path, configs: int | None = None, quick: bool = False) -> dict:
    out: dict = {}
    started = time.perf_counter()
    out["aws_lambda"] = evaluate_lambda(traces / LAMBDA_FILE, configs=configs or (60 if quick else None))
    out["aws_lambda"]["wall_s"] = time.perf_counter() - started
    print(f"lambda done in {out['aws_lambda']['wall_s']:.0f} s", file=sys.stderr, flush=True)
    wl = load_workload(traces / AZURE_DAY)
    models = models_for(wl, traces_dir=traces)
    wl = wl.window(0, (240 if quick else 720) * 60)
    config = FleetConfig(n_nodes=160)
    events = run_policies(wl, models, config, ["keepalive_10"])["keepalive_10"].events
    out["simulated_azure_keepalive10"] = simulated_events_check(events, config)
    llm = load_workload(traces / LLM_CODE)
    config = FleetConfig(n_nodes=16)
    events = run_policies(llm, models_for(llm), config, ["reactive"])["reactive"].events
    out["simulated_llm_code_reactive"] = simulated_events_check(events, config)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--configs", type=int, default=None, help="Random subset of Lambda configurations.")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result = run(args.traces or load_settings().traces_dir, configs=args.configs, quick=args.quick)
    print(json.dumps(result, indent=1, default=float))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
