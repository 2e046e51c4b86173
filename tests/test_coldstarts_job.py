"""The scheduler's ``coldstarts`` job: the cold-start collector run every minute from a watermark, on its own.

Real PostgreSQL (``job_runs``, ``cold_starts``) and the Kubernetes backend on the fake API server.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from functools import partial

import pytest
from sqlalchemy import text

from forecaster.actuation.backends.kubernetes import KubernetesBackend
from forecaster.jobs.coldstarts import JOB_NAME, WATERMARK_MARGIN_S, coldstarts_job
from forecaster.jobs.runs import JobSpec, run_once
from forecaster.jobs.scheduler import default_jobs
from forecaster.settings import Settings
from tests.kube_fixtures import FakeKubeApi, ready_pod

NOW = datetime(2026, 11, 29, 12, 0, 30, tzinfo=timezone.utc)
MINUTE = timedelta(minutes=1)


@pytest.fixture
def api() -> FakeKubeApi:
    return FakeKubeApi()


@pytest.fixture
def backend(api: FakeKubeApi) -> KubernetesBackend:
    return KubernetesBackend(api.client(), clock=lambda: NOW, sleep=lambda s: None)


def _run(engine, settings, backend, now: datetime) -> dict | None:
    """One slot of the job as the scheduler runs it (claimed and recorded in ``job_runs``)."""
    return run_once(engine, settings, JobSpec(JOB_NAME, partial(coldstarts_job, backend=backend), every_s=60), now=now,
                    db_wait_s=0)


def _stored(engine) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(
            "SELECT node_id, total_seconds, source FROM cold_starts ORDER BY started_at, node_id"))]


def test_the_scheduler_runs_the_collector_every_minute(settings):
    [spec] = [s for s in default_jobs(settings) if s.name == JOB_NAME]
    assert spec.every_s == 60


def test_each_run_pushes_the_pods_ready_since_the_last_successful_one(engine, settings, api, backend):
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('llama')"))
    api.put(ready_pod("llama-7d9f8b6c5d-aaaaa", "llama", "gpu-node-1", "2026-11-29T11:54:00Z", "2026-11-29T11:54:30Z",
                      "2026-11-29T11:55:05Z"))  # within the margin of the next run
    first = _run(engine, settings, backend, NOW)
    assert (first["since"], first["observed"], first["inserted"]) == (None, 1, 1)  # the first run: every ready pod

    # A pod ready a minute later, and one ready long before the watermark (an earlier run would have seen it).
    api.put(ready_pod("llama-7d9f8b6c5d-bbbbb", "llama", "gpu-node-2", "2026-11-29T12:00:00Z", "2026-11-29T12:00:20Z",
                      "2026-11-29T12:01:00Z"))
    api.put(ready_pod("llama-7d9f8b6c5d-ccccc", "llama", "gpu-node-3", "2026-11-29T10:00:00Z", "2026-11-29T10:00:20Z",
                      "2026-11-29T10:01:00Z"))
    second = _run(engine, settings, backend, NOW + MINUTE)
    watermark = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc) - timedelta(seconds=WATERMARK_MARGIN_S)
    assert second["since"] == watermark.isoformat()
    assert (second["observed"], second["inserted"], second["already_stored"]) == (2, 1, 1)  # the margin re-reads
    assert _stored(engine) == [("gpu-node-1", 65.0, "actuator-kubernetes"), ("gpu-node-2", 60.0, "actuator-kubernetes")]


def test_a_failing_collector_fails_its_own_slot_and_the_next_run_covers_the_gap(engine, settings, api, backend):
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('llama')"))
    assert _run(engine, settings, backend, NOW)["inserted"] == 0

    class Unreachable:
        name = "kubernetes"

        def observe_cold_starts(self, *, since=None):
            raise ConnectionError("the API server is away")

    failed = _run(engine, settings, Unreachable(), NOW + MINUTE)
    assert failed["error"] == "ConnectionError: the API server is away"
    api.put(ready_pod("llama-7d9f8b6c5d-bbbbb", "llama", "gpu-node-2", "2026-11-29T12:00:00Z", "2026-11-29T12:00:20Z",
                      "2026-11-29T12:01:00Z"))
    later = _run(engine, settings, backend, NOW + 2 * MINUTE)
    # the watermark is still the last successful run's: what the failed minute missed is pushed now
    assert later["since"] == (datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
                              - timedelta(seconds=WATERMARK_MARGIN_S)).isoformat()
    assert later["inserted"] == 1
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT status FROM job_runs WHERE job_name = :n ORDER BY slot"),
                            {"n": JOB_NAME}).scalars().all()
    assert runs == ["ok", "failed", "ok"]


@pytest.mark.parametrize("backend_settings", [
    {"actuator_backend": "dry-run"},
    {"actuator_backend": "agent"},
    {"actuator_backend": "composite", "actuator_routes": "scale=dry-run,release=dry-run,prepull=agent,preload=agent"},
])
def test_a_backend_that_cannot_observe_cold_starts_is_skipped(engine, settings, backend_settings):
    configured = Settings(**{**settings.model_dump(), **backend_settings})
    detail = run_once(engine, configured, next(s for s in default_jobs(configured) if s.name == JOB_NAME), now=NOW,
                      db_wait_s=0)
    assert detail["skipped"].endswith("cannot observe cold starts")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM cold_starts")).scalar() == 0


def test_two_replicas_started_in_the_same_second_on_one_node_are_two_cold_starts(engine, settings, api, backend):
    """A scale-up by two puts both pods on an 8-GPU node within one second: Kubernetes stamps creation in whole
    seconds, so (model, node, start) is the same for both. Each pod's uid keeps them apart; a re-read of either is
    still the same event."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('llama')"))
    for name, ready in (("llama-7d9f8b6c5d-aaaaa", "2026-11-29T11:55:05Z"), ("llama-7d9f8b6c5d-bbbbb",
                                                                            "2026-11-29T11:55:40Z")):
        api.put(ready_pod(name, "llama", "gpu-node-1", "2026-11-29T11:54:00Z", "2026-11-29T11:54:30Z", ready))
    first = _run(engine, settings, backend, NOW)
    assert (first["observed"], first["inserted"]) == (2, 2)
    assert _stored(engine) == [("gpu-node-1", 65.0, "actuator-kubernetes"), ("gpu-node-1", 100.0, "actuator-kubernetes")]
    again = _run(engine, settings, backend, NOW + MINUTE)
    assert (again["inserted"], again["already_stored"]) == (0, 2)


def test_starts_longer_than_the_window_are_counted_and_warned_about_not_dropped_quietly(engine, settings, api,
                                                                                         backend, caplog):
    """A large model's load: created 09:30, Ready 11:59 (2.5 h) is within the 3 h default and stored. One Ready
    8 h after creation (a 405B-class load on a slow node, or a flap: they cannot be told apart) is past it: not
    stored, so never learned; the run says so in its detail (``dropped_long_start``) and at WARNING."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('llm-405b')"))
    api.put(ready_pod("llm-405b-7d9f8b6c5d-aaaaa", "llm-405b", "gpu-node-1", "2026-11-29T09:30:00Z",
                      "2026-11-29T09:40:00Z", "2026-11-29T11:59:00Z"))
    api.put(ready_pod("llm-405b-7d9f8b6c5d-bbbbb", "llm-405b", "gpu-node-2", "2026-11-29T03:59:00Z",
                      "2026-11-29T04:10:00Z", "2026-11-29T11:59:00Z"))
    with caplog.at_level("WARNING", logger="forecaster.actuation.kube_coldstarts"):
        summary = _run(engine, settings, backend, NOW)
    assert (summary["observed"], summary["inserted"], summary["dropped_long_start"]) == (1, 1, 1)
    assert _stored(engine) == [("gpu-node-1", 2.5 * 3600 - 60, "actuator-kubernetes")]
    assert any(r.levelname == "WARNING" and "PREWARM_KUBERNETES_COLDSTART_MAX_START_S" in r.getMessage()
               for r in caplog.records)
    again = _run(engine, settings, backend, NOW + MINUTE)  # the margin shows it again: counted again, not stored
    assert again["dropped_long_start"] == 1 and again["inserted"] == 0
