"""Per-node latency tables shared through files (forecaster.coldstart.table_files): a process that misses its own
cache reads the table another process computed, never a table of another champion, hour, catalogue or node set,
and a missing, broken or unwritable file only means the table is computed.

Real store, a real saved latency champion, and a second Python process for the cross-process read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forecaster.coldstart import service, table_files
from forecaster.coldstart.service import latency_table, latency_table_stats, train_latency_model

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
NODES = ["gpu-a", "gpu-b", "gpu-c"]
MODELS = pd.DataFrame({"image_bytes": [9e9, 5e9, 12e9], "weights_bytes": [16e9, 2e9, 1.4e11]},
                      index=pd.Index(["llama", "qwen", "mixtral \u00e9\"x"], name="model_id"))


def _delta(before: dict, name: str) -> int:
    return latency_table_stats()[name] - before[name]


def _restart() -> None:
    """What a new process starts with: no table in memory (the champion itself stays loaded: one per version)."""
    with service._lock:
        service._tables.clear()


def _files(settings) -> list[Path]:
    root = Path(settings.models_dir) / table_files.DIRNAME
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def _same(a, b) -> None:
    assert list(a.model_ids) == list(b.model_ids) and list(a.node_ids) == list(b.node_ids)
    assert set(a.per_node) == set(b.per_node) and set(a.per_model) == set(b.per_model)
    for name in a.per_node:
        np.testing.assert_array_equal(a.per_node[name], b.per_node[name])
    for name in a.per_model:
        np.testing.assert_array_equal(a.per_model[name], b.per_model[name])


@pytest.fixture
def champion(engine, settings) -> str:
    return train_latency_model(engine, settings, NOW)


def test_a_restarted_process_reads_the_table_instead_of_computing_it(engine, settings, champion):
    before = latency_table_stats()
    computed = latency_table(engine, settings, MODELS, hour=12, nodes=NODES)
    assert _delta(before, "builds") == 1 and _delta(before, "files_written") == 1
    assert len(_files(settings)) == 1 and champion in _files(settings)[0].name
    _restart()
    read = latency_table(engine, settings, MODELS, hour=12, nodes=NODES)
    assert _delta(before, "builds") == 1 and _delta(before, "files_read") == 1
    _same(read, computed)
    assert not read.total_s.flags.writeable  # shared by every reader, as a computed table is
    # the same catalogue in another row order is the same table (readers look models up by id)
    _restart()
    latency_table(engine, settings, MODELS.iloc[::-1], hour=12, nodes=NODES)
    assert _delta(before, "builds") == 1 and _delta(before, "files_read") == 2


def test_another_process_reads_the_file_this_one_wrote(engine, settings, champion):
    computed = latency_table(engine, settings, MODELS, hour=12, nodes=NODES)
    script = f"""
import json, sys
import pandas as pd
from sqlalchemy import create_engine
from forecaster.coldstart.service import latency_table, latency_table_stats
from forecaster.settings import Settings
settings = Settings(database_url={settings.database_url!r}, models_dir={str(settings.models_dir)!r},
                    data_dir={str(settings.data_dir)!r})
models = pd.read_json(sys.stdin, orient="split")
models.index.name = "model_id"
table = latency_table(create_engine(settings.database_url), settings, models, hour=12, nodes={NODES!r})
print(json.dumps({{"stats": latency_table_stats(), "total_s": table.total_s.tolist()}}))
"""
    done = subprocess.run([sys.executable, "-c", script], input=MODELS.to_json(orient="split"), text=True,
                          capture_output=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "random"})
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["stats"]["files_read"] == 1 and answer["stats"]["builds"] == 0
    np.testing.assert_array_equal(np.asarray(answer["total_s"], dtype=np.float32), computed.total_s)


@pytest.mark.parametrize("change", ["hour", "nodes", "sizes", "champion", "code", "runtime"])
def test_a_table_of_another_hour_node_set_catalogue_champion_or_code_is_not_read(engine, settings, champion, change,
                                                                                 monkeypatch):
    latency_table(engine, settings, MODELS, hour=12, nodes=NODES)
    _restart()
    before = latency_table_stats()
    hour, nodes, models = 12, NODES, MODELS
    if change == "hour":
        hour = 13
    elif change == "nodes":
        nodes = NODES[:2]
    elif change == "sizes":
        models = MODELS.assign(weights_bytes=MODELS["weights_bytes"] * [1, 1, 2])
    elif change == "champion":
        train_latency_model(engine, settings, NOW + timedelta(days=1))
    elif change == "code":  # a deploy that changed the package's sources
        monkeypatch.setattr(table_files, "code_fingerprint", lambda: "another deploy")
    else:  # an image with another LightGBM, say
        monkeypatch.setattr(table_files, "runtime", lambda: "lightgbm 0.0")
    table = latency_table(engine, settings, models, hour=hour, nodes=nodes)
    assert _delta(before, "files_read") == 0 and _delta(before, "builds") == 1
    assert list(table.node_ids) == nodes and len(_files(settings)) == 2


def test_a_broken_file_is_computed_again_and_replaced(engine, settings, champion, caplog):
    computed = latency_table(engine, settings, MODELS, hour=12, nodes=NODES)
    (path,) = _files(settings)
    data = (path / "per_node.0.npy").read_bytes()
    (path / "per_node.0.npy").write_bytes(data[: len(data) // 2])  # truncated
    _restart()
    before = latency_table_stats()
    table = latency_table(engine, settings, MODELS, hour=12, nodes=NODES)
    assert _delta(before, "builds") == 1 and _delta(before, "files_read") == 0
    assert "cannot be read" in caplog.text
    _same(table, computed)
    _restart()
    latency_table(engine, settings, MODELS, hour=12, nodes=NODES)  # the rewritten file is whole
    assert _delta(before, "files_read") == 1 and _delta(before, "builds") == 1


def test_a_file_written_for_another_key_under_the_same_name_is_not_read(engine, settings, champion):
    latency_table(engine, settings, MODELS, hour=12, nodes=NODES)
    (path,) = _files(settings)
    meta = json.loads((path / "meta.json").read_text())
    meta["key"]["sizes_digest"] += 1
    (path / "meta.json").write_text(json.dumps(meta))
    _restart()
    before = latency_table_stats()
    latency_table(engine, settings, MODELS, hour=12, nodes=NODES)
    assert _delta(before, "builds") == 1 and _delta(before, "files_read") == 0


def test_an_unwritable_directory_only_means_the_table_is_not_shared(engine, settings, champion):
    Path(settings.models_dir).mkdir(parents=True, exist_ok=True)
    (Path(settings.models_dir) / table_files.DIRNAME).write_text("not a directory")  # as a read-only volume
    before = latency_table_stats()
    table = latency_table(engine, settings, MODELS, hour=12, nodes=NODES)
    assert _delta(before, "builds") == 1 and _delta(before, "files_written") == 0
    assert table.total_s.shape == (3, 3, 4)
    assert not any(p.name.startswith(".") for p in Path(settings.models_dir).iterdir() if p.is_dir()
                   and p.name != champion)


def test_only_the_newest_tables_are_kept(engine, settings, champion):
    kept = settings.model_copy(update={"latency_table_files_kept": 2})
    for hour in (10, 11, 12):
        latency_table(engine, kept, MODELS, hour=hour, nodes=NODES)
    assert [p.name.split("-h")[1][:2] for p in _files(settings)] == ["11", "12"]
    # a read keeps its table: hour 11 read after 12 was written survives the next write
    _restart()
    past = datetime.now().timestamp() - 60
    for path in _files(settings):
        os.utime(path, (past, past))
    latency_table(engine, kept, MODELS, hour=11, nodes=NODES)
    latency_table(engine, kept, MODELS, hour=13, nodes=NODES)
    assert sorted(p.name.split("-h")[1][:2] for p in _files(settings)) == ["11", "13"]
    # a hidden directory a dead writer left an hour ago goes, and so does a lock file unused for an hour; one being
    # written now stays
    root = Path(settings.models_dir) / table_files.DIRNAME
    dead, live = root / ".x.partial-dead", root / ".y.partial-live"
    dead.mkdir(), live.mkdir()
    os.utime(dead, (past - 7200, past - 7200))
    old_lock, new_lock = root / ".x.lock", root / ".y.lock"
    old_lock.touch(), new_lock.touch()
    os.utime(old_lock, (past - 7200, past - 7200))
    table_files.prune(root, kept=2)
    assert not dead.exists() and live.exists()
    assert not old_lock.exists() and new_lock.exists()


def test_no_files_for_the_prior_or_when_turned_off(engine, settings):
    before = latency_table_stats()
    latency_table(engine, settings, MODELS, hour=12, nodes=NODES)  # no champion saved: the prior
    assert _files(settings) == [] and _delta(before, "builds") == 1
    train_latency_model(engine, settings, NOW)
    off = settings.model_copy(update={"latency_table_files_kept": 0})
    latency_table(engine, off, MODELS, hour=12, nodes=NODES)
    assert _files(settings) == [] and _delta(before, "builds") == 2
    latency_table(engine, settings, MODELS, hour=12, nodes=None)  # the node-less frame stays in memory only
    assert _files(settings) == []


def test_the_apis_snapshot_reads_the_table_the_plan_job_wrote(engine, settings, champion):
    """The API's lead times and the plan job ask for the same table (same catalogue sizes and nodes): the API,
    restarted or in another worker, reads what the plan job computed."""
    from api.snapshot import ForecastSnapshot
    from forecaster.jobs.planning import plan_job
    from tests.test_latency_prefetch import _at, _setup

    _setup(engine)
    before = latency_table_stats()
    assert "actions" in plan_job(engine, settings, _at(50))
    assert _delta(before, "builds") == 1 and _delta(before, "files_written") == 1
    _restart()
    snapshot = ForecastSnapshot(engine, refresh_s=0, settings=settings, clock=lambda: _at(51))
    assert snapshot.refresh()
    assert _delta(before, "files_read") == 1 and _delta(before, "builds") == 1
    assert snapshot.latency_model_version == champion
    assert all(view.lead_time_s and view.lead_time_s > 0 for view in snapshot.models.values())


_SLOW_BUILD = """
import json, sys, time
import pandas as pd
from sqlalchemy import create_engine
from forecaster.coldstart import service
from forecaster.coldstart.model import ColdStartModel
from forecaster.settings import Settings

real = ColdStartModel.node_latency_table
def slow(self, *args, **kwargs):  # the real build, made slow enough that the processes overlap
    time.sleep(2.0)
    return real(self, *args, **kwargs)
ColdStartModel.node_latency_table = slow
settings = Settings(database_url=sys.argv[1], models_dir=sys.argv[2], data_dir=sys.argv[3])
models = pd.read_json(sys.argv[4], orient="split")
models.index.name = "model_id"
engine = create_engine(settings.database_url)
service.load_latency_model(engine, settings)
print("ready", flush=True)
sys.stdin.readline()  # every process ready: they ask at once
table = service.latency_table(engine, settings, models, hour=12, nodes=sys.argv[5:])
print(json.dumps({"stats": service.latency_table_stats(), "total_s": table.total_s.tolist()}))
"""


def test_processes_asking_at_once_compute_the_table_once(engine, settings, champion, tmp_path):
    """The plan job and API workers at the same hour turn: one computes, the others wait for it and read."""
    models_json = tmp_path / "models.json"
    models_json.write_text(MODELS.to_json(orient="split"))
    args = [sys.executable, "-c", _SLOW_BUILD, settings.database_url, str(settings.models_dir),
            str(settings.data_dir), str(models_json), *NODES]
    procs = [subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        answers.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(a["stats"]["builds"] for a in answers) == 1
    assert sum(a["stats"]["files_read"] for a in answers) == 2
    assert all(a["total_s"] == answers[0]["total_s"] for a in answers)


def test_a_lock_held_too_long_is_given_up_and_the_table_computed(engine, settings, champion, monkeypatch, caplog):
    import fcntl

    from forecaster.coldstart.service import _request

    key = _request(engine, settings, MODELS, hour=12, nodes=NODES).file_key
    root = Path(settings.models_dir) / table_files.DIRNAME
    root.mkdir(parents=True)
    holder = os.open(root / f".{table_files._name(key)}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a builder that hangs
    monkeypatch.setattr(table_files, "BUILD_WAIT_S", 0.5)
    try:
        before = latency_table_stats()
        table = latency_table(engine, settings, MODELS, hour=12, nodes=NODES)
        assert _delta(before, "builds") == 1 and table.total_s.shape == (3, 3, 4)
        assert "computing it here too" in caplog.text
    finally:
        os.close(holder)
