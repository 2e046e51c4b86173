"""One forecast job task in process: a 5,000-series shard of the production ensemble, timed stage by stage.

The per-minute forecast job (:func:`forecaster.jobs.forecasting.forecast_job`) hands each Dask worker shards of
at most ``shard_max_series`` (5,000) series; a worker calls
:func:`forecaster.forecast.sharded.forecast_shard`, i.e. ``Ensemble.forecast(panel, [T], 60)`` on the shard's
last day of per-minute counts (``forecast_lookback_min`` = 1,440 minutes, origin at its end, horizons 1..60).
This script does exactly that work in one process, without the store and without Dask, so that a change to the
forecast path can be timed and checked quickly:

* ``train``: the production ensemble (:class:`~forecaster.forecast.ensemble.Ensemble` with
  :func:`~forecaster.forecast.ensemble.default_members` (60) plus the fallback, the quantile heads and the
  ``p_any`` model; the factory of :func:`~forecaster.forecast.sharded.production_model`) fitted as the nightly
  retrain fits a shard: on one day of ``--series`` fleetgen series (:mod:`forecaster.simulation.fleetgen`, seed
  ``--seed``, what ``bench/scale.py`` ingests) less the retrain's 120-minute holdout (1,320 minutes). The fitted
  ensemble and the day (``(N, 1440)`` counts) are pickled to ``--model`` once (18 minutes on the shared 2-core
  machine at load 3-5; 222 MB).
* ``time``: loads them and runs ``forecast_shard`` ``--repeats`` times after one untimed warm-up (the job keeps
  a loaded shard in each worker), printing the task's seconds and the stages inside it: each member's and head's
  forecast (the ensemble's own ``forecast_seconds_``), the tree members' feature building and model predictions,
  the ``p_any`` model's pieces (the idle-time hazard and its pooled table, the stack), the residual ``p_any``,
  and the rest of ``Ensemble.forecast`` (weights, combination, quantile assembly) as the remainder. With
  ``--save`` the output arrays go to an ``.npz`` file; with ``--profile`` one more run goes under cProfile.
* ``compare``: ``time`` in child processes with a Dask worker's environment (:data:`WORKER_ENVIRON`),
  alternating between code trees (``--code DIR``, one per tree, e.g. a ``git archive`` of the commit before a
  change and the working tree), ``--rounds`` times; prints each tree's
  median task seconds and stages with the load average, and checks that every tree's output arrays equal the
  first tree's (bit for bit, else the largest absolute difference per column).

    nice -n 5 .venv/bin/python bench/forecast_shard.py train --model /tmp/shard.pkl
    nice -n 5 .venv/bin/python bench/forecast_shard.py compare --model /tmp/shard.pkl --code /tmp/before --code .

Stage timers wrap functions by name and skip the ones a code tree does not have, so that one script times trees
from before and after a change. Nested stages are inside their parents (``p_any`` holds the hazard, the hazard
its pool); ``ensemble rest`` is the task's seconds minus the members, heads, ``p_any`` and residual ``p_any``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import io
import json
import os
import pickle
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HORIZON = 60
DAY_MIN = 1440
HOLDOUT_MIN = 120  # Settings.retrain_holdout_min: the retrain fits on the day less this tail
#: What a Dask worker's nanny sets before it starts the worker (distributed's ``pre-spawn-environ`` defaults):
#: glibc then trims freed memory eagerly and serves every large array from fresh pages, which makes large
#: temporary arrays cost page faults, and numpy's BLAS runs one thread. ``compare`` sets them in its children.
WORKER_ENVIRON = {"MALLOC_TRIM_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                  "OPENBLAS_NUM_THREADS": "1"}


def _code_path() -> None:
    """Put ``--code DIR`` (child processes) or this checkout first on ``sys.path``."""
    code = os.environ.get("FORECAST_SHARD_CODE") or str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, code)


# ------------------------------------------------------------------ train


def train(model_path: Path, series: int, seed: int) -> None:
    """Fit the production ensemble on ``series`` fleetgen series and pickle it with the day it forecasts."""
    from forecaster.contracts.forecast import FORECAST_LEVELS
    from forecaster.forecast.ensemble import Ensemble
    from forecaster.forecast.panel import Panel
    from forecaster.simulation.fleetgen import generate_fleet

    chunks = list(generate_fleet(series, seed=seed, minutes=DAY_MIN, chunk_models=series))
    ids = np.concatenate([c.ids for c in chunks])
    counts = np.concatenate([c.counts for c in chunks]).astype(np.float64)
    panel = Panel.from_wide(ids, counts, start=chunks[0].start, step="1min")
    started = time.perf_counter()
    ensemble = Ensemble(horizon=HORIZON, quantiles=FORECAST_LEVELS, progress=lambda line: print(
        f"[{time.perf_counter() - started:7.1f} s] {line}", flush=True))
    ensemble.fit_panel(panel.head(DAY_MIN - HOLDOUT_MIN))
    ensemble.progress = None
    share = {m.name: round(float((ensemble.weights_.argmax(axis=1) == j).mean()), 4)
             for j, m in enumerate(ensemble.members_)}
    print(f"fitted in {time.perf_counter() - started:.0f} s; share of series where each member weighs most {share}; "
          f"heads on {ensemble.head_series_.mean():.3f} of the series; failures {ensemble.failures_}", flush=True)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    with open(model_path, "wb") as handle:
        pickle.dump({"ensemble": ensemble, "ids": panel.ids, "start": panel.start, "values": panel.values,
                     "series": series, "seed": seed}, handle, protocol=pickle.HIGHEST_PROTOCOL)


# ------------------------------------------------------------------ stage timers

#: (module, attribute path, stage label); ``{name}`` in a label is the ``name`` of the method's ``self``.
TIMED = (
    ("forecaster.forecast.trees", "GlobalTreeMember._predict", "{name}: model predict"),
    ("forecaster.forecast.trees", "build_features", "tree features"),
    ("forecaster.forecast.trees", "SeriesWindows.__init__", "tree features' running sums"),
    ("forecaster.forecast.p_any", "PAnyModel.predict", "p_any model"),
    ("forecaster.forecast.p_any", "PAnyModel.estimates", "p_any model > estimates"),
    ("forecaster.forecast.hazard", "IdleTimeHazard.p_any_state", "p_any model > estimates > hazard"),
    ("forecaster.forecast.hazard", "WindowPool.__init__", "p_any model > estimates > hazard > running counts"),
    ("forecaster.forecast.hazard", "WindowPool.counts", "p_any model > estimates > hazard > pool counts"),
    ("forecaster.forecast.hazard", "WindowPool.idle_state", "p_any model > estimates > hazard > idle times"),
    ("forecaster.forecast.hazard", "renewal_p_any", "p_any model > estimates > hazard > renewal"),
    ("forecaster.forecast.p_any", "PAnyModel.design", "p_any model > design"),
    ("forecaster.forecast.p_any", "SegmentedStack.predict", "p_any model > stack predict"),
    ("forecaster.forecast.ensemble", "residual_p_any", "residual p_any"),
    ("forecaster.forecast.ensemble", "Ensemble._head_bound", "head bounds (incl. head forecasts)"),
    ("forecaster.forecast.ensemble", "poisson_quantile", "poisson quantiles"),
)


def _install_timers(seconds: dict[str, float]) -> None:
    """Wrap the :data:`TIMED` functions so that each call adds its wall seconds to ``seconds[label]``."""
    for module_name, path, label in TIMED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner, _, attribute = path.rpartition(".")
        holder = getattr(module, owner, None) if owner else module
        function = getattr(holder, attribute, None) if holder is not None else None
        if function is None:
            continue

        def timed(*args, _function=function, _label=label, **kwargs):
            name = _label.format(name=getattr(args[0], "name", "?")) if "{name}" in _label else _label
            started = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - started

        setattr(holder, attribute, functools.wraps(function)(timed))


def _one_run(ensemble, panel, seconds: dict[str, float]) -> tuple[float, dict[str, float], dict]:
    """One ``forecast_shard`` call: its seconds, the stage seconds, and the output arrays."""
    from forecaster.forecast.sharded import forecast_shard

    seconds.clear()
    # a Dask worker runs its tasks in a thread of its own (glibc then serves them from a thread arena)
    with ThreadPoolExecutor(1) as worker_thread:
        arrays, failures, task_s = worker_thread.submit(
            forecast_shard, ensemble, panel, [panel.n_steps], HORIZON).result()
    if failures:
        raise RuntimeError(f"members failed: {failures}")
    # a quantile head's forecast (named <member>_q<level>) runs inside the head bounds
    stages = {f"{'head' if '_q' in k else 'member'} {k}": v for k, v in ensemble.forecast_seconds_.items()}
    stages |= dict(seconds)
    inner = sum(v for k, v in stages.items() if k.startswith("member ")) + sum(
        seconds.get(k, 0.0) for k in ("p_any model", "residual p_any", "head bounds (incl. head forecasts)"))
    stages["ensemble rest (weights, combination, quantiles)"] = task_s - inner
    return task_s, stages, arrays


def _rss_mb() -> float:
    """Resident memory of this process now, MB (what it holds between tasks)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def time_runs(model_path: Path, repeats: int, save: Path | None, profile: Path | None, quiet: bool) -> dict:
    """Load the pickled shard and time ``repeats`` forecasts after a warm-up; returns the figures."""
    from forecaster.forecast.panel import Panel

    with open(model_path, "rb") as handle:
        saved = pickle.load(handle)
    ensemble = saved["ensemble"]
    import pandas as pd

    panel = Panel(saved["ids"], saved["start"], pd.Timedelta(minutes=1), saved["values"])
    seconds: dict[str, float] = defaultdict(float)
    _install_timers(seconds)
    _one_run(ensemble, panel, seconds)  # warm-up: imports, first-touch allocations
    runs = []
    arrays = None
    for _ in range(repeats):
        task_s, stages, arrays = _one_run(ensemble, panel, seconds)
        runs.append({"task_s": task_s, "stages": stages, "load_1min": os.getloadavg()[0],
                     "rss_mb": _rss_mb(), "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
        if not quiet:
            print(f"task {task_s:.3f} s (load {runs[-1]['load_1min']:.2f})", flush=True)
    if save is not None:
        np.savez(save, **arrays)
    if profile is not None:
        from forecaster.forecast.sharded import forecast_shard

        profiler = cProfile.Profile()
        profiler.runcall(forecast_shard, ensemble, panel, [panel.n_steps], HORIZON)
        profiler.dump_stats(str(profile))
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())
    return {"series": panel.n_series, "runs": runs}


def summarise(runs: list[dict]) -> tuple[float, dict[str, float]]:
    """Median task seconds and median seconds per stage over ``runs``."""
    labels = sorted({k for r in runs for k in r["stages"]})
    return (statistics.median(r["task_s"] for r in runs),
            {k: statistics.median(r["stages"].get(k, 0.0) for r in runs) for k in labels})


def print_table(columns: dict[str, list[dict]]) -> None:
    """Median task and stage seconds, one column per code tree."""
    summaries = {name: summarise(runs) for name, runs in columns.items()}
    labels = sorted({k for _, stages in summaries.values() for k in stages})
    width = max(len(k) for k in labels) + 2
    print("stage".ljust(width) + "".join(f"{name[-28:]:>30}" for name in columns))
    print("task (forecast_shard)".ljust(width) + "".join(f"{s[0]:>30.3f}" for s in summaries.values()))
    for label in labels:
        print(label.ljust(width) + "".join(f"{s[1].get(label, 0.0):>30.3f}" for s in summaries.values()))
    for name, runs in columns.items():
        tasks = ", ".join(f"{r['task_s']:.2f}" for r in runs)
        loads = [r["load_1min"] for r in runs]
        memory = (f"; RSS after a task {statistics.median(r['rss_mb'] for r in runs):.0f} MB, peak "
                  f"{max(r['max_rss_mb'] for r in runs):.0f} MB" if "rss_mb" in runs[0] else "")
        print(f"{name}: {len(runs)} runs, task s {tasks}; load average {min(loads):.2f}..{max(loads):.2f}{memory}")


def compare_outputs(reference: Path, other: Path) -> dict[str, str]:
    """Per output column: ``identical`` or the largest absolute difference (and NaN pattern changes)."""
    a, b = np.load(reference), np.load(other)
    report = {}
    for column in sorted(set(a.files) | set(b.files)):
        if column not in a.files or column not in b.files:
            report[column] = "missing in one tree"
            continue
        x, y = a[column], b[column]
        if x.shape != y.shape:
            report[column] = f"shape {x.shape} vs {y.shape}"
        elif np.array_equal(x, y, equal_nan=True):
            report[column] = "identical"
        else:
            nan = int((np.isnan(x) != np.isnan(y)).sum())
            diff = np.nanmax(np.abs(x - y))
            report[column] = f"max |diff| {diff:.3g}, {int((x != y).sum())} cells differ, NaN pattern {nan}"
    return report


def compare(model_path: Path, codes: list[str], rounds: int, repeats: int, worker_environ: bool = True) -> None:
    """Alternate child processes over the code trees; print medians, loads and the output check."""
    columns: dict[str, list[dict]] = {code: [] for code in codes}
    with tempfile.TemporaryDirectory(prefix="forecast-shard-") as tmp:
        outputs = {code: Path(tmp) / f"out{k}.npz" for k, code in enumerate(codes)}
        for r in range(rounds):
            for code in (codes if r % 2 == 0 else codes[::-1]):  # alternate which tree goes first
                result_file = Path(tmp) / "result.json"
                tree = str(Path(code).resolve())
                env = dict(os.environ, **(WORKER_ENVIRON if worker_environ else {}), FORECAST_SHARD_CODE=tree,
                           PYTHONPATH=tree)
                subprocess.run([sys.executable, __file__, "time", "--model", str(model_path), "--repeats",
                                str(repeats), "--json", str(result_file), "--quiet"]
                               + (["--save", str(outputs[code])] if r == 0 else []), env=env, check=True)
                runs = json.loads(result_file.read_text())["runs"]
                columns[code] += runs
                print(f"round {r + 1}: {code}: task s " + ", ".join(f"{x['task_s']:.2f}" for x in runs)
                      + f" (load {runs[-1]['load_1min']:.2f})", flush=True)
        print_table(columns)
        for code in codes[1:]:
            print(f"outputs of {code} against {codes[0]}:")
            for column, verdict in compare_outputs(outputs[codes[0]], outputs[code]).items():
                print(f"  {column}: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("train", "time", "compare"))
    parser.add_argument("--model", type=Path, required=True, help="pickle of the fitted shard and its day")
    parser.add_argument("--series", type=int, default=5000, help="train: series in the shard")
    parser.add_argument("--seed", type=int, default=0, help="train: fleetgen seed")
    parser.add_argument("--repeats", type=int, default=5, help="time: timed forecasts after the warm-up")
    parser.add_argument("--save", type=Path, help="time: write the output arrays here (.npz)")
    parser.add_argument("--profile", type=Path, help="time: one more run under cProfile, stats to this file")
    parser.add_argument("--json", type=Path, help="time: write the figures here")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--code", action="append", help="compare: a code tree (repeat; the first is the reference)")
    parser.add_argument("--rounds", type=int, default=3, help="compare: child processes per tree, alternating")
    parser.add_argument("--inherit-environ", action="store_true",
                        help="compare: children keep this environment instead of a Dask worker's")
    args = parser.parse_args()
    _code_path()
    if args.mode == "train":
        train(args.model, args.series, args.seed)
    elif args.mode == "time":
        figures = time_runs(args.model, args.repeats, args.save, args.profile, args.quiet)
        if args.json:
            args.json.write_text(json.dumps(figures))
        if not args.quiet:
            print_table({os.environ.get("FORECAST_SHARD_CODE", "this tree"): figures["runs"]})
    else:
        if not args.code:
            parser.error("compare needs at least one --code DIR")
        compare(args.model, args.code, args.rounds, args.repeats, worker_environ=not args.inherit_environ)


if __name__ == "__main__":
    main()
