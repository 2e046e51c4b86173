"""Validation for a planner choice: the fleet simulator on windows no benchmark scores, at equal waste.

A change to the planner's objective (a cold-cost weighting, a sizing rule, a cap) must be chosen on data inside
the fit window, never on the scored day of ``bench/policies.py``. This script replays two such windows through
the product's plan step and actuator (``prewarm`` with the causal empirical forecasts: the ensemble's first fit
needs the 240 minutes these windows end with) over a fixed cold-cost grid, beside the hybrid histogram and the
10-minute keep-alive, and reads the curve at the hybrid's waste (and the waste at the hybrid's p75 cold %):

* ``azure_morning``: the Azure Functions day's minutes 0-239 (1,350 functions, 160 nodes x 8 GPUs), scored from
  minute 120 (before that the cluster fills from empty; ``--warmup-minutes`` to move it). ``bench/policies.py``
  scores the same day from minute 240 on.
* ``huawei_day``: the first day of Huawei Cloud's datacentre 4 (8 busy request channels, 160 nodes), scored from
  minute 240. ``bench/accuracy.py`` tests forecasts on its last 7 days, not this one.

Variants run under the product's settings, so an environment variable selects one
(``PREWARM_PLANNER_COLD_COST_WEIGHTING=request python bench/planner_validation.py``); a code variant runs from
its own worktree (``git worktree add /tmp/variant <commit>`` and the same command there: the script imports the
package beside it). ``--json`` keeps a run's figures; ``--against`` a kept run's reads the two curves at equal
waste: the other run's curve at each of this run's points (interpolated, never extrapolated).

Usage (traces from ``PREWARM_TRACES_DIR``, default ``../shared/traces``; about 9 minutes on 2 cores)::

    .venv/bin/python bench/planner_validation.py [--json out.json] [--windows azure_morning,huawei_day]
        [--grid 1,2,4,8,16,64] [--warmup-minutes 120] [--against other.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forecaster.contracts.fleetconfig import FleetConfig  # noqa: E402
from forecaster.forecast.registry import code_version  # noqa: E402
from forecaster.settings import load_settings  # noqa: E402
from forecaster.simulation.curves import cost_at, value_at  # noqa: E402
from forecaster.simulation.runner import models_for, run_policies, summary_table  # noqa: E402
from forecaster.simulation.workload import load_workload  # noqa: E402

#: window -> (trace under PREWARM_TRACES_DIR, minutes replayed, default scored-from minute)
WINDOWS = {
    "azure_morning": ("azure_functions_2019_sample1350/invocations_per_function_1day_1350fn.csv.gz", 240, 120),
    "huawei_day": ("huawei_cloud_5min_dc4/datacentre_4.csv.gz", 1440, 240),
}
#: cold costs of the curve: the product's default and the fleet day's grid (``bench/policies.py``'s ``FLEET_GRID``),
#: so that the curve reaches the hybrid histogram's waste as it does there
GRID = (1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
#: figures read off the curve at the hybrid histogram's waste
READINGS = ("cold_pct_p75", "wait_p99_s", "cold_pct_overall", "slo_attainment")


def validate(window: str, traces_dir: Path, grid: tuple[float, ...], warmup_min: int | None) -> dict:
    """One window: the baselines' rows, the prewarm curve's points, and the curve read at the hybrid's waste."""
    path, minutes, scored_from = WINDOWS[window]
    settings = load_settings()
    workload = load_workload(traces_dir / path).window(0, minutes * 60.0)
    config = FleetConfig(n_nodes=160, score_from_s=60.0 * (scored_from if warmup_min is None else warmup_min))
    models = models_for(workload, traces_dir=traces_dir)
    started = time.perf_counter()
    results = run_policies(workload, models, config, ["keepalive_10", "hybrid_histogram"], product=settings)
    for cost in grid:
        run = run_policies(workload, models, config, ["prewarm"], cold_cost=cost, forecaster="empirical",
                           product=settings)
        results[f"prewarm_k{cost:g}"] = run["prewarm"]
    table = summary_table(results)
    hybrid_waste = table["hybrid_histogram"]["wasted_norm_pct"]
    curve = [table[f"prewarm_k{cost:g}"] for cost in grid]
    at_hybrid = {key: value_at([(row["wasted_norm_pct"], row[key]) for row in curve], hybrid_waste)
                 for key in READINGS}
    # the other way round, for a curve that beats the hybrid before it reaches its waste
    at_hybrid["waste_pct_at_hybrid_p75"] = cost_at([(row["wasted_norm_pct"], row["cold_pct_p75"]) for row in curve],
                                                   table["hybrid_histogram"]["cold_pct_p75"])
    return {"trace": path, "minutes": minutes, "scored_from_min": config.score_from_s / 60.0,
            "weighting": settings.planner_cold_cost_weighting, "mapped_by": models.attrs.get("mapped_by"),
            "seconds": time.perf_counter() - started,
            "rows": table, "at_hybrid_waste": {"waste_pct": hybrid_waste, **at_hybrid}}


def against(out: dict, other: dict) -> list[dict]:
    """Each of this run's curve points beside the other run's curve read at the same waste."""
    grid = sorted(other["rows"][name]["cold_cost"] for name in other["rows"] if name.startswith("prewarm_k"))
    theirs = [other["rows"][f"prewarm_k{cost:g}"] for cost in grid]
    lines = []
    for name, row in out["rows"].items():
        if not name.startswith("prewarm_k"):
            continue
        waste = row["wasted_norm_pct"]
        lines.append({"point": name, "waste_pct": waste,
                      **{key: (row[key], value_at([(r["wasted_norm_pct"], r[key]) for r in theirs], waste))
                         for key in READINGS}})
    return lines


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", default=",".join(WINDOWS), help=f"Comma list of: {', '.join(WINDOWS)}.")
    parser.add_argument("--grid", default=",".join(f"{c:g}" for c in GRID), help="Cold costs of the curve.")
    parser.add_argument("--warmup-minutes", type=int, default=None,
                        help="Score every window from this minute instead of its default.")
    parser.add_argument("--json", type=Path, default=None, help="Write the figures here.")
    parser.add_argument("--against", type=Path, default=None,
                        help="A --json of another run (a variant): read its curves at this run's points.")
    args = parser.parse_args()
    names = [w.strip() for w in args.windows.split(",") if w.strip()]
    unknown = [w for w in names if w not in WINDOWS]
    if unknown:
        parser.error(f"--windows: unknown {unknown}; expected some of {sorted(WINDOWS)}")
    try:
        grid = tuple(sorted(float(c) for c in args.grid.split(",") if c.strip()))
    except ValueError:
        parser.error(f"--grid: {args.grid!r} is not a comma list of numbers")
    if not grid or min(grid) <= 0:
        parser.error("--grid: cold costs must be positive")
    other = json.loads(args.against.read_text()) if args.against else None
    traces = load_settings().traces_dir
    report = {"commit": code_version(), "grid": grid, "windows": {}}
    for window in names:
        out = validate(window, traces, grid, args.warmup_minutes)
        report["windows"][window] = out
        print(f"{window} ({out['trace']}, minutes {out['scored_from_min']:.0f}-{out['minutes'] - 1} scored, "
              f"weighting {out['weighting']}, commit {report['commit']}, {out['seconds']:.0f} s; models mapped by "
              f"{out['mapped_by']})")
        print(f"  {'policy':<18}{'waste %':>9}{'p75 cold %':>12}{'p99 wait s':>12}{'overall cold %':>16}"
              f"{'SLO att.':>10}")
        for name, row in out["rows"].items():
            print(f"  {name:<18}{row['wasted_norm_pct']:>9.1f}{row['cold_pct_p75']:>12.2f}{row['wait_p99_s']:>12.2f}"
                  f"{row['cold_pct_overall']:>16.3f}{row['slo_attainment']:>10.3f}")
        at = out["at_hybrid_waste"]
        print(f"  prewarm at the hybrid's waste ({at['waste_pct']:.1f} %): p75 {fmt(at['cold_pct_p75'], '.2f')} %, "
              f"p99 {fmt(at['wait_p99_s'], '.2f')} s, overall cold {fmt(at['cold_pct_overall'], '.3f')} %, "
              f"SLO attainment {fmt(at['slo_attainment'], '.3f')}; waste at the hybrid's p75 "
              f"{fmt(at['waste_pct_at_hybrid_p75'], '.1f')} %")
        if other is not None and window in other["windows"]:
            print(f"  this run's points (against {other['commit']}'s curve at the same waste; n/a: outside it)")
            for line in against(out, other["windows"][window]):
                print(f"  {line['point']:<18}{line['waste_pct']:>9.1f} %  " + "   ".join(
                    f"{key} {fmt(mine, '.3f')} vs {fmt(theirs, '.3f')}"
                    for key, (mine, theirs) in ((k, line[k]) for k in READINGS)))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=float))
        print(f"figures: {args.json}")


if __name__ == "__main__":
    main()
