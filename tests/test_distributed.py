"""Sharded training and forecasting on executors: in-process, a local process pool, and a real Dask cluster.

The Dask tests start a real ``dask.distributed`` LocalCluster (worker processes
with nannies) and kill a worker with SIGKILL while it runs a shard.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

import forecaster.forecast.registry as registry
from forecaster.data import AZURE2019_TOP100, sample_path
from forecaster.distributed.executor import DaskExecutor, InlineExecutor, PoolExecutor, close_executors, executor_for
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.members import MovingAverage, Naive
from forecaster.forecast.panel import Panel
from forecaster.forecast.sharded import ShardedEnsemble, plan_shards, series_levels
from forecaster.ingest.service import ingest_trace_file
from forecaster.jobs.forecasting import forecast_job, retrain_job
from forecaster.settings import Settings
from tests.distributed_members import (HangingEnsemble, PoisonedEnsemble, SlowNaive, SlowNaiveEnds, always_fails,
                                      dies_once, flaky_square, native_threads)
from tests.executor_tasks import behave, timed

DAY_END = datetime(2019, 7, 16, tzinfo=timezone.utc)  # the shipped sample covers 2019-07-15


def _panel(n_series: int = 40, n_steps: int = 400, seed: int = 0) -> Panel:
    rng = np.random.default_rng(seed)
    rates = rng.gamma(0.5, 5.0, size=(n_series, 1))
    values = rng.poisson(rates, size=(n_series, n_steps)).astype(float)
    ids = np.array([f"m{i:03d}" for i in range(n_series)], dtype=object)
    return Panel(ids, pd.Timestamp("2024-01-01", tz="UTC"), pd.Timedelta(minutes=1), values)


def _factory():
    return functools.partial(Ensemble, members=[Naive(), MovingAverage(30)], horizon=15)


@pytest.fixture(autouse=True)
def _no_cached_executors():
    yield
    close_executors()


# ------------------------------------------------------------------ shards


def test_shards_hold_similar_series_and_are_balanced():
    panel = _panel(103)
    plan = plan_shards(panel, 25)
    assert len(plan) == 5 and sorted(len(rows) for rows in plan.values()) == [20, 20, 21, 21, 21]
    assert sorted(np.concatenate(list(plan.values()))) == list(range(103))  # every series exactly once
    level, _ = series_levels(panel.values)
    ranges = [(level[rows].min(), level[rows].max()) for rows in plan.values()]
    assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(ranges, ranges[1:]))  # shards are contiguous in level


def test_one_shard_forecasts_exactly_like_the_plain_ensemble():
    panel = _panel()
    plain = _factory()().fit_panel(panel.head(300)).forecast(panel, [300, 350], 15)
    sharded = ShardedEnsemble(_factory(), shard_max_series=1000).fit_panel(panel.head(300))
    ours = sharded.forecast(panel, [300, 350], 15)
    assert set(ours) == set(plain)
    for column in plain:
        np.testing.assert_allclose(ours[column], plain[column])


def test_many_shards_cover_every_series_and_route_new_ones():
    panel = _panel(40)
    model = ShardedEnsemble(_factory(), shard_max_series=7).fit_panel(panel.head(300))
    assert model.fit_run_["shards"] == 6 and not model.fit_run_["failed_shards"]
    bigger = Panel(np.append(panel.ids, "new-model"), panel.start, panel.step,
                   np.vstack([panel.values, np.full((1, panel.n_steps), 3.0)]))
    arrays = model.forecast(bigger, [350], 15)
    assert arrays["ensemble"].shape == (41, 1, 15) and not np.isnan(arrays["ensemble"]).any()
    assert (arrays["q0.9"] >= arrays["ensemble"]).all()
    # the new series (never trained on) is forecast by its shard's fallback: last value 3
    np.testing.assert_allclose(arrays["ensemble"][-1], 3.0)


def test_saved_sharded_model_loads_shard_files_lazily(tmp_path):
    panel = _panel(30)
    model = ShardedEnsemble(_factory(), shard_max_series=10).fit_panel(panel.head(300))
    expected = model.forecast(panel, [320], 15)["ensemble"]
    folder = registry.save_version(model, tmp_path, version_id="v1", train_start=None, train_end=None, scores={})
    assert sorted(p.name for p in (folder / "shards").iterdir()) == ["s0.pkl", "s1.pkl", "s2.pkl"]
    # the model file refers to its shards instead of containing them
    assert (folder / "ensemble.pkl").stat().st_size < min(p.stat().st_size for p in (folder / "shards").iterdir())
    loaded = registry.load_ensemble(folder)
    assert all(shard is None for shard in loaded.shards_.values())
    np.testing.assert_allclose(loaded.forecast(panel, [320], 15)["ensemble"], expected)
    assert {m["name"] for m in registry.member_report(loaded)} == {"naive", "moving_average_30", "fallback"}


# ------------------------------------------------------------------ executors


@pytest.mark.parametrize("make", [lambda: InlineExecutor(retries=1), lambda: PoolExecutor(2, retries=1)],
                         ids=["inline", "pool"])
def test_a_failing_shard_is_retried_and_never_costs_the_others(make, tmp_path):
    executor = make()
    try:
        run = executor.run(flaky_square, {f"k{i}": (str(tmp_path / f"flaky-{i}") if i % 2 else "", i)
                                          for i in range(6)})
        assert run.results == {f"k{i}": i * i for i in range(6)} and not run.failures
        assert run.summary()["retried_shards"] == ["k1", "k3", "k5"]
        broken = executor.run(always_fails, {"a": (1,), "b": (2,)})
        assert not broken.results and set(broken.failures) == {"a", "b"}
        assert broken.attempts == {"a": 2, "b": 2} and "shard 2 is broken" in broken.failures["b"]
    finally:
        executor.close()


def test_pool_survives_a_worker_process_dying(tmp_path):
    executor = PoolExecutor(2, retries=2)
    try:
        run = executor.run(dies_once, {f"k{i}": (str(tmp_path / "died") if i == 3 else "", i) for i in range(6)})
        # the dead process took its own task and possibly its neighbours'; all are run again
        assert run.results == {f"k{i}": i * i for i in range(6)} and not run.failures
        assert run.attempts["k3"] == 2
    finally:
        executor.close()


def test_a_worker_dying_on_every_attempt_costs_only_its_own_shard():
    """A dead worker breaks the pool and fails every shard it had not finished; those run again each alone, so the
    innocent ones finish (on the old code every retry ran them beside the poison again and lost them again)."""
    executor = PoolExecutor(2, retries=1)
    try:
        run = executor.run(behave, {"poison": ("die", 0), "k1": ("sleep", 1, 1.0), "k2": ("sleep", 2, 1.0)})
    finally:
        executor.close()
    assert run.results == {"k1": 1, "k2": 4}
    assert set(run.failures) == {"poison"} and "died" in run.failures["poison"], run.failures
    assert run.attempts["k1"] == run.attempts["k2"] == 2  # the shared try the death took, then alone


def test_an_exception_that_cannot_be_unpickled_keeps_its_text_and_breaks_nothing():
    """A shard's exception comes back as text: one whose class cannot be rebuilt from its args used to break the
    pool on the way back (every unfinished shard failed with it) and lose its message."""
    executor = PoolExecutor(2, retries=0)
    try:
        run = executor.run(behave, {"bad": ("two-arg", 1), "k2": ("sleep", 2, 1.0)})
    finally:
        executor.close()
    assert run.results == {"k2": 4}
    assert run.failures == {"bad": "TwoArgError: native library failure: shard 1 (simulated)"}
    assert run.attempts == {"bad": 1, "k2": 1}  # the pool did not break: nothing ran twice


def _process_gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` has exited (reaped, or a zombie waiting to be) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _run_in_thread(executor, fn, tasks, join_s: float):
    """``executor.run(fn, tasks)`` on a thread: (the run or None if still running after ``join_s``, seconds)."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("run", executor.run(fn, tasks)), daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(join_s)
    return box.get("run"), time.monotonic() - started, thread


def test_a_hung_shard_is_cut_off_at_the_deadline_and_its_worker_killed(tmp_path):
    marker = tmp_path / "hang"
    marker.touch()
    executor = PoolExecutor(2, retries=2)
    thread = None
    try:
        # both workers started first: the deadline below is the shards', not the spawn's (slow on a loaded box)
        assert executor.run(behave, {"a": ("ok", 1), "b": ("ok", 2)}).results == {"a": 1, "b": 4}
        executor.deadline_s = 3.0
        run, seconds, thread = _run_in_thread(
            executor, behave, {"hung": ("hang", 0, 0.0, str(marker)), "k1": ("ok", 1), "k2": ("ok", 2)}, 40)
        assert run is not None, "the run still waits on the hung shard 40 s later (deadline 3 s)"
    finally:
        marker.unlink(missing_ok=True)  # releases the hung shard wherever it still runs
        if thread is not None:
            thread.join(30)
    try:
        assert seconds < 3.0 + 10
        assert run.results == {"k1": 1, "k2": 4}
        assert set(run.failures) == {"hung"} and "deadline of 3 s" in run.failures["hung"], run.failures
        assert run.timed_out == ["hung"] and run.attempts["hung"] == 1  # no retry after the deadline
        assert _process_gone(int((tmp_path / "hang.pid").read_text())), "the hung worker was left running"
        executor.deadline_s = None
        assert executor.run(behave, {"a": ("ok", 3)}).results == {"a": 9}  # a fresh pool serves the next run
    finally:
        executor.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: every pool is one thread anyway")
def test_pool_workers_share_the_cores_instead_of_each_taking_them_all():
    """Workers x native threads never exceeds the cores: BLAS, OpenMP and torch sized for the machine in every
    worker spin against each other (Dask's nanny caps its workers the same way)."""
    cores = len(os.sched_getaffinity(0))
    executor = PoolExecutor(cores, retries=0)
    try:
        run = executor.run(native_threads, {f"k{i}": (i,) for i in range(cores)})
    finally:
        executor.close()
    assert not run.failures
    for pools in run.results.values():
        assert set(pools) >= {"blas", "openmp", "torch"}
        assert all(n == 1 for threads in pools.values() for n in threads), pools


# ------------------------------------------------------------------ a real Dask cluster


@pytest.fixture(scope="module")
def dask_cluster():
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None, silence_logs=40)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def ingested(engine, settings, now):
    ingest_trace_file(engine, settings, sample_path(AZURE2019_TOP100), now=now, register=True)
    return settings.model_copy(update={"train_window_min": 1440, "forecast_lookback_min": 240,
                                       "retrain_holdout_min": 120, "forecast_horizon_min": 30,
                                       "shard_max_series": 25})


def _forecast_models(engine, issued_at) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(DISTINCT model_id) FROM forecasts WHERE issued_at = :t"),
                            {"t": issued_at}).scalar()


def test_dask_executor_retries_on_a_real_cluster(dask_cluster, tmp_path):
    executor = DaskExecutor(dask_cluster.scheduler_address, retries=1)
    try:
        assert executor.workers == 2
        run = executor.run(flaky_square, {f"k{i}": (str(tmp_path / f"f{i}") if i < 2 else "", i) for i in range(4)})
        assert run.results == {"k0": 0, "k1": 1, "k2": 4, "k3": 9} and run.backend == "dask"
        broken = executor.run(always_fails, {"a": (7,)})
        assert broken.failures and "shard 7 is broken" in broken.failures["a"] and broken.attempts["a"] == 2
    finally:
        executor.close()


def test_dask_collects_results_as_they_finish_and_cancels_a_hung_task_at_the_deadline(dask_cluster, tmp_path):
    marker = tmp_path / "hang"
    marker.touch()
    executor = DaskExecutor(dask_cluster.scheduler_address, retries=2)
    executor.deadline_s = 3.0
    thread = None
    try:
        run, seconds, thread = _run_in_thread(executor, behave, {"hung": ("hang", 0, 0.0, str(marker)),
                                                                 "k1": ("ok", 1)}, 40)
        assert run is not None, "the run still waits on the hung task 40 s later (deadline 3 s)"
    finally:
        marker.unlink(missing_ok=True)  # frees the worker thread the hung task holds (Dask cannot stop it)
        if thread is not None:
            thread.join(30)
        executor.close()
    assert seconds < 3.0 + 10
    assert run.results == {"k1": 1}
    assert set(run.failures) == {"hung"} and "deadline of 3 s" in run.failures["hung"], run.failures
    assert run.timed_out == ["hung"] and run.attempts["hung"] == 1


def test_forecast_tasks_go_before_the_queued_tasks_of_a_retrain_on_dask(dask_cluster, tmp_path):
    """The forecast job's executor submits at a higher Dask priority than the retrain's. Dask queues the tasks of a
    big group (more than twice the cluster's threads, as a forecast of many shards) on the scheduler in order of
    priority, then of submission: at the same priority a forecast waited for every retrain task queued before it."""
    settings = Settings(database_url="postgresql+psycopg://nobody@127.0.0.1:1/none", data_dir=tmp_path / "data",
                        models_dir=tmp_path / "models", dask_scheduler_address=dask_cluster.scheduler_address)
    batch, forecast = executor_for(settings), executor_for(settings, "forecast")
    assert batch is not forecast and forecast.deadline_s == 2.0 * 60
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    box: dict = {}
    retrain = threading.Thread(target=lambda: box.setdefault("run", batch.run(
        timed, {f"b{i}": (str(stamps), f"b{i}", 1.0) for i in range(8)}, name="fit-shard")))
    retrain.start()
    deadline = time.monotonic() + 60
    while len(list(stamps.glob("b*.start"))) < 2 and time.monotonic() < deadline:  # both workers busy
        time.sleep(0.02)
    ours = forecast.run(timed, {f"f{i}": (str(stamps), f"f{i}", 0.0) for i in range(5)}, name="forecast-shard")
    retrain.join(60)
    assert sorted(ours.results) == [f"f{i}" for i in range(5)] and not box["run"].failures

    def stamp(name: str) -> float:
        return float((stamps / name).read_text())

    last_retrain_start = max(stamp(f"b{i}.start") for i in range(8))
    forecast_end = max(stamp(f"f{i}.end") for i in range(5))
    assert forecast_end < last_retrain_start, f"forecast done {forecast_end - last_retrain_start:+.2f} s after " \
                                              "the last retrain task started"


def test_retrain_and_forecast_on_dask_survive_a_killed_worker(engine, ingested, dask_cluster, tmp_path):
    settings = ingested.model_copy(update={"dask_scheduler_address": dask_cluster.scheduler_address})
    markers = tmp_path / "markers"
    markers.mkdir()
    factory = functools.partial(
        ShardedEnsemble,
        functools.partial(Ensemble, members=[SlowNaive(str(markers), 1.5), MovingAverage(60)], horizon=30),
        shard_max_series=25)
    killed: list[int] = []

    def kill_first_worker_seen() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            started = sorted(markers.iterdir(), key=lambda p: p.stat().st_mtime)
            if started:
                pid = int(started[0].name.split("-")[0])
                os.kill(pid, signal.SIGKILL)  # mid-fit: the worker dies with its shard unfinished
                killed.append(pid)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_first_worker_seen)
    killer.start()
    cache = registry.ChampionCache()
    result = retrain_job(engine, settings, DAY_END, cache=cache, ensemble_factory=factory)
    killer.join()
    assert killed, "no shard started on a worker"
    assert result["shards"]["backend"] == "dask" and result["shards"]["shards"] == 4
    assert result["shards"]["failed_shards"] == {}  # the killed worker's shard ran again elsewhere
    assert not any("(fit)" in name for name in result["failures"])
    assert result["promoted"] and result["series"] == 100
    assert sorted(p.name for p in (settings.models_dir / result["version"] / "shards").iterdir()) == [
        "s0.pkl", "s1.pkl", "s2.pkl", "s3.pkl"]

    outcome = forecast_job(engine, settings, DAY_END, cache=cache)
    assert outcome["models"] == 100 and outcome["shards"]["backend"] == "dask"
    assert outcome["shards"]["failed_shards"] == {}
    assert _forecast_models(engine, DAY_END) == 100


def test_a_shard_failing_everywhere_is_reported_and_the_rest_are_kept(engine, ingested, dask_cluster):
    settings = ingested.model_copy(update={"dask_scheduler_address": dask_cluster.scheduler_address,
                                           "shard_retries": 1})
    with engine.connect() as conn:
        victim = conn.execute(text("SELECT id FROM serving_models ORDER BY id LIMIT 1")).scalar()
    factory = functools.partial(
        ShardedEnsemble,
        functools.partial(PoisonedEnsemble, members=[MovingAverage(60)], horizon=30, poison=(victim,)),
        shard_max_series=25)
    cache = registry.ChampionCache()
    result = retrain_job(engine, settings, DAY_END, cache=cache, ensemble_factory=factory)
    failed = result["shards"]["failed_shards"]
    assert len(failed) == 1 and "out of memory" in next(iter(failed.values()))
    assert result["shards"]["shards"] == 4 and result["series"] == 100
    # the failed shard's series fall back to the fallback member; the three others keep their models
    model = registry.load_ensemble(settings.models_dir / result["version"])
    (bad,) = failed
    assert [m.name for m in model_shard(model, bad).members_] == ["fallback"]
    assert all("moving_average_60" in [m.name for m in model_shard(model, k).members_]
               for k in model.shard_ids_ if k != bad)
    forecast_job(engine, settings, DAY_END, cache=cache)
    assert _forecast_models(engine, DAY_END) == 100


def model_shard(model: ShardedEnsemble, key: str) -> Ensemble:
    from forecaster.forecast.sharded import load_shard

    return load_shard(model._shard_ref(key))


def test_forecast_job_returns_at_its_deadline_when_a_shard_worker_hangs(engine, ingested, tmp_path):
    """A hung shard worker used to hang the forecast job for good (and the scheduler then skipped every later
    run); now the job returns at its deadline with the hung shard on its fallback and every model forecast."""
    victim, marker, cache = _hanging_champion(engine, ingested, tmp_path)
    settings = ingested.model_copy(update={"shard_workers": 2, "forecast_interval_s": 4,
                                           "forecast_deadline_intervals": 1.0})
    forecast_job(engine, settings, DAY_END, cache=cache)  # starts the forecast pool and loads the shards there
    issued = DAY_END.replace(second=10)
    out, seconds = _forecast_with_a_hung_shard(engine, settings, issued, cache, marker)
    assert seconds < 4 + 25
    _, champion = cache.get(engine)
    hung = champion.shard_of_[victim]
    assert hung in out["shards"]["failed_shards"] and "deadline" in out["shards"]["failed_shards"][hung]
    assert hung in out["shards"]["timed_out_shards"]
    assert out["models"] == 100 and _forecast_models(engine, issued) == 100  # the hung shard's on its fallback


def test_forecast_job_does_not_queue_behind_a_retrain_on_the_pool(engine, ingested, tmp_path):
    """The retrain and the forecast job used to share one process pool, whose queue is first come first served:
    a forecast started during a retrain waited for the retrain's fits. The forecast job has a pool of its own."""
    cache = registry.ChampionCache()
    quick = functools.partial(ShardedEnsemble, functools.partial(Ensemble, members=[MovingAverage(60)], horizon=30),
                              shard_max_series=25)
    retrain_job(engine, ingested, DAY_END, cache=cache, ensemble_factory=quick)  # the champion, in process
    pool = ingested.model_copy(update={"shard_workers": 2})
    forecast_job(engine, pool, DAY_END, cache=cache)  # starts the forecast pool
    markers = tmp_path / "fits"
    markers.mkdir()
    slow = functools.partial(ShardedEnsemble, functools.partial(
        Ensemble, members=[SlowNaiveEnds(str(markers), 4.0), MovingAverage(60)], horizon=30, refit=False),
        shard_max_series=50)  # two shards: one 4-second fit on each of the two workers
    box: dict = {}
    retrain = threading.Thread(target=lambda: box.setdefault("retrain", retrain_job(
        engine, pool, DAY_END, cache=cache, ensemble_factory=slow)))
    retrain.start()
    try:
        deadline = time.monotonic() + 120
        while not any(not p.name.endswith(".end") for p in markers.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any(markers.iterdir()), "the retrain never started a fit"
        started = time.monotonic()
        out = forecast_job(engine, pool, DAY_END.replace(second=10), cache=cache)
        seconds = time.monotonic() - started
        fits_done = sorted(p.name for p in markers.glob("*.end"))
    finally:
        retrain.join(120)
    assert not fits_done, f"the forecast job ({seconds:.1f} s) waited for the retrain's fits {fits_done}"
    assert out["models"] == 100 and not out["shards"]["failed_shards"]
    assert box["retrain"]["shards"]["shards"] == 2 and not box["retrain"]["shards"]["failed_shards"]


def test_inline_and_pool_retrain_give_the_same_model(engine, ingested):
    """The same code on a local process pool (no Dask) trains the same model as in this process."""
    scores, forecasts = {}, {}
    for workers in (1, 2):
        settings = ingested.model_copy(update={"shard_workers": workers})
        factory = functools.partial(ShardedEnsemble, functools.partial(
            Ensemble, members=[Naive(), MovingAverage(60)], horizon=30), shard_max_series=25)
        cache = registry.ChampionCache()
        result = retrain_job(engine, settings, DAY_END, cache=cache, ensemble_factory=factory)
        assert result["shards"]["backend"] == ("inline" if workers == 1 else "pool")
        assert result["shards"]["shards"] == 4 and not result["shards"]["failed_shards"]
        scores[workers] = result["scores"]["challenger"]
        model = registry.load_ensemble(settings.models_dir / result["version"])
        panel = history_panel(engine)
        forecasts[workers] = model.forecast(panel, [panel.n_steps], 30)["ensemble"]
    assert scores[1] == pytest.approx(scores[2])
    np.testing.assert_allclose(forecasts[1], forecasts[2])


def history_panel(engine) -> Panel:
    from forecaster.jobs.forecasting import history, model_ids

    return history(engine, model_ids(engine), end=DAY_END, minutes=240)


def test_backtest_of_a_sharded_ensemble_scores_every_series(tmp_path):
    from forecaster.forecast.backtest import evaluate, generic_protocol, run_backtest

    panel = _panel(30, 600)
    protocol = generic_protocol(panel.n_steps, 1.0, name="synthetic")
    sharded = ShardedEnsemble(_factory(), shard_max_series=10, executor=PoolExecutor(2))
    try:
        forecasts = run_backtest(sharded, panel, protocol)
    finally:
        sharded.executor.close()
    plain = run_backtest(_factory()(), panel, protocol)
    result = evaluate(panel, protocol, {"sharded": forecasts["ensemble"], "plain": plain["ensemble"]})
    assert forecasts["ensemble"].point.shape == plain["ensemble"].point.shape
    assert forecasts["ensemble"].q90 is not None and not np.isnan(forecasts["ensemble"].point).any()
    summary = result.summary.set_index(["method", "subset"])
    # three shards of ten similar series each score close to one ensemble of all thirty
    assert summary.loc[("sharded", "all"), "wql"] == pytest.approx(summary.loc[("plain", "all"), "wql"], rel=0.2)


# ------------------------------------------------------------------ failures at forecast time


class Switched(Naive):
    """Naive whose forecast raises while ``failing`` (set by the test; in-process executors only)."""

    name = "switched"
    failing = False

    def _forecast(self, panel, origins, h):
        if type(self).failing:
            raise RuntimeError("booster corrupted (simulated)")
        return super()._forecast(panel, origins, h)


def test_a_member_failing_in_every_shard_is_reported_on_every_run_and_warned_once_per_shard(monkeypatch, caplog):
    from forecaster.forecast.ensemble import member_failure_log

    monkeypatch.setattr(member_failure_log, "clock", lambda: 0.0)
    member_failure_log.clear()
    panel = _panel(30)
    monkeypatch.setattr(Switched, "failing", False)
    model = ShardedEnsemble(functools.partial(Ensemble, members=[Switched()], horizon=15),
                            shard_max_series=10).fit_panel(panel.head(300))
    for shard in model.shards_.values():
        shard.weights_[:] = [1.0, 0.0]  # every series relies on the member
    monkeypatch.setattr(Switched, "failing", True)
    caplog.set_level("WARNING")
    for _ in range(2):  # the same shards (held in memory, as a worker caches them) fail again on the next run
        arrays = model.forecast(panel, [320], 15)
        assert not np.isnan(arrays["ensemble"]).any()  # the fallback member forecast them
        assert model.forecast_failures_ == {"switched": {"series": 30, "error": "RuntimeError: booster corrupted "
                                                         "(simulated)", "shards": ["s0", "s1", "s2"]}}
    warnings = sorted(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert len(warnings) == 3 and [w.split(":")[0] for w in warnings] == ["shard s0", "shard s1", "shard s2"]
    assert all("switched failed at forecast time for 10 series" in w for w in warnings)


def test_a_saved_model_whose_shard_file_is_missing_or_cut_short_does_not_load(tmp_path):
    model = ShardedEnsemble(_factory(), shard_max_series=10).fit_panel(_panel(30).head(300))
    folder = registry.save_version(model, tmp_path, version_id="v1", train_start=None, train_end=None, scores={})
    shards = folder / "shards"
    (shards / "s1.pkl").rename(tmp_path / "s1.away")
    with pytest.raises(RuntimeError, match=r"1 of 3 shard files unusable.*s1\.pkl: FileNotFoundError"):
        registry.load_ensemble(folder)
    (tmp_path / "s1.away").rename(shards / "s1.pkl")
    whole = (shards / "s2.pkl").read_bytes()
    (shards / "s2.pkl").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    with pytest.raises(RuntimeError, match=rf"s2\.pkl: {len(whole) // 2} bytes, saved as {len(whole)}"):
        registry.load_ensemble(folder)
    (shards / "s2.pkl").write_bytes(whole)
    assert registry.load_ensemble(folder).shard_files_ == {k: f"shards/{k}.pkl" for k in ("s0", "s1", "s2")}


def test_a_shard_failing_at_forecast_time_keeps_its_fallback_for_an_hour(tmp_path, monkeypatch):
    panel = _panel(30)
    model = ShardedEnsemble(_factory(), shard_max_series=10).fit_panel(panel.head(300))
    folder = registry.save_version(model, tmp_path, version_id="v1", train_start=None, train_end=None, scores={})
    loaded = registry.load_ensemble(folder)
    loaded.executor = InlineExecutor(retries=0)
    (folder / "shards" / "s1.pkl").write_bytes(b"\x80\x05damaged")  # damaged after the version was accepted
    fits = []
    original = Ensemble.fit_panel

    def counted(self, sub):
        if self.members == []:  # a fallback-only ensemble
            fits.append(sub.n_series)
        return original(self, sub)

    monkeypatch.setattr(Ensemble, "fit_panel", counted)
    for minute in (0, 1, 59):  # a run every minute: one fallback fit, kept
        arrays = loaded.forecast(panel, [300 + minute], 15)
        assert not np.isnan(arrays["ensemble"]).any()
    assert fits == [10]
    loaded.forecast(panel, [360], 15)  # an hour after its fit: refitted on the newer history
    assert fits == [10, 10]
    rows = loaded._route(panel)["s1"]
    assert set(loaded.fallback_shards_) == {"s1"} and loaded.fallback_shards_["s1"]["series"] == 10
    assert np.flatnonzero(loaded.fallback_rows_).tolist() == rows.tolist()
    assert "fallbacks_" not in loaded.__getstate__()  # not part of the saved model


def _worker_processes() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(child.cmdline())}


def test_the_retrains_pool_ends_with_it_and_the_forecast_pool_stays(engine, ingested):
    """The retrain's batch pool (whose workers load the champion's shards for the holdout forecast, as the forecast
    pool's do) used to be cached for the process lifetime: two pools of workers each holding the champion. Now the
    retrain runs on a pool of its own that is closed when it ends; the forecast job's pool stays."""
    from forecaster.distributed import executor as executor_module

    cache = registry.ChampionCache()
    quick = functools.partial(ShardedEnsemble, functools.partial(Ensemble, members=[MovingAverage(60)], horizon=30),
                              shard_max_series=50)
    retrain_job(engine, ingested, DAY_END, cache=cache, ensemble_factory=quick)  # the champion, in process
    pool = ingested.model_copy(update={"shard_workers": 2})
    others = _worker_processes()
    forecast_job(engine, pool, DAY_END, cache=cache)  # starts the forecast pool, which loads the champion's shards
    forecast_workers = _worker_processes() - others
    assert len(forecast_workers) == 2
    result = retrain_job(engine, pool, DAY_END.replace(minute=1), cache=cache, ensemble_factory=quick)
    assert result["shards"]["backend"] == "pool" and "champion" in result["scores"]  # the holdout ran on its pool
    deadline = time.monotonic() + 30
    while (_worker_processes() - others) != forecast_workers and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _worker_processes() - others == forecast_workers  # the retrain's workers are gone, the forecast's stay
    assert [key[:2] for key in executor_module._cache] == [("pool", "forecast")]
    assert forecast_job(engine, pool, DAY_END.replace(minute=2), cache=cache)["models"] == 100


def test_forecast_job_returns_at_its_deadline_with_the_default_settings(engine, ingested, tmp_path):
    """With the default ``shard_workers=1`` the forecast job's shards used to run in the job's own process, where
    nothing can stop a hung one: the deadline did nothing and one shard stuck in a native call hung the job (and,
    through the scheduler's one-instance rule, every later run) for good. The default now runs them in one child
    process, killed at the deadline like a pool's workers."""
    assert ingested.shard_workers == 1 and ingested.dask_scheduler_address is None  # the product's defaults
    victim, marker, cache = _hanging_champion(engine, ingested, tmp_path)
    settings = ingested.model_copy(update={"forecast_interval_s": 4, "forecast_deadline_intervals": 1.0})
    executor = executor_for(settings, "forecast")
    others = _worker_processes()
    executor.deadline_s = None  # the deadline below is the hung shard's, not the spawn's (slow on a loaded box)
    first = forecast_job(engine, settings, DAY_END, cache=cache)  # starts the forecast job's worker, loads the shards
    executor.deadline_s = 4.0
    assert first["models"] == 100 and not first["shards"]["failed_shards"]
    worker = _worker_processes() - others
    issued = DAY_END.replace(second=10)
    out, seconds = _forecast_with_a_hung_shard(engine, settings, issued, cache, marker)
    assert seconds < 4 + 25
    _, champion = cache.get(engine)
    hung = champion.shard_of_[victim]
    assert out["shards"]["backend"] == "pool" and out["shards"]["workers"] == 1
    assert hung in out["shards"]["timed_out_shards"] and "deadline" in out["shards"]["failed_shards"][hung]
    assert out["models"] == 100 and _forecast_models(engine, issued) == 100  # the hung shard's on its fallback
    assert len(worker) == 1 and all(_process_gone(pid) for pid in worker), "the hung worker was left running"
    executor.deadline_s = None
    after = forecast_job(engine, settings, DAY_END.replace(minute=1), cache=cache)  # a fresh worker serves the next
    assert after["models"] == 100 and not after["shards"]["failed_shards"]
    assert _worker_processes() - others and not (_worker_processes() & worker)


def test_the_forecast_jobs_default_executor_can_be_stopped_at_its_deadline(tmp_path):
    """With ``shard_workers=1`` the retrain and backtests run in process, the forecast job on one worker process
    (a pool of one, which the deadline can kill); in process only when asked for."""
    settings = Settings(database_url="postgresql+psycopg://nobody@127.0.0.1:1/none", data_dir=tmp_path / "data",
                        models_dir=tmp_path / "models")
    assert settings.shard_workers == 1 and not settings.forecast_in_process
    forecast = executor_for(settings, "forecast")
    assert isinstance(forecast, PoolExecutor) and forecast.workers == 1 and forecast.deadline_s == 2.0 * 60
    assert forecast.niceness == 0
    assert isinstance(executor_for(settings), InlineExecutor) and executor_for(settings).deadline_s is None
    in_process = executor_for(settings.model_copy(update={"forecast_in_process": True}), "forecast")
    assert isinstance(in_process, InlineExecutor) and in_process.deadline_s == 2.0 * 60


def _forecast_with_a_hung_shard(engine, settings, issued, cache, marker) -> tuple[dict, float]:
    """Run the forecast job at ``issued`` in a thread with the ``marker`` that hangs one shard in place; its summary
    and wall seconds (the test fails when it has not returned 60 s later)."""
    marker.touch()
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("out", forecast_job(engine, settings, issued, cache=cache)),
                           daemon=True)
    started = time.monotonic()
    job.start()
    try:
        job.join(60)
        seconds = time.monotonic() - started
        assert "out" in box, "the forecast job still waits on the hung shard 60 s later (deadline 4 s)"
    finally:
        marker.unlink(missing_ok=True)  # releases the hung shard wherever it still runs
        job.join(60)
    return box["out"], seconds


def _hanging_champion(engine, ingested, tmp_path) -> tuple[str, object, registry.ChampionCache]:
    """A sharded champion (retrained in process, no hang yet) whose shard holding the first model hangs while the
    returned marker file exists; ``(that model, the marker, the cache holding the champion)``."""
    with engine.connect() as conn:
        victim = conn.execute(text("SELECT id FROM serving_models ORDER BY id LIMIT 1")).scalar()
    marker = tmp_path / "hang"
    factory = functools.partial(ShardedEnsemble, functools.partial(
        HangingEnsemble, members=[MovingAverage(60)], horizon=30, marker=str(marker), poison=(victim,)),
        shard_max_series=25)
    cache = registry.ChampionCache()
    retrain_job(engine, ingested, DAY_END, cache=cache, ensemble_factory=factory)
    return victim, marker, cache
