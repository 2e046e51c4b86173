"""The next hour's latency table built ahead of the hour: the plan job's prefetch, the service's single-flight
cache (one build per key, no lock held while computing) and its eviction (the table in use is kept).

Real store and real latency model (the physics prior: nothing trained, so the peak hours 13-21 UTC make hour 13's
table differ from hour 12's); a failing or slow build is the real build wrapped, never a stand-in."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

from forecaster.coldstart import service
from forecaster.coldstart.model import ColdStartModel
from forecaster.coldstart.service import (
    latency_table,
    latency_table_stats,
    prefetch_latency_table,
    prefetch_next_hour,
    wait_for_prefetches,
)
from forecaster.jobs.planning import fleet_from_store, plan_job
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecasts import write_forecasts

UTC = timezone.utc
FORECAST_FROM = datetime(2026, 11, 29, 12, 50, tzinfo=UTC)
WAIT_S = 60.0


def _setup(engine) -> None:
    """Two models, three nodes, one forecast run from 12:50 for an hour (so plans at 12:5x and 13:0x have one)."""
    with engine.begin() as conn:
        upsert_models(conn, [
            ServingModelSpec(id="llama", image_ref="vllm/vllm-openai:v0.5.4", image_size_bytes=9 * 10**9,
                             weights_uri="s3://models/llama", weights_size_bytes=16 * 10**9, replica_rps=2.0),
            ServingModelSpec(id="qwen", image_ref="vllm/vllm-openai:v0.5.4", image_size_bytes=9 * 10**9,
                             weights_uri="s3://models/qwen", weights_size_bytes=4 * 10**9, replica_rps=2.0),
        ])
        for i in range(3):
            conn.execute(text("INSERT INTO nodes (id, gpus_total, gpus_free, disk_free_bytes, "
                              "host_memory_free_bytes) VALUES (:n, 8, 8, 2e12, 5e11)"), {"n": f"gpu-{i}"})
    minutes = pd.date_range(FORECAST_FROM, periods=60, freq="min")
    busy = [300.0] * 60
    frame = pd.concat([pd.DataFrame({"unique_id": m, "ds": minutes, "point": busy, "p_any": 1.0, "q0.1": busy,
                                     "q0.5": busy, "q0.9": [v * 1.2 for v in busy]}) for m in ("llama", "qwen")])
    write_forecasts(engine, frame, issued_at=FORECAST_FROM - timedelta(seconds=20), model_version_id=None)


def _at(minute: int, hour: int = 12) -> datetime:
    return datetime(2026, 11, 29, hour, minute, tzinfo=UTC)


@pytest.fixture
def in_thread(monkeypatch):
    """Prefetches compute in their thread, not in a child process: the tests that wrap the real build in this
    process (a failing or gated build) need the build to run where the wrapper is."""
    monkeypatch.setattr(service, "PREFETCH_IN_PROCESS", False)


def _delta(before: dict, name: str) -> int:
    return latency_table_stats()[name] - before[name]


@pytest.fixture(autouse=True)
def _no_prefetch_left_running():
    """Every test starts and ends with no prefetch thread running (they are process-wide)."""
    assert wait_for_prefetches(WAIT_S)
    yield
    assert wait_for_prefetches(WAIT_S)


def test_a_plan_in_the_last_minutes_builds_the_next_hours_table_and_the_plan_at_the_hour_does_not(engine,
                                                                                                  settings):
    _setup(engine)
    before = latency_table_stats()
    early = plan_job(engine, settings, _at(54))
    assert early["actions"] > 0 and early["latency_prefetch_started"] is False  # not yet in the window
    assert _delta(before, "builds") == 1  # this hour's table
    window = plan_job(engine, settings, _at(57))
    assert window["latency_prefetch_started"] is True
    assert wait_for_prefetches(WAIT_S)
    assert _delta(before, "builds") == 2 and _delta(before, "prefetches_started") == 1
    assert plan_job(engine, settings, _at(58))["latency_prefetch_started"] is False  # cached: not again
    hits = latency_table_stats()["hits"]
    turned = plan_job(engine, settings, _at(0, hour=13))
    assert "actions" in turned and "skipped" not in turned
    assert _delta(before, "builds") == 2  # the plan at 13:00 found its table built
    assert latency_table_stats()["hits"] == hits + 1
    # what was prefetched is hour 13's table (the prior's peak hours: slower pulls than hour 12's), the same one
    # a synchronous build gives
    fleet = fleet_from_store(engine, now=_at(0, hour=13))
    nodes = list(fleet.nodes.index)
    at_13 = latency_table(engine, settings, fleet.models, hour=13, nodes=nodes)
    at_12 = latency_table(engine, settings, fleet.models, hour=12, nodes=nodes)
    assert _delta(before, "builds") == 2
    fresh = service.load_latency_model(engine, settings).node_latency_table(fleet.models, hour=13, nodes=nodes)
    np.testing.assert_array_equal(at_13.total_s, fresh.total_s)
    assert (at_13.total_s[:, :, 0] > at_12.total_s[:, :, 0]).all()  # from nothing cached: the image pull


def test_the_window_is_the_hours_last_minutes_and_the_next_hour_wraps_at_midnight(engine, settings, in_thread):
    models = pd.DataFrame({"image_bytes": [9e9, 5e9], "weights_bytes": [16e9, 2e9]},
                          index=pd.Index(["a", "b"], name="model_id"))
    nodes = ["n0", "n1"]
    assert prefetch_next_hour(engine, settings, models, now=_at(60 - service.PREFETCH_LEAD_MIN - 1, hour=23),
                              nodes=nodes) is None
    thread = prefetch_next_hour(engine, settings, models, now=_at(60 - service.PREFETCH_LEAD_MIN, hour=23),
                                nodes=nodes)
    assert thread is not None
    thread.join(WAIT_S)
    before = latency_table_stats()
    latency_table(engine, settings, models, hour=0, nodes=nodes)
    assert _delta(before, "builds") == 0 and _delta(before, "hits") == 1


def test_a_prefetch_that_fails_is_logged_and_the_next_plan_builds_its_table(engine, settings, monkeypatch,
                                                                               caplog, in_thread):
    _setup(engine)
    real = ColdStartModel.node_latency_table
    failed = []

    def fails_once_for_hour_13(self, models, *, hour, nodes, **kwargs):
        if hour == 13 and not failed:
            failed.append(hour)
            raise MemoryError("no room for the next hour's table")
        return real(self, models, hour=hour, nodes=nodes, **kwargs)

    monkeypatch.setattr(ColdStartModel, "node_latency_table", fails_once_for_hour_13)
    before = latency_table_stats()
    with caplog.at_level(logging.ERROR, logger=service.log.name):
        assert plan_job(engine, settings, _at(57))["latency_prefetch_started"] is True
        assert wait_for_prefetches(WAIT_S)
    assert failed == [13] and _delta(before, "prefetch_failures") == 1
    assert any("prefetch for hour 13 failed" in r.getMessage() and r.exc_info for r in caplog.records)
    # the next plan in the window tries again (nothing is cached or in flight for the key)
    assert plan_job(engine, settings, _at(58))["latency_prefetch_started"] is True
    assert wait_for_prefetches(WAIT_S)
    assert _delta(before, "prefetch_failures") == 1
    builds = latency_table_stats()["builds"]
    turned = plan_job(engine, settings, _at(0, hour=13))
    assert "actions" in turned and latency_table_stats()["builds"] == builds


def test_the_plan_at_the_hour_builds_its_table_itself_after_a_failed_prefetch(engine, settings, monkeypatch, in_thread):
    """A prefetch that failed at :59 (the last chance): the plan of :00 builds the table synchronously."""
    _setup(engine)
    real = ColdStartModel.node_latency_table
    calls = []

    def fails_in_the_prefetch_thread(self, models, *, hour, nodes, **kwargs):
        calls.append(threading.current_thread().name)
        if threading.current_thread().name.startswith("latency-prefetch"):
            raise RuntimeError("prefetch broke")
        return real(self, models, hour=hour, nodes=nodes, **kwargs)

    monkeypatch.setattr(ColdStartModel, "node_latency_table", fails_in_the_prefetch_thread)
    before = latency_table_stats()
    assert plan_job(engine, settings, _at(59))["latency_prefetch_started"] is True
    assert wait_for_prefetches(WAIT_S)
    turned = plan_job(engine, settings, _at(0, hour=13))
    assert "actions" in turned and _delta(before, "prefetch_failures") == 1
    assert calls[-1] == threading.current_thread().name  # hour 13's table, built by the plan itself


def _gated_build(monkeypatch, gated_hour: int):
    """Wrap the real build so that ``gated_hour``'s first build waits for ``gate``; ``entered`` says it began."""
    real = ColdStartModel.node_latency_table
    entered, gate, hours = threading.Event(), threading.Event(), []

    def gated(self, models, *, hour, nodes, **kwargs):
        hours.append(hour)
        if hour == gated_hour and hours.count(hour) == 1:
            entered.set()
            assert gate.wait(WAIT_S), "the test never opened the gate"
        return real(self, models, hour=hour, nodes=nodes, **kwargs)

    monkeypatch.setattr(ColdStartModel, "node_latency_table", gated)
    return entered, gate, hours


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def test_concurrent_callers_of_one_key_build_once_and_no_lock_is_held_while_building(engine, settings,
                                                                                      monkeypatch, in_thread):
    models = pd.DataFrame({"image_bytes": [9e9, 5e9, 7e9], "weights_bytes": [16e9, 2e9, 40e9]},
                          index=pd.Index(["a", "b", "c"], name="model_id"))
    nodes = ["n0", "n1", "n2"]
    entered, gate, hours = _gated_build(monkeypatch, gated_hour=5)
    before = latency_table_stats()
    got: dict[str, object] = {}

    def call(name: str) -> None:
        got[name] = latency_table(engine, settings, models, hour=5, nodes=nodes)

    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert entered.wait(WAIT_S)
    # while hour 5 is computed, the cache answers other keys (the build holds no lock) ...
    latency_table(engine, settings, models, hour=6, nodes=nodes)
    # ... a prefetch of the key in flight starts nothing, and a second caller waits for the first one's build
    assert prefetch_latency_table(engine, settings, models, hour=5, nodes=nodes) is None
    second = threading.Thread(target=call, args=("second",))
    second.start()
    _until(lambda: _delta(before, "waits") == 1, "the second caller waits")
    gate.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert hours.count(5) == 1 and hours.count(6) == 1 and _delta(before, "builds") == 2
    assert got["first"] is got["second"]


def test_the_plan_at_the_hour_waits_for_the_prefetch_in_flight_instead_of_building(engine, settings,
                                                                                     monkeypatch, in_thread):
    _setup(engine)
    plan_job(engine, settings, _at(54))
    entered, gate, hours = _gated_build(monkeypatch, gated_hour=13)
    before = latency_table_stats()
    assert plan_job(engine, settings, _at(55))["latency_prefetch_started"] is True
    assert entered.wait(WAIT_S)  # the prefetch is computing hour 13's table, and is held there
    result: dict = {}
    turned = threading.Thread(target=lambda: result.update(plan_job(engine, settings, _at(0, hour=13))))
    turned.start()
    _until(lambda: _delta(before, "waits") == 1, "the plan of 13:00 waits for the prefetch")
    gate.set()
    turned.join(WAIT_S)
    assert "actions" in result and hours.count(13) == 1 and _delta(before, "builds") == 1


def test_adding_the_next_hours_table_keeps_the_table_in_use_and_drops_the_least_recently_used(engine, settings,
                                                                                             monkeypatch, in_thread):
    """The table in use was built before another caller's (here: one node's); it is read every minute since, so
    when the next hour's table is added beyond the budget, the other one goes, not the table in use."""
    models = pd.DataFrame({"image_bytes": [9e9, 5e9], "weights_bytes": [16e9, 2e9]},
                          index=pd.Index(["a", "b"], name="model_id"))
    nodes = ["n0", "n1"]
    in_use = latency_table(engine, settings, models, hour=11, nodes=nodes)
    latency_table(engine, settings, models, hour=11, nodes=["n0"])
    monkeypatch.setattr(service, "_TABLE_BYTES_KEPT", in_use.nbytes)  # room for one table beyond the newest two
    latency_table(engine, settings, models, hour=11, nodes=nodes)  # the plan of the next minute
    thread = prefetch_latency_table(engine, settings, models, hour=12, nodes=nodes)
    assert thread is not None
    thread.join(WAIT_S)
    before = latency_table_stats()
    assert latency_table(engine, settings, models, hour=11, nodes=nodes) is in_use
    latency_table(engine, settings, models, hour=12, nodes=nodes)
    assert _delta(before, "builds") == 0 and _delta(before, "hits") == 2
    latency_table(engine, settings, models, hour=11, nodes=["n0"])
    assert _delta(before, "builds") == 1  # the least recently used was the one dropped


def _request(engine, settings, models, hour: int = 14, nodes=("n0", "n1")):
    return service._request(engine, settings, models, hour=hour, nodes=list(nodes))


def test_a_prefetch_in_its_own_process_gives_the_table_this_process_builds(engine, settings):
    """The default prefetch computes in a spawned, lower-priority child (it must not hold this process's GIL
    while the plans run); what comes back through the pipe is the table a build here gives, cell for cell."""
    assert service.PREFETCH_IN_PROCESS
    models = pd.DataFrame({"image_bytes": [9e9, 5e9, 7e9], "weights_bytes": [16e9, 2e9, 40e9]},
                          index=pd.Index(["a", "b", "c"], name="model_id"))
    request = _request(engine, settings, models)
    here = request.build()
    there = service.build_in_child(request)
    assert there is not here
    np.testing.assert_array_equal(there.total_s, here.total_s)
    assert list(there.model_ids) == list(here.model_ids) and list(there.node_ids) == list(here.node_ids)


def test_a_build_that_fails_in_its_process_raises_here_with_the_childs_traceback(engine, settings):
    models = pd.DataFrame({"image_bytes": [9e9]}, index=pd.Index(["a"], name="model_id"))  # no weights_bytes
    request = service._TableRequest(key=("broken",), model=service.load_latency_model(engine, settings),
                                    sizes=models, hour=3, node_ids=("n0",))
    with pytest.raises(RuntimeError, match="failed in its process") as raised:
        service.build_in_child(request)
    assert "weights_bytes" in str(raised.value)  # the child's own error, named


class _KilledWhileBuilding:
    """Stands for the kernel's OOM killer, not for a latency model: the child dies in the middle of the build."""

    def node_latency_table(self, sizes, *, hour, nodes):
        import os

        os._exit(9)


def test_a_build_process_that_dies_is_a_clear_error_not_a_hang(engine, settings):
    models = pd.DataFrame({"image_bytes": [9e9], "weights_bytes": [1e9]}, index=pd.Index(["a"], name="model_id"))
    request = service._TableRequest(key=("killed",), model=_KilledWhileBuilding(), sizes=models, hour=3,
                                    node_ids=("n0",))
    with pytest.raises(RuntimeError, match="exit code 9"):
        service.build_in_child(request, timeout_s=WAIT_S)


class _Built:
    def build(self):
        return {"table": 1}


def test_a_child_whose_parent_stopped_waiting_ends_quietly():
    """A prefetch in flight when ``prewarm demo`` ended printed two BrokenPipeError tracebacks from its child: it
    sent its table to a closed pipe, then tried to send that error down the same pipe."""
    import multiprocessing

    receiver, sender = multiprocessing.Pipe(duplex=False)
    receiver.close()  # the parent stopped waiting
    service._child_build(_Built(), sender, 0)  # returns; nothing raised out of the child's target



class _FailingBuild:
    """Stands for the child multiprocessing terminates at exit: the build ends in an error."""

    def node_latency_table(self, sizes, *, hour, nodes):
        raise RuntimeError("the latency table process ended without a table (exit code -15; killed for memory?)")


def test_a_prefetch_that_fails_while_the_process_exits_is_abandoned_quietly(monkeypatch, caplog):
    """At the end of the demo multiprocessing terminated the prefetch's child (its main thread had ended), and the
    prefetch thread logged an ERROR with a traceback blaming memory: nothing had failed that anyone would wait for."""
    exited = threading.Thread(target=lambda: None)
    exited.start()
    exited.join()
    monkeypatch.setattr(service, "PREFETCH_IN_PROCESS", False)
    monkeypatch.setattr(service.threading, "main_thread", lambda: exited)  # the main thread has ended
    models = pd.DataFrame({"image_bytes": [9e9], "weights_bytes": [1e9]}, index=pd.Index(["a"], name="model_id"))
    request = service._TableRequest(key=("exiting",), model=_FailingBuild(), sizes=models, hour=3, node_ids=("n0",))
    before = latency_table_stats()
    with caplog.at_level(logging.INFO, logger=service.log.name):
        service._run_prefetch(request, service._Build())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "abandoned: the process is exiting" in caplog.text
    assert _delta(before, "prefetch_failures") == 0
