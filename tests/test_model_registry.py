"""The model registry's folders: written durably before their rows name them, and pruned by the retention job."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import forecaster.forecast.registry as registry
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.members import MovingAverage
from forecaster.forecast.panel import Panel
from forecaster.forecast.sharded import ShardedEnsemble


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
