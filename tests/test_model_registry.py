"""The model registry's folders: written durably before their rows name them, and pruned by the retention job."""

from __future__ import annotations

import functools
import os
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

import forecaster.forecast.registry as registry
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.members import MovingAverage
from forecaster.forecast.panel import Panel
from forecaster.forecast.sharded import ShardedEnsemble
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecasts import ensure_forecast_partitions, write_forecast_arrays
from forecaster.store.model_retention import prune_model_versions
from forecaster.store.registry import insert_version, promote_version


@pytest.fixture
def fsyncs(monkeypatch) -> list[tuple[str, list[str] | None]]:
    """Every ``os.fsync`` of this test: (the path its descriptor names, a directory's entries then, else None)."""
    calls: list[tuple[str, list[str] | None]] = []
    real = os.fsync

    def recording(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        calls.append((path, sorted(os.listdir(path)) if os.path.isdir(path) else None))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return calls


def _sharded_ensemble() -> ShardedEnsemble:
    values = np.random.default_rng(0).poisson(4, (5, 480)).astype(float)
    panel = Panel(np.array(list("abcde"), dtype=object), pd.Timestamp("2026-01-01", tz="UTC"),
                  pd.Timedelta(minutes=1), values)
    factory = functools.partial(Ensemble, members=[MovingAverage(60)], horizon=60)
    return ShardedEnsemble(factory, shard_max_series=2).fit_panel(panel)


def test_save_version_syncs_every_artefact_and_folder_before_it_returns(tmp_path, fsyncs):
    models = tmp_path / "models"
    final = registry.save_version(_sharded_ensemble(), models, version_id="v1", train_start=None, train_end=None,
                                  scores={})
    staging = models / ".v1.partial"  # where the files were written and synced, before the rename
    files = sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file())
    assert "ensemble.pkl" in files and "metadata.json" in files and any(f.startswith("shards/") for f in files)
    synced = {Path(path) for path, _ in fsyncs}
    assert {staging / f for f in files} <= synced  # each file's data
    assert {staging, staging / "shards"} <= synced  # the folders' entries
    assert fsyncs[-1] == (str(models), ["v1"])  # last, the parent, its entry renamed already
    assert registry.load_ensemble(final).shard_ids_  # what was synced is what loads


def test_the_latency_model_is_synced_before_its_row_names_it(engine, settings, now, fsyncs):
    from forecaster.coldstart.service import train_latency_model

    version = train_latency_model(engine, settings, now)  # no cold starts stored: the prior, still saved
    final, staging = settings.models_dir / version, settings.models_dir / f".{version}.partial"
    files = sorted(p.name for p in final.iterdir())
    assert "metadata.json" in files
    assert {staging / f for f in files} | {staging} <= {Path(path) for path, _ in fsyncs}
    assert (str(settings.models_dir), [version]) in fsyncs


def _version(engine, models: Path, version_id: str, *, kind: str = "forecast", status: str = "retired",
             age: timedelta, now: datetime, folder: Path | None = None) -> Path:
    """A saved version: a folder with a file, and its row created ``age`` before ``now``."""
    folder = folder or models / version_id
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text("{}")
    insert_version(engine, version_id=version_id, path=folder, status=status, train_start=None, train_end=None,
                   members=[], scores={}, code_version="test", kind=kind)
    with engine.begin() as conn:
        conn.execute(text("UPDATE model_versions SET created_at = :t WHERE id = :id"),
                     {"t": now - age, "id": version_id})
    return folder


def _statuses(engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT id, status FROM model_versions")).all())


def test_retention_deletes_the_files_of_old_versions_but_champions_the_newest_and_the_last_champion(
        engine, settings, now, tmp_path):
    models, days = settings.models_dir, timedelta(days=1)
    # f1, f2 former champions (f2 the last one), f3 the champion, f4 a rejected challenger, f5, f6 the newest two
    for k, status in enumerate(("retired", "retired", "champion", "rejected", "rejected", "challenger"), start=1):
        _version(engine, models, f"f{k}", status=status, age=(10 - k) * days, now=now)
    for k in range(1, 4):
        _version(engine, models, f"l{k}", kind="latency", status="rejected", age=(10 - k) * days, now=now)
    _version(engine, models, "elsewhere", age=20 * days, now=now, folder=tmp_path / "other" / "elsewhere")
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="m")])
    ensure_forecast_partitions(engine, [now.date()])
    write_forecast_arrays(engine, ["m"], now, {"point": np.ones((1, 3))}, issued_at=now, model_version_id="f1")

    detail = prune_model_versions(engine, models, now=now, retention_days=2, kept=2)

    # f1 goes although a stored forecast names it: its row stays (marked), so the forecast keeps its provenance
    assert sorted(detail["deleted"]) == ["f1", "f4", "l1"] and detail["elsewhere"] == ["elsewhere"]
    statuses = _statuses(engine)
    assert {v for v, status in statuses.items() if status == "deleted"} == {"f1", "f4", "l1"}
    assert len(statuses) == 10  # every row kept
    assert sorted(p.name for p in models.iterdir()) == [".trash", "f2", "f3", "f5", "f6", "l2", "l3"]
    assert not any((models / ".trash").iterdir()) and (tmp_path / "other" / "elsewhere").is_dir()
    # a deleted version cannot be promoted: its files are gone
    with pytest.raises(LookupError):
        promote_version(engine, "f4")
    assert _statuses(engine)["f3"] == "champion"
    # younger than the retention: nothing more goes, whatever their number; deleted ones are not counted again
    assert prune_model_versions(engine, models, now=now, retention_days=9, kept=1)["deleted"] == []
    assert prune_model_versions(engine, models, now=now, retention_days=2, kept=2)["deleted"] == []


def test_retention_resolves_what_an_interrupted_run_left_in_the_trash(engine, settings, now):
    models = settings.models_dir
    _version(engine, models, "v1", age=timedelta(0), now=now)
    _version(engine, models, "v2", age=timedelta(0), now=now)
    (models / ".trash").mkdir()
    (models / "v1").rename(models / ".trash" / "v1")  # moved, but its row's delete never committed
    (models / "v2").rename(models / ".trash" / "v2")  # moved and its row's mark committed
    with engine.begin() as conn:
        conn.execute(text("UPDATE model_versions SET status = 'deleted' WHERE id = 'v2'"))

    detail = prune_model_versions(engine, models, now=now, retention_days=2, kept=1)

    assert (detail["trash_restored"], detail["trash_removed"]) == (1, 1)
    assert (models / "v1" / "metadata.json").is_file() and not any((models / ".trash").iterdir())


def test_a_version_deleted_while_its_promotion_waits_leaves_the_champion_in_place(engine, settings, now):
    import threading

    models = settings.models_dir
    _version(engine, models, "old", status="champion", age=timedelta(0), now=now)
    _version(engine, models, "new", age=timedelta(0), now=now)
    errors = []
    with engine.connect() as conn:
        tx = conn.begin()  # as the retention job does: the row locked and marked, the commit still to come
        conn.execute(text("UPDATE model_versions SET status = 'deleted' WHERE id = 'new'"))
        promoting = threading.Thread(target=lambda: _catch(errors, promote_version, engine, "new"))
        promoting.start()
        promoting.join(1.0)
        assert promoting.is_alive()  # waiting for the row
        tx.commit()
    promoting.join(10)
    assert len(errors) == 1 and isinstance(errors[0], LookupError)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM model_versions WHERE status = 'champion'")).scalars().all() == ["old"]


def _catch(errors: list, function, *args) -> None:
    try:
        function(*args)
    except Exception as error:  # noqa: BLE001 - the test looks at it
        errors.append(error)


def test_the_hourly_retention_job_prunes_model_versions_with_the_settings(engine, settings, now):
    from forecaster.jobs.scheduler import retention_job

    for k in range(5):  # defaults: older than 2 days, beyond the newest 3
        _version(engine, settings.models_dir, f"v{k}", age=timedelta(days=10 - k), now=now)
    detail = retention_job(engine, settings, now)["model_versions"]
    assert detail["deleted"] == ["v0", "v1"]
    assert sorted(p.name for p in settings.models_dir.iterdir()) == [".trash", "v2", "v3", "v4"]


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device (simulated)")


def test_a_save_that_fails_leaves_no_staging_folder(tmp_path, monkeypatch):
    models = tmp_path / "models"
    model = _sharded_ensemble()
    monkeypatch.setattr(registry.pickle, "dump", _disk_full)  # the disk fills up while the model file is written
    with pytest.raises(OSError, match="No space left"):
        registry.save_version(model, models, version_id="v1", train_start=None, train_end=None, scores={})
    assert list(models.iterdir()) == []  # neither .v1.partial nor v1


def test_a_latency_model_save_or_registration_that_fails_leaves_no_folder(engine, settings, now, monkeypatch):
    import forecaster.coldstart.service as service
    from forecaster.coldstart.model import ColdStartModel

    real_save = ColdStartModel.save

    def save_then_fill_the_disk(self, folder):
        real_save(self, folder)
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(ColdStartModel, "save", save_then_fill_the_disk)
    with pytest.raises(OSError, match="No space left"):
        service.train_latency_model(engine, settings, now)
    assert list(settings.models_dir.iterdir()) == []
    monkeypatch.setattr(ColdStartModel, "save", real_save)
    monkeypatch.setattr(service, "insert_version", lambda *a, **k: _disk_full())  # the database write fails
    with pytest.raises(OSError):
        service.train_latency_model(engine, settings, now)
    assert list(settings.models_dir.iterdir()) == []


def test_retention_removes_day_old_leftovers_of_unfinished_saves_and_nothing_else(engine, settings, now,
                                                                                   monkeypatch):
    import time

    import forecaster.store.model_retention as model_retention

    models = settings.models_dir
    named = "20190716T0000-aaaaaa"
    _version(engine, models, named, age=timedelta(0), now=now)  # a registered version (row young: not pruned)
    leftovers = [".20190716T0001-bbbbbb.partial", ".latency-20190716T0001-bbbbbb.partial",  # killed saves
                 "20190716T0002-cccccc", "latency-20190716T0002-cccccc"]  # published, never registered
    others = [".notes.partial", "scratch", "latency-tables", ".20190716T0003-dddddd.partial.bak", "v1"]
    for name in leftovers + others:
        (models / name / "shards").mkdir(parents=True)
        (models / name / "shards" / "s0.pkl").write_bytes(b"x" * 100)

    young = prune_model_versions(engine, models, now=now, retention_days=2, kept=1)  # written just now: all stay
    assert set(leftovers + others + [named]) <= {p.name for p in models.iterdir()}

    monkeypatch.setattr(model_retention, "LEFTOVER_AGE_S", 0.0, raising=False)  # as a day later
    time.sleep(0.01)
    detail = prune_model_versions(engine, models, now=now, retention_days=2, kept=1)

    assert sorted(p.name for p in models.iterdir() if p.name != ".trash") == sorted(others + [named])
    assert young["partial_removed"] == [] and young["orphans_removed"] == []
    assert sorted(detail["partial_removed"]) == sorted(leftovers[:2])
    assert sorted(detail["orphans_removed"]) == sorted(leftovers[2:])
    assert not any((models / ".trash").iterdir())
    assert _statuses(engine) == {named: "retired"}


def test_the_leftover_sweep_goes_by_the_wall_clock_age_of_everything_in_a_folder(engine, settings):
    import time

    from forecaster.store.model_retention import sweep_leftovers

    models = settings.models_dir
    staging = models / ".20190716T0001-bbbbbb.partial"
    (staging / "shards").mkdir(parents=True)
    (staging / "shards" / "s0.pkl").write_bytes(b"x")
    old = time.time() - 3 * 86400
    os.utime(staging, (old, old))  # the folder's own times say nothing of a shard file still being written
    assert sweep_leftovers(engine, models) == ([], [])
    assert sweep_leftovers(engine, models, clock=lambda: time.time() + 86400) == ([staging.name], [])
