"""Replay the report's history through the fleet simulator: prewarm, the reactive autoscaler and a keep-alive.

*prewarm* is the product as configured (``Settings``: the planner settings of the plan job, its cold cost per
model from the catalogue label ``cold_cost`` or ``PREWARM_PLANNER_COLD_COST``, its waste budget if one is set,
the actuator's guardrails) planning once a minute with the plan step the plan job calls, from the product's
forecaster: the default ensemble (:class:`~forecaster.planning.ensemble_source.EnsembleForecast`), fitted causally
on the history before its first fit minute and, before that minute, the causal empirical source (as every replay
does). *reactive* is Knative's KPA and *keep-alive* a fixed keep-alive of ``keepalive_min`` minutes, the
simulator's own baselines. All three serve the same requests (each minute's count spread uniformly within it,
seed 0) on the same simulated cluster, from ``WARMUP_MIN`` unscored minutes before the window.

Causality: a fit at minute ``r`` sees minutes before ``r`` only, and the forecast at each minute ``o`` conditions
on minutes before ``o`` (:mod:`forecaster.planning.ensemble_source`). By default the ensemble is fitted once (on
up to ``history_min`` minutes before the window, or on the window's first ``history_min`` minutes when the store
holds nothing earlier); production retrains nightly, which ``retrain_every_min=1440`` replays at the cost of one
fit per simulated day on a growing window.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from forecaster.contracts.forecast import quantile_column
from forecaster.planning.forecasts import CountPanel
from forecaster.planning.step import planner_settings, waste_budget
from forecaster.report.history import History
from forecaster.settings import Settings
from forecaster.simulation.engine import FleetSimulator, SimResult
from forecaster.simulation.policies import KeepAlivePolicy, KnativePolicy, PlannerPolicy
from forecaster.simulation.runner import ForecastSources, LatencyInput, summary_table
from forecaster.simulation.workload import Workload

log = logging.getLogger(__name__)

#: unscored minutes every policy serves before the window, so that none starts scoring from an empty cluster
WARMUP_MIN = 10
#: the forecast the report draws against the actual counts: the one the planner got this many minutes ahead
FORECAST_AHEAD_MIN = 5
#: the levels the report keeps of each forecast (median and the 80 % band)
SHOWN_LEVELS = (0.1, 0.5, 0.9)
#: niceness of the baselines' processes in a parallel replay: their results wait until prewarm's replay ends, while
#: the ensemble's fit and prewarm's replay after it are the report's critical path, so on a busy machine the
#: baselines take the cores those two leave idle (same numbers either way; docs/report.md, Speed)
BASELINES_NICE = 19


class RecordingSource:
    """The planner's forecast source, unchanged, keeping per target minute the forecast issued ``ahead_min``
    minutes before it (its levels :data:`SHOWN_LEVELS`), and which source answered (ensemble or empirical)."""

    def __init__(self, source, panel: CountPanel, ahead_min: int = FORECAST_AHEAD_MIN) -> None:
        self.source = source
        self.panel = panel
        self.ahead_min = ahead_min
        n, t = panel.counts.shape
        self.values = {level: np.full((n, t), np.nan, dtype=np.float32) for level in SHOWN_LEVELS}
        self.by_ensemble = np.zeros(t, dtype=bool)
        self.recorded = np.zeros(t, dtype=bool)

    def __getattr__(self, name):  # retrains, report() ... of the wrapped source
        return getattr(self.source, name)

    def quantiles(self, now, horizon_min: int) -> pd.DataFrame:
        frame = self.source.quantiles(now, horizon_min)
        k = self.ahead_min - 1
        col = self.panel.minute_index(now)
        target = col + k
        n = len(self.panel.ids)
        if k < horizon_min and 0 <= target < self.panel.n_minutes and len(frame) == n * horizon_min:
            for level in SHOWN_LEVELS:
                self.values[level][:, target] = frame[quantile_column(level)].to_numpy(
                    dtype="float64").reshape(n, horizon_min)[:, k]
            fit_minute = getattr(self.source, "fit_minute", None)
            self.by_ensemble[target] = fit_minute is not None and fit_minute(col) is not None
            self.recorded[target] = True
        return frame


class CataloguePlanner(PlannerPolicy):
    """:class:`PlannerPolicy` with the plan job's cold cost per model (catalogue label, else the setting)."""

    def __init__(self, *args, cold_costs: np.ndarray, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cold_costs = np.asarray(cold_costs, dtype="float64")

    def model_frame(self, view) -> pd.DataFrame:
        frame = super().model_frame(view)
        frame["cold_cost"] = self.cold_costs
        return frame


@dataclass
class Replay:
    """What the three replays measured, and the forecasts prewarm planned with."""

    history: History
    results: dict[str, SimResult]
    table: dict[str, dict]
    forecasts: RecordingSource
    workload_start_col: int
    keepalive: str
    stage_seconds: dict[str, float] = field(default_factory=dict)
    fit_minute: int | None = None


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the enclosed code with the BLAS libraries (numpy's and scipy's OpenBLAS) on one thread each.

    The report already keeps the cores busy with its own processes (prewarm's replay, the forecasting process, the
    baselines), so a BLAS call that starts a second thread only makes threads wait on each other: OpenBLAS's
    threads spin while they wait, and on 2 shared cores ARIMA's statsmodels fits (small matrix products in every
    Kalman filter step) took 24 CPU seconds for 8 series with the default 2 threads against 1.9 s with one, same
    parameters, and a 2-day report of 40 models 354 CPU seconds in all its processes against 659 s, with the same
    numbers bit for bit (``bench/report_digest.py``; docs/report.md, Speed).
    """
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _first_fit(since_col: int, history_min: int, min_train_min: int) -> int:
    """Column of the ensemble's first fit: the window's start when the store holds at least the ensemble's minimum
    history before it, else ``history_min`` minutes into the data (the window's first minutes then plan from the
    causal empirical source)."""
    return since_col if since_col >= min_train_min else max(since_col, history_min)


def _baseline_policies(keepalive_min: int) -> dict[str, object]:
    """The baselines by report name: Knative's KPA and the fixed keep-alive."""
    return {"reactive": KnativePolicy(), f"keepalive_{keepalive_min}": KeepAlivePolicy(keepalive_min)}


def _baseline(workload: Workload, models: pd.DataFrame, config, policy) -> tuple[SimResult, float]:
    """One baseline's replay, and its seconds."""
    started = time.perf_counter()
    result = FleetSimulator(workload, models, policy, config, record_minutes=True).run()
    return result, time.perf_counter() - started


class BlockStream:
    """The ensemble's fits and forecasts in a process of their own, each block sent to this one as soon as it is made.

    The child runs :meth:`EnsembleForecast.precompute` on its copy of ``ensemble`` (same panel, same schedule) and
    sends every block through a pipe; this process's ``ensemble`` then serves blocks from the pipe
    (:meth:`EnsembleForecast.receive_blocks`), waiting where the replay is ahead of the forecasts, so its numbers are
    those it would have computed itself. A failure in the child is raised here with the child's traceback; a child
    that dies (killed for memory, say) is a clear error, never a hang.

    The child is *spawned* (a fresh interpreter), not forked: a process that has already trained or predicted with
    LightGBM, XGBoost or torch holds their OpenMP thread pools, and a forked child that uses them again can wait
    forever on a lock one of those threads held at the fork (seen in the test suite, where earlier tests train in the
    same process). Spawning costs the child's imports, a few seconds against minutes of fitting.
    """

    def __init__(self, ensemble, context=None) -> None:
        context = context or multiprocessing.get_context("spawn")
        self.ensemble = ensemble
        self.waited_s = 0.0
        self.child_s: float | None = None
        self._done = False
        self._conn, child_end = context.Pipe(duplex=False)
        self._process = context.Process(target=_forecast_blocks, args=(ensemble, child_end), daemon=True)
        self._process.start()
        child_end.close()
        ensemble.receive_blocks(self._receive)

    def _receive(self):
        if self._done:
            return None
        started = time.perf_counter()
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise RuntimeError(f"the forecasting process ended without a result (exit code "
                               f"{self._process.exitcode}; killed for memory?)") from None
        finally:
            self.waited_s += time.perf_counter() - started
        kind = message[0]
        if kind == "block":
            return message[1], message[2]
        if kind == "error":
            self._process.join(timeout=5)
            raise RuntimeError(f"the ensemble failed in the forecasting process:\n{message[1]}")
        self._done = True
        self.child_s = message[2]
        self.ensemble.absorb(message[1])
        return None

    def finish(self) -> dict[str, float]:
        """Drain what the child still sends (its counters), join it, and return the stage seconds."""
        while not self._done:
            self._receive()
        self._conn.close()
        self._process.join()
        return {"forecast_s": float(self.child_s or 0.0), "wait_for_forecasts_s": self.waited_s}


def _forecast_blocks(ensemble, conn) -> None:
    """The forecasting child of :class:`BlockStream`: every block in origin order, then the counters."""
    import traceback

    started = time.perf_counter()
    try:
        with one_blas_thread():  # a spawned process: the parent's limit does not carry over
            ensemble.precompute(on_block=lambda first, arrays: conn.send(("block", first, arrays)))
        conn.send(("done", ensemble.counters(), time.perf_counter() - started))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def replay(history: History, settings: Settings, *, keepalive_min: int = 10, history_min: int = 1440,
           retrain_every_min: int | None = None, members=None, parallel: bool | None = None,
           progress: Callable[[str], None] | None = None) -> Replay:
    """Replay prewarm, reactive and keep-alive on ``history`` (see the module docstring).

    Args:
        settings: the product settings (planner, budget, guardrails, ensemble build).
        keepalive_min: minutes of the fixed keep-alive baseline.
        history_min: history the first fit learns from (see :func:`_first_fit`).
        retrain_every_min: minutes between refits (None: fitted once).
        members: ensemble members instead of the product default (tests of the plumbing only; the CLI never sets
            it).
        parallel: replay each baseline in a forked process of its own at the lowest priority
            (:data:`BASELINES_NICE`) and fit (on 2 threads) and forecast in another, streaming the forecasts to
            this one as it replays prewarm (:class:`BlockStream`; default: when the machine has 2 or more cores and
            can fork); the results are the same either way.
        progress: called with a line per stage.

    BLAS runs on one thread in every process of the replay (:func:`one_blas_thread`).
    """
    with one_blas_thread():  # the forked baselines' process inherits it
        return _replay(history, settings, keepalive_min=keepalive_min, history_min=history_min,
                       retrain_every_min=retrain_every_min, members=members, parallel=parallel, progress=progress)


def _replay(history: History, settings: Settings, *, keepalive_min: int, history_min: int,
            retrain_every_min: int | None, members, parallel: bool | None,
            progress: Callable[[str], None] | None) -> Replay:
    """:func:`replay`'s work (see there)."""
    if parallel is None:
        parallel = (os.cpu_count() or 1) >= 2 and "fork" in multiprocessing.get_all_start_methods()
    say = progress or log.info
    stages: dict[str, float] = {}
    n_cols = history.counts.shape[1]
    sim_from = max(0, history.since_col - WARMUP_MIN)
    source_panel = CountPanel(ids=history.ids, start=history.start, counts=history.counts)
    sim_panel = CountPanel(ids=history.ids, start=history.start + pd.Timedelta(minutes=sim_from),
                           counts=history.counts[:, sim_from:])
    workload = Workload.from_counts(sim_panel, spread="uniform", seed=0)
    config = replace(history.fleet, score_from_s=60.0 * (history.since_col - sim_from))
    models = history.models.loc[list(history.ids)]
    min_train = 4 * settings.forecast_horizon_min
    fit_col = _first_fit(history.since_col, history_min, min_train)
    # in parallel the forecasting process fits on 2 threads: this process waits for its first fit once it has
    # replayed the minutes before it, and the baselines' processes yield the cores (BASELINES_NICE)
    fit_settings = settings.model_copy(update={"forecast_fit_threads": max(settings.forecast_fit_threads, 2)}) \
        if parallel else settings
    sources = ForecastSources(source_panel, train_until_min=fit_col,
                              retrain_every_min=retrain_every_min or n_cols + 1, members=members,
                              settings=fit_settings, progress=lambda line: log.debug(line))
    ensemble = sources.get("ensemble")
    keepalive = f"keepalive_{keepalive_min}"
    baselines = forecasts = None
    if ensemble.schedule:
        say(f"fitting the ensemble at minute {fit_col} on {min(fit_col, settings.train_window_min)} minutes before "
            "it, then forecasting every replayed minute" + (" (in a second process)" if parallel else ""))
    if parallel:
        # a child per baseline replays it (they need no forecast; forked: numpy only; at the lowest priority, so
        # that they run on what the critical path leaves, two at once once prewarm's replay is done), one fits and
        # forecasts (spawned, see BlockStream), streaming each block to this process, which meanwhile replays
        # prewarm (the minutes before the first fit need no ensemble, later ones wait for it)
        policies = _baseline_policies(keepalive_min)
        pool = multiprocessing.get_context("fork").Pool(len(policies), initializer=os.nice,
                                                        initargs=(BASELINES_NICE,))
        baselines = {name: pool.apply_async(_baseline, (workload, models, config, policy))
                     for name, policy in policies.items()}
        pool.close()
        if ensemble.schedule:
            forecasts = BlockStream(ensemble)
    elif ensemble.schedule:
        started = time.perf_counter()
        ensemble.precompute()
        stages["forecast_s"] = time.perf_counter() - started
    recording = RecordingSource(ensemble, source_panel)
    product_planner = planner_settings(settings)
    prewarm = CataloguePlanner(recording, LatencyInput(config), product_planner, name="prewarm",
                               cold_cost=settings.planner_cold_cost, product=settings,
                               budget=waste_budget(settings), cold_costs=history.cold_cost)
    started = time.perf_counter()
    say(f"replaying {workload.duration_s / 60:.0f} minutes of {workload.n_models} models under prewarm"
        + (" (reactive and keep-alive in processes of their own)" if parallel else ""))
    results: dict[str, SimResult] = {
        "prewarm": FleetSimulator(workload, models, prewarm, config, record_minutes=True).run()}
    stages["simulate_prewarm_s"] = time.perf_counter() - started
    if forecasts is not None:
        stages.update(forecasts.finish())
    started = time.perf_counter()
    if baselines is not None:
        done = {name: pending.get() for name, pending in baselines.items()}
        pool.join()
        stages["wait_for_baselines_s"] = time.perf_counter() - started
    else:
        done = {name: _baseline(workload, models, config, policy)
                for name, policy in _baseline_policies(keepalive_min).items()}
    for name, (result, seconds) in done.items():
        results[name] = result
        stages[f"simulate_{name}_s"] = seconds
    s = prewarm.summaries
    results["prewarm"].extra.update(
        sources.report("ensemble"),
        plans={"plans": len(s), "late": int(sum(x["late"] for x in s)),
               "actions_by_kind": {k: int(sum(x["by_kind"].get(k, 0) for x in s))
                                   for k in ("prepull", "preload", "scale", "release")}},
        guardrail_refusals=prewarm.actuation.report().get("guardrail_refusals", {}) if prewarm.actuation else {})
    table = summary_table(results, baseline=keepalive)
    for name, result in results.items():
        table[name]["cold_requests"] = int(result.cold_requests.sum())
        table[name]["bytes_total"] = float(result.bytes_registry + result.bytes_object_store)
    return Replay(history=history, results=results, table=table, forecasts=recording, workload_start_col=sim_from,
                  keepalive=keepalive, stage_seconds=stages, fit_minute=fit_col if ensemble.schedule else None)
