"""What the forecast job's default executor costs: shards in one child process (killable at the deadline) vs in process.

With ``shard_workers=1`` and no Dask the forecast job runs its shards in one spawned child process
(:class:`~forecaster.distributed.executor.PoolExecutor` of one worker) so that its deadline can kill a hung shard;
before, they ran in the job's own process (:class:`~forecaster.distributed.executor.InlineExecutor`), where a hung
shard hung the job. This script times both on the same saved model in the same run: a
:class:`~forecaster.forecast.sharded.ShardedEnsemble` of ``--members`` fitted on ``--series`` synthetic series
(shards of ``--shard-max-series``), saved and loaded as the champion is (shards in files, loaded by the worker
once), then ``forecast(panel, [T], --horizon)`` on ``--lookback`` minutes, as the job calls it. Per executor: the
first run (the child's spawn and the shards' load included) and the median of ``--repeats`` runs after it,
alternating between the executors; the extra per run is the shards' history sent to the child and the forecasts
sent back. It also prints the child's resident memory.

    .venv/bin/python bench/forecast_child.py --series 10000 --repeats 9
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from forecaster.distributed.executor import InlineExecutor, PoolExecutor
from forecaster.forecast import registry
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.members import MovingAverage, Naive
from forecaster.forecast.panel import Panel
from forecaster.forecast.sharded import ShardedEnsemble


def _panel(n_series: int, n_steps: int, seed: int = 0) -> Panel:
    rng = np.random.default_rng(seed)
    rates = rng.gamma(0.5, 5.0, size=(n_series, 1))
    values = rng.poisson(rates, size=(n_series, n_steps)).astype(float)
    ids = np.array([f"m{i:06d}" for i in range(n_series)], dtype=object)
    return Panel(ids, pd.Timestamp("2024-01-01", tz="UTC"), pd.Timedelta(minutes=1), values)


def _children_rss_mb() -> float:
    import psutil

    return sum(child.memory_info().rss for child in psutil.Process().children(recursive=True)
               if "resource_tracker" not in " ".join(child.cmdline())) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", type=int, default=10_000)
    parser.add_argument("--shard-max-series", type=int, default=5000)
    parser.add_argument("--lookback", type=int, default=1440)
    parser.add_argument("--horizon", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    panel = _panel(args.series, args.lookback)
    factory = functools.partial(Ensemble, members=[Naive(), MovingAverage(60)], horizon=args.horizon)
    started = time.perf_counter()
    model = ShardedEnsemble(factory, shard_max_series=args.shard_max_series).fit_panel(panel.head(args.lookback - 120))
    print(f"fit: {time.perf_counter() - started:.1f} s, {len(model.shard_ids_)} shards")
    with tempfile.TemporaryDirectory(prefix="prewarm-bench-") as folder:
        version = registry.save_version(model, Path(folder), version_id="v1", train_start=None, train_end=None,
                                        scores={})
        executors = {"inline (before)": InlineExecutor(retries=0, deadline_s=120.0),
                     "child (after)": PoolExecutor(1, retries=0, deadline_s=120.0)}
        loaded = {name: registry.load_ensemble(version) for name in executors}
        first: dict[str, float] = {}
        times: dict[str, list[float]] = {name: [] for name in executors}
        outputs: dict[str, dict] = {}
        try:
            for round_ in range(args.repeats + 1):
                for name, executor in executors.items():
                    loaded[name].executor = executor
                    started = time.perf_counter()
                    outputs[name] = loaded[name].forecast(panel, [panel.n_steps], args.horizon)
                    seconds = time.perf_counter() - started
                    assert not loaded[name].fallback_shards_, loaded[name].fallback_shards_
                    if round_ == 0:
                        first[name] = seconds
                    else:
                        times[name].append(seconds)
            child_rss = _children_rss_mb()
        finally:
            for executor in executors.values():
                executor.close()
    (a, b) = outputs.values()
    assert all(np.array_equal(a[c], b[c], equal_nan=True) for c in a), "the two executors' forecasts differ"
    print(f"{args.series} series x {args.lookback} minutes, horizon {args.horizon}, {args.repeats} runs each "
          f"(after a first run), alternating; forecasts identical")
    for name in executors:
        print(f"  {name:16s} first run {first[name]:6.3f} s   median {statistics.median(times[name]):6.3f} s   "
              f"min {min(times[name]):6.3f}   max {max(times[name]):6.3f}")
    print(f"  the child's resident memory after the runs: {child_rss:.0f} MB (the shards it loaded included)")
    extra = statistics.median(times["child (after)"]) - statistics.median(times["inline (before)"])
    print(f"  extra per run: {extra * 1000:+.0f} ms (median); first run: "
          f"{first['child (after)'] - first['inline (before)']:+.2f} s")


if __name__ == "__main__":
    main()
