"""The Prometheus ingest job (:func:`forecaster.ingest.service.ingest_prometheus`) against a real Prometheus.

Counts come from constant PromQL expressions (``vector(n)``, optionally gated on ``time()``), which Prometheus
evaluates at any past time without stored data, so watermarks hours old cost no wall time. Every ``now`` lies in
the past: the source never asks Prometheus about minutes after the real clock.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from forecaster.ingest.service import PROMETHEUS_SOURCE, ingest_prometheus
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.invocations import coverage_ends, read_counts

LAG = timedelta(minutes=2)  # prometheus_lag_s below: a run at `now` reads up to now - LAG


@pytest.fixture
def past_now() -> datetime:
    return datetime.now(timezone.utc).replace(second=0, microsecond=0) - timedelta(minutes=10)


def _settings(settings, prom_server, **more):
    return settings.model_copy(update={"prometheus_url": prom_server.url, "prometheus_lag_s": 120,
                                       "prometheus_backfill_minutes": 30, **more})


def _register(engine, queries: dict[str, str]) -> None:
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, labels={"prometheus_query": q}) for m, q in queries.items()])


def _marks(engine, ids: list[str]) -> dict[str, datetime]:
    return coverage_ends(engine, ids, source=PROMETHEUS_SOURCE, step_seconds=60)


def test_a_models_bad_query_costs_that_model_only(engine, settings, prom_server, past_now):
    """``a-bad`` and ``good`` share a watermark; then a-bad's label gets a PromQL syntax error. The next run writes
    good's minutes, names a-bad (permanent: its query must be fixed) and a model whose query fails to execute
    (transient) in the summary, and leaves both watermarks where they were; once the label is fixed, a-bad is
    caught up from its watermark."""
    settings = _settings(settings, prom_server)
    ids = ["a-bad", "b-exec", "good"]
    _register(engine, {m: "vector(4)" for m in ids})
    before = past_now - timedelta(minutes=20)
    first = ingest_prometheus(engine, settings, now=before)
    assert first["models"] == 3
    mark = before - LAG
    assert _marks(engine, ids) == {m: mark for m in ids}

    many_to_many = ('vector(1) + on() group_left label_replace(vector(1) or label_replace(vector(2), "a", "b", "", ""),'
                    ' "c", "d", "", "")')
    _register(engine, {"a-bad": "vector(4", "b-exec": many_to_many})
    second = ingest_prometheus(engine, settings, now=past_now)
    end = past_now - LAG
    assert second["models"] == 1 and second["rows_written"] == 20 and second["invocations"] == 80
    assert second["query_error_models"] == 2
    errors = second["query_errors"]
    assert sorted(errors) == ["a-bad", "b-exec"]
    assert errors["a-bad"]["error_type"] == "bad_data" and errors["a-bad"]["permanent"] is True
    assert "parse error" in errors["a-bad"]["error"] and "'a-bad'" in errors["a-bad"]["error"]
    assert errors["b-exec"]["error_type"] == "execution" and errors["b-exec"]["permanent"] is False
    assert _marks(engine, ids) == {"a-bad": mark, "b-exec": mark, "good": end}
    counts = read_counts(engine, ids, mark, end)
    assert (counts[counts.unique_id == "good"]["y"] == 4).all()
    assert counts[counts.unique_id != "good"]["y"].isna().all()  # not written: unknown, never zero

    _register(engine, {"a-bad": "vector(4)"})
    third = ingest_prometheus(engine, settings, now=past_now)
    assert third["rows_written"] == 20 and list(third["query_errors"]) == ["b-exec"]
    assert _marks(engine, ids)["a-bad"] == end
