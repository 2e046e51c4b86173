"""The Prometheus ingest job (:func:`forecaster.ingest.service.ingest_prometheus`) against a real Prometheus.

Counts come from constant PromQL expressions (``vector(n)``, optionally gated on ``time()``), which Prometheus
evaluates at any past time without stored data, so watermarks hours old cost no wall time. Every ``now`` lies in
the past: the source never asks Prometheus about minutes after the real clock.
"""

from __future__ import annotations

import math
import threading
from datetime import datetime, timedelta

import httpx

from forecaster.ingest import service
from forecaster.ingest.prometheus import PrometheusSource
from forecaster.ingest.service import PROMETHEUS_SOURCE, ingest_prometheus
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.invocations import coverage_ends, read_counts
from forecaster.store.retention import rollup_day
from tests.prom_fixtures import ingest_settings as _settings

LAG = timedelta(minutes=2)  # prometheus_lag_s below: a run at `now` reads up to now - LAG


def _register(engine, queries: dict[str, str]) -> None:
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, labels={"prometheus_query": q}) for m, q in queries.items()])


def _marks(engine, ids: list[str]) -> dict[str, datetime]:
    return coverage_ends(engine, ids, source=PROMETHEUS_SOURCE, step_seconds=60)


def _counts(engine, model_id: str, start: datetime, end: datetime) -> dict[int, float]:
    """``model_id``'s stored counts per minute of ``[start, end)``, keyed by minutes after ``start`` (NaN: unknown)."""
    frame = read_counts(engine, [model_id], start, end)
    return {int((ds - start).total_seconds()) // 60: y for ds, y in zip(frame["ds"], frame["y"])}


def _epoch(t: datetime) -> int:
    return int(t.timestamp())


def test_a_watermark_hours_old_is_resumed_there(engine, settings, prom_server, past_now):
    """prewarm was down for 3 hours, longer than PREWARM_PROMETHEUS_BACKFILL_MINUTES (30 here): the next run reads
    every minute since the watermark, so the coverage has no hole."""
    settings = _settings(settings, prom_server)
    _register(engine, {"steady": "vector(4)"})
    before = past_now - timedelta(hours=3)
    assert ingest_prometheus(engine, settings, now=before)["rows_written"] == 30
    mark = before - LAG

    summary = ingest_prometheus(engine, settings, now=past_now)
    end = past_now - LAG
    assert summary["rows_written"] == 180 and summary["invocations"] == 720
    assert summary["catch_up_skipped_models"] == 0 and summary["catch_up_skipped_minutes"] == 0
    assert _marks(engine, ["steady"]) == {"steady": end}
    stored = _counts(engine, "steady", mark - timedelta(minutes=30), end)
    assert len(stored) == 210 and set(stored.values()) == {4}


def test_a_catch_up_past_its_bound_starts_at_the_bound_and_says_what_it_gave_up(engine, settings, prom_server,
                                                                               past_now):
    """PREWARM_PROMETHEUS_MAX_CATCH_UP_MINUTES=60 after 2 hours down: each model resumes an hour back, and the hour
    no run asked for is counted once. ``idle`` has had no sample since: the next run asks for its last hour again
    but does not count the minutes before as skipped a second time."""
    settings = _settings(settings, prom_server, prometheus_max_catch_up_minutes=60)
    first = past_now - timedelta(hours=3)
    mark = first - LAG
    _register(engine, {"steady": "vector(4)", "idle": f"vector(1) and on() (vector(time()) <= {_epoch(mark)})"})
    assert ingest_prometheus(engine, settings, now=first)["rows_written"] == 60

    second = ingest_prometheus(engine, settings, now=past_now - timedelta(hours=1))
    assert second["rows_written"] == 60 and second["models"] == 1
    assert second["catch_up_skipped_models"] == 2 and second["catch_up_skipped_minutes"] == 120
    stored = _counts(engine, "steady", mark, past_now - LAG - timedelta(hours=1))
    assert [k for k, y in stored.items() if math.isnan(y)] == list(range(60))  # NaN: the hour given up stays unknown
    assert {y for k, y in stored.items() if k >= 60} == {4}

    third = ingest_prometheus(engine, settings, now=past_now)
    assert third["rows_written"] == 60
    assert third["catch_up_skipped_models"] == 0 and third["catch_up_skipped_minutes"] == 0
    assert _marks(engine, ["idle"]) == {"idle": mark}


def test_a_long_catch_up_is_read_in_chunks_and_batches_as_one_read_would(engine, settings, prom_server, past_now,
                                                                         monkeypatch):
    """3 hours to catch up at 50 points per query and 100 rows per batch (two models per batch): no query asks for
    more than 50 minutes, and the coverage is what one read of the whole span gives. ``late`` has no sample for
    its first two hours (skipped, as a leading gap is); ``gappy`` has a gap in the second chunk, stops there and
    is resumed after the gap by the next run."""
    monkeypatch.setattr(service, "PROMETHEUS_BATCH_ROWS", 100, raising=False)
    settings = _settings(settings, prom_server)
    before = past_now - timedelta(hours=3)
    mark = before - LAG
    a = _epoch(mark)
    _register(engine, {
        "steady": "vector(4)",
        "late": f"vector(2) and on() ((vector(time()) <= {a}) or (vector(time()) > {a + 120 * 60}))",
        "gappy": f"vector(3) and on() ((vector(time()) < {a + 70 * 60}) or (vector(time()) > {a + 80 * 60}))",
    })
    assert ingest_prometheus(engine, settings, now=before)["rows_written"] == 90

    asked: list[httpx.Request] = []
    lock = threading.Lock()

    def record(request: httpx.Request) -> None:
        with lock:
            asked.append(request)

    client = httpx.Client(event_hooks={"request": [record]})
    with PrometheusSource(prom_server.url, max_points_per_query=50, client=client) as source:
        summary = ingest_prometheus(engine, settings, now=past_now, source=source)
        end = past_now - LAG
        points = [(int(r.url.params["end"]) - int(r.url.params["start"])) // 60 + 1 for r in asked]
        assert max(points) == 50 and len(points) >= 3 * 3
        assert summary["models"] == 3 and summary["rows_written"] == 180 + 60 + 69
        assert _marks(engine, ["steady", "late", "gappy"]) == {
            "steady": end, "late": end, "gappy": mark + timedelta(minutes=69)}
        late = _counts(engine, "late", mark, end)
        assert all(math.isnan(y) for k, y in late.items() if k < 120) and {late[k] for k in range(120, 180)} == {2}

        again = ingest_prometheus(engine, settings, now=past_now, source=source)
    client.close()
    assert again["rows_written"] == 100 and again["models"] == 1  # gappy: 11 minutes unknown, then to the end
    gappy = _counts(engine, "gappy", mark, end)
    assert [k for k, y in gappy.items() if math.isnan(y)] == list(range(69, 80))
    assert _marks(engine, ["gappy"]) == {"gappy": end}


def test_a_catch_up_never_reaches_into_a_rolled_up_day(engine, settings, prom_server, past_now):
    """The retention job rolled yesterday up to 5-minute buckets, where per-minute counts are refused: a watermark
    two days old resumes at today's start instead of failing every run."""
    settings = _settings(settings, prom_server)
    _register(engine, {"steady": "vector(4)"})
    before = past_now - timedelta(days=2)
    ingest_prometheus(engine, settings, now=before)
    end = past_now - LAG
    today = end.replace(hour=0, minute=0)
    rollup_day(engine, (today - timedelta(days=1)).date(), 300)

    summary = ingest_prometheus(engine, settings, now=past_now)
    minutes_today = int((end - today).total_seconds()) // 60
    assert summary["rows_written"] == minutes_today
    assert summary["catch_up_skipped_models"] == 1
    assert summary["catch_up_skipped_minutes"] == int((today - (before - LAG)).total_seconds()) // 60
    assert _marks(engine, ["steady"]) == {"steady": end}


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


def test_a_model_without_samples_is_not_asked_again_for_minutes_a_run_found_empty(engine, settings, prom_server,
                                                                                 past_now):
    """``idle`` was served until its watermark, then scaled to zero (no series, no sample). A run six hours later
    asks for those six hours once and finds nothing; the next run asks only for the minutes since (before,
    every run asked again from the watermark, up to 15 days: three 10,000-step queries per idle model per run).
    When the model is served again, its minutes are read from the first sample on; a model whose query failed
    keeps asking from its watermark, and so does one whose query was corrected."""
    settings = _settings(settings, prom_server)
    served_until = past_now - timedelta(hours=6)
    back = past_now - timedelta(minutes=10)
    gated = (f"vector(3) and on() (vector(time()) <= {_epoch(served_until - LAG)} "
             f"or vector(time()) > {_epoch(back - LAG)})")
    _register(engine, {"idle": gated, "broken": gated})
    ingest_prometheus(engine, settings, now=served_until)
    mark = served_until - LAG
    assert _marks(engine, ["idle", "broken"]) == {"idle": mark, "broken": mark}
    _register(engine, {"broken": "vector(3"})  # its label gets a PromQL syntax error

    asked: list[tuple[str, int, int]] = []

    def record(request: httpx.Request) -> None:
        params = request.url.params
        asked.append((params["query"], int(params["start"]), int(params["end"])))

    quiet = back - timedelta(minutes=30)
    with httpx.Client(event_hooks={"request": [record]}) as client:
        source = PrometheusSource(prom_server.url, client=client)
        first = ingest_prometheus(engine, settings, now=quiet, source=source)
        assert first["rows_written"] == 0 and list(first["query_errors"]) == ["broken"]
        idle_asks = [(s, e) for q, s, e in asked if q == gated]
        assert min(s for s, _ in idle_asks) == _epoch(mark) + 60  # from the watermark: ~6 hours, asked once
        assert _marks(engine, ["idle"]) == {"idle": mark}  # nothing sampled: the coverage stays

        asked.clear()
        second = ingest_prometheus(engine, settings, now=quiet + timedelta(minutes=5), source=source)
        assert second["rows_written"] == 0
        idle_asks = [(s, e) for q, s, e in asked if q == gated]
        assert idle_asks == [(_epoch(quiet - LAG) + 60, _epoch(quiet - LAG + timedelta(minutes=5)))]
        assert min(s for q, s, _ in asked if q == "vector(3") == _epoch(mark) + 60  # failed: asked again

        # the same minutes under a corrected query (still without a sample here) are asked again from the watermark
        corrected = gated.replace("vector(3)", "vector(3) * 1")
        _register(engine, {"idle": corrected})
        asked.clear()
        ingest_prometheus(engine, settings, now=quiet + timedelta(minutes=6), source=source)
        assert min(s for q, s, _ in asked if q == corrected) == _epoch(mark) + 60

        served = ingest_prometheus(engine, settings, now=past_now, source=source)
    end = past_now - LAG
    assert served["rows_written"] == 10 and served["invocations"] == 30
    assert _marks(engine, ["idle"]) == {"idle": end}
    stored = _counts(engine, "idle", mark, end)
    assert stored[0] != stored[0]  # the empty hours stay unknown, never zero
    assert {k: v for k, v in stored.items() if v == v} == {k: 3.0 for k in range(len(stored) - 10, len(stored))}
