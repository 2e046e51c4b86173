"""Burst factors from Prometheus: each minute's busiest 10-second count moves the stored factor, once per minute.

A real Prometheus answers; the counts and peaks are constant PromQL expressions (``vector(n)``), so the expected
factors follow from :mod:`forecaster.contracts.bursts` in closed form.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from sqlalchemy import text

from forecaster.contracts.bursts import BURST_ALPHA, MAX_BURST_FACTOR, smooth_burst_factors
from forecaster.ingest.prometheus import EXAMPLE_BURST_QUERY_TEMPLATE, PrometheusSource, PrometheusUnavailable
from forecaster.ingest.service import ingest_prometheus
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.invocations import read_counts
from tests.prom_fixtures import SERIES_NAME
from tests.prom_fixtures import ingest_settings as _settings


def _after(minutes: int, ratio: float, prior: float = 1.0) -> float:
    """The factor after ``minutes`` busy minutes of one peak-to-mean ``ratio``, from ``prior``."""
    keep = (1.0 - BURST_ALPHA) ** minutes
    return keep * prior + (1.0 - keep) * ratio


def _factors(engine) -> dict[str, float | None]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT id, burst_factor FROM serving_models")).all())




def test_each_new_minute_moves_the_factor_once(engine, settings, prom_server, past_now):
    """120 requests a minute, 60 of them in the busiest 10 s: a ratio of 3 per minute. A second run adds only
    the new minutes, and a run with nothing new leaves the factor as it was."""
    with engine.begin() as conn:
        upsert_models(conn, [
            ServingModelSpec(id="bursty", labels={"prometheus_query": "vector(120)",
                                                  "prometheus_burst_query": "vector(60)"}),
            ServingModelSpec(id="even", labels={"prometheus_query": "vector(120)"}),
            ServingModelSpec(id="quiet", labels={"prometheus_query": "vector(4)",
                                                 "prometheus_burst_query": "vector(4)"}),
        ])
    settings = _settings(settings, prom_server)
    first = ingest_prometheus(engine, settings, now=past_now)
    assert first["rows_written"] == 90 and first["burst_factors_updated"] == 1 and first["burst_errors"] == {}
    stored = _factors(engine)
    assert stored["bursty"] == pytest.approx(_after(30, 3.0))
    assert stored["even"] is None  # no burst query: planned as before
    assert stored["quiet"] is None  # 4 requests a minute cannot show a rate
    with engine.connect() as conn:  # the watermark: the end of the newest minute read (now less the lag)
        through = dict(conn.execute(text("SELECT id, burst_through FROM serving_models")).all())
    end = past_now - timedelta(minutes=2)
    assert through == {"bursty": end, "even": None, "quiet": end}

    later = past_now + timedelta(minutes=5)
    second = ingest_prometheus(engine, settings, now=later)
    assert second["rows_written"] == 15 and second["burst_factors_updated"] == 1
    assert _factors(engine)["bursty"] == pytest.approx(_after(35, 3.0))

    again = ingest_prometheus(engine, settings, now=later)
    assert again["rows_written"] == 0 and again["burst_factors_updated"] == 0
    assert _factors(engine)["bursty"] == pytest.approx(_after(35, 3.0))


def test_the_template_reads_every_model_and_starts_from_the_declared_factor(engine, settings, prom_server,
                                                                             past_now):
    """``PREWARM_PROMETHEUS_BURST_QUERY_TEMPLATE`` asks for every model; a declared factor is the prior, and a
    sampled peak above the minute's count reads as all of the minute in one bucket."""
    with engine.begin() as conn:
        upsert_models(conn, [
            ServingModelSpec(id="declared", burst_factor=2.0, labels={"prometheus_query": "vector(60)"}),
            ServingModelSpec(id="overshoot", labels={"prometheus_query": "vector(60)",
                                                     "prometheus_burst_query": "vector(500)"}),
        ])
    # the template's peak for "declared": 30 of 60 requests in the busiest 10 s, a ratio of 3
    settings = _settings(settings, prom_server,
                         prometheus_burst_query_template='sum(label_replace(vector(30), "m", "{model_id}", "", ""))')
    summary = ingest_prometheus(engine, settings, now=past_now)
    assert summary["burst_factors_updated"] == 2
    assert summary["peaks_clipped"] == 30  # every minute of "overshoot": 500 in 10 s of a minute of 60
    stored = _factors(engine)
    assert stored["declared"] == pytest.approx(_after(30, 3.0, prior=2.0))
    assert stored["overshoot"] == pytest.approx(_after(30, MAX_BURST_FACTOR))


def test_a_rejected_burst_query_costs_that_models_factor_only(engine, settings, prom_server, past_now):
    """Bad PromQL in one model's burst query: its counts are written and its factor stays; the others move."""
    with engine.begin() as conn:
        upsert_models(conn, [
            ServingModelSpec(id="bad", labels={"prometheus_query": "vector(120)",
                                               "prometheus_burst_query": "vector(60"}),
            ServingModelSpec(id="good", labels={"prometheus_query": "vector(120)",
                                                "prometheus_burst_query": "vector(40)"}),
        ])
    summary = ingest_prometheus(engine, _settings(settings, prom_server), now=past_now)
    assert summary["rows_written"] == 60 and summary["burst_factors_updated"] == 1
    assert list(summary["burst_errors"]) == ["bad"] and "parse error" in summary["burst_errors"]["bad"]
    stored = _factors(engine)
    assert stored["bad"] is None and stored["good"] == pytest.approx(_after(30, 2.0))


def test_prometheus_gone_for_the_burst_query_writes_nothing_and_the_next_run_catches_up(
        engine, settings, prom_server, past_now):
    """The peaks are asked before anything is written: an outage leaves the minutes, counts and factor alike,
    to the next run, which stores both once."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="bursty", labels={"prometheus_query": "vector(120)",
                                                                   "prometheus_burst_query": "vector(60)"})])
    settings = _settings(settings, prom_server)
    gone = PrometheusSource("http://127.0.0.1:9", timeout_s=0.5)  # port 9 (discard): nothing listens
    with pytest.raises(PrometheusUnavailable):
        ingest_prometheus(engine, settings, now=past_now, burst_source=gone)
    end = past_now - timedelta(minutes=2)
    assert read_counts(engine, ["bursty"], end - timedelta(minutes=30), end)["y"].isna().all()
    assert _factors(engine)["bursty"] is None

    summary = ingest_prometheus(engine, settings, now=past_now)
    assert summary["rows_written"] == 30 and summary["burst_factors_updated"] == 1
    assert _factors(engine)["bursty"] == pytest.approx(_after(30, 3.0))


def test_a_burst_in_the_last_seconds_of_a_minute_is_that_minutes_peak_only(prom_server):
    """The example template evaluated at minute boundaries, with its 10-second buckets given as a function of their
    end time: 30 requests in the bucket ending 12:30:00 (the last 10 s of 12:29) are the peak of 12:29 and of no
    other minute. A ``[1m:10s]`` subquery on Prometheus 2.x (closed on the left) also evaluates that bucket at the
    start of 12:30 and reads the burst again as 12:30's peak."""
    bucket_query = 'sum(increase(vllm:request_success_total{{model_name="{model_id}"}}[10s]))'
    assert bucket_query in EXAMPLE_BURST_QUERY_TEMPLATE
    one_bucket = "(vector(30) * (vector(time() % 3600) == bool 1800))"  # the bucket ending at :30:00
    hour = datetime(2024, 3, 1, 12, tzinfo=timezone.utc)
    with PrometheusSource(prom_server.url, EXAMPLE_BURST_QUERY_TEMPLATE.replace(bucket_query, one_bucket)) as source:
        peaks, _ = source.fetch(["m"], hour + timedelta(minutes=28), hour + timedelta(minutes=32))
    by_minute = {ts.minute: int(y) for ts, y in zip(peaks["ds"], peaks["y"])}
    assert by_minute == {28: 0, 29: 30, 30: 0, 31: 0}


def test_smoothing_skips_quiet_minutes_and_keeps_an_unmeasured_prior():
    """The closed form the tests above use is the running update, minute by minute."""
    requests = np.array([[120, 5, 120], [4, 4, 4]], dtype=float)
    peaks = np.array([[60, 5, 20], [4, 4, 4]], dtype=float)
    factors, moved = smooth_burst_factors(np.array([np.nan, np.nan]), requests, peaks)
    assert moved.tolist() == [True, False] and np.isnan(factors[1])
    a = BURST_ALPHA
    assert factors[0] == pytest.approx((1 - a) * ((1 - a) * 1.0 + a * 3.0) + a * 1.0)


def test_the_example_burst_query_reads_a_live_burst(prom_server):
    """The documented template (:data:`EXAMPLE_BURST_QUERY_TEMPLATE`) on the exporter's counter, scraped every
    second: 30 requests at once read as a peak of about 30 in one 10-second bucket, a whole minute's worth."""
    template = EXAMPLE_BURST_QUERY_TEMPLATE.replace("vllm:request_success_total", SERIES_NAME)
    with PrometheusSource(prom_server.url, template) as source:  # valid PromQL: no data, no window
        raw, windows = source.fetch(["llama"], datetime(2024, 3, 1, 12, tzinfo=timezone.utc),
                                    datetime(2024, 3, 1, 12, 5, tzinfo=timezone.utc))
    assert raw.empty and windows.empty
    child = prom_server.counter.labels(model_name="burst-live")
    prom_server.wait_for_value("burst-live", 0.0)  # the series exists before the burst, so increase() sees it
    # the burst lands mid-window: a jump scraped in the first second of a 10-second window has its previous sample
    # in the window before, and non-overlapping windows count it in neither (the template's documented blind spot)
    time.sleep((3.0 - time.time() % 10.0) % 10.0)
    child.inc(30)
    scraped = prom_server.wait_for_value("burst-live", 30.0)
    time.sleep(max(0.0, math.ceil(scraped / 10.0) * 10.0 + 1.5 - time.time()))  # a subquery step after it
    peak = prom_server.query(template.format(model_id="burst-live"))
    assert 28.0 <= float(peak[0]["value"][1]) <= 40.0  # increase() extrapolates to the bucket's edges
