"""A latency champion whose files a crash left empty or cut short: planning goes on with the prior, nothing aborts."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

import forecaster.coldstart.service as service
from forecaster.coldstart.model import ColdStartModel
from forecaster.contracts.phases import PHASES
from forecaster.ingest.service import push_cold_starts
from forecaster.store.catalog import ServingModelSpec, upsert_models
from tests.test_coldstart import SMALL_TREES, synthetic_events

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def champion(engine, settings, now) -> str:
    """A trained latency champion (with boosters) saved through the service; this process's cache of it dropped."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in ("small", "mid", "big")])
    events = synthetic_events(60, start=now - timedelta(days=3))
    push_cold_starts(engine, settings, [
        {"model_id": r.model_id, "node_id": r.node_id, "started_at": r.started_at.isoformat(),
         "total_seconds": r.total_seconds, "cache_state": r.cache_state, **{p: getattr(r, p) for p in PHASES}}
        for r in events.itertuples()], now=now)
    version = service.train_latency_model(engine, settings, now, tree_params=SMALL_TREES)
    service._models.pop(service._key(engine, settings), None)  # as another process (the API) or a restart sees it
    return version


def test_an_empty_booster_file_answers_the_prior_once_not_an_error_every_call(engine, settings, champion,
                                                                              monkeypatch):
    booster = settings.models_dir / champion / "total_seconds.txt"
    assert booster.stat().st_size > 0
    booster.write_bytes(b"")  # what a power loss before the data reached the disk leaves
    loads = []
    original = ColdStartModel.load
    monkeypatch.setattr(ColdStartModel, "load", staticmethod(lambda *a, **k: loads.append(a) or original(*a, **k)))

    model = service.load_latency_model(engine, settings)
    assert model.trees_ is None and service.latency_version(engine, settings) is None  # the physics prior
    assert service.load_latency_model(engine, settings) is model
    assert len(loads) == 1  # the failure is remembered for the version, not read again every minute


def test_a_booster_cut_short_does_not_abort_the_process(engine, settings, champion):
    """LightGBM calls std::terminate on many truncated model texts (exit 134); the loader must refuse them first."""
    booster = settings.models_dir / champion / "total_seconds.txt"
    text = booster.read_text()
    booster.write_text(text[: int(len(text) * 0.3)])
    script = (
        "import sys\n"
        "from forecaster.coldstart.service import latency_version, load_latency_model\n"
        "from forecaster.settings import Settings\n"
        "from forecaster.store.db import make_engine\n"
        "settings = Settings(database_url=sys.argv[1], data_dir=sys.argv[2], models_dir=sys.argv[3])\n"
        "engine = make_engine(settings.database_url)\n"
        "model = load_latency_model(engine, settings)\n"
        "print('trees', model.trees_ is not None, 'version', latency_version(engine, settings))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, settings.database_url, str(settings.data_dir),
                           str(settings.models_dir)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trees False version None" in done.stdout
