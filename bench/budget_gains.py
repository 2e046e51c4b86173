"""Choose budget mode's controller window and gain on the Azure day's warm-up window only (minutes 0-239).

EVALUATION.md section 2 scores minutes 240-1439; policies may learn on 0-239. This script runs the minute
protocol's prewarm (causal empirical forecasts, the product's default cold cost) in budget mode at 100 % of the
10-minute keep-alive's waste on minutes 0-239 of every function, for a small fixed set of (window, gain) pairs,
and reports how far each one's spend over minutes 120-239 (the second half, after the start-up transient) lands
from the budget. The pair with the smallest miss becomes the product default
(``planner_waste_budget_window_min`` / ``_gain``). Nothing here reads a scored minute.

Usage: python bench/budget_gains.py [--functions N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from forecaster.planning.budget import WasteBudget  # noqa: E402
from forecaster.settings import Settings, load_settings  # noqa: E402
from forecaster.simulation.minute import WARMUP_MIN, keepalive_loaded, planner_loaded, score_loaded  # noqa: E402

AZURE_DAY = "azure_functions_2019_sample1350/invocations_per_function_1day_1350fn.csv.gz"
AZURE_MEMORY = "azure_functions_2019_sample1350/app_memory_1350fn.csv.gz"
CANDIDATES = ((60.0, 1 / 60.0), (30.0, 1 / 30.0), (30.0, 2 / 30.0), (15.0, 1 / 15.0), (15.0, 2 / 15.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--functions", type=int, default=None, help="First N functions only (default all).")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    traces = load_settings().traces_dir
    inv = pd.read_csv(traces / AZURE_DAY)
    memory = pd.read_csv(traces / AZURE_MEMORY).set_index("HashApp")["AverageAllocatedMb"]
    counts = inv[[c for c in inv.columns if c.startswith("minute_")]].to_numpy(dtype="float64")[:, :WARMUP_MIN]
    mb = memory.reindex(inv["HashFunction"]).to_numpy(dtype="float64")
    if args.functions:
        counts, mb = counts[:args.functions], mb[:args.functions]
    half = WARMUP_MIN // 2
    reference = score_loaded(counts, mb, keepalive_loaded(counts, 10), half).wasted_memory_mb_min
    product = Settings()
    rows = []
    for window, gain in CANDIDATES:
        started = time.perf_counter()
        loaded, info = planner_loaded(counts, mb, cold_cost=product.planner_cold_cost, product=product,
                                      budget=WasteBudget(pct=100.0, window_min=window, gain=gain))
        spend = 100.0 * score_loaded(counts, mb, loaded, half).wasted_memory_mb_min / reference
        rows.append({"window_min": window, "gain": gain, "spend_pct_minutes_120_239": spend,
                     "miss_pct": abs(spend - 100.0), "final_factor": info["budget"]["factor"],
                     "wall_s": time.perf_counter() - started})
        print(json.dumps(rows[-1]), flush=True)
    best = min(rows, key=lambda r: r["miss_pct"])
    print(f"chosen on the warm-up: window {best['window_min']:g} min, gain {best['gain']:.4f} per minute")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "chosen": best}, indent=1))


if __name__ == "__main__":
    main()
