"""PrometheusSource against a real Prometheus (see tests/prom_fixtures.py).

Two kinds of queries are used:

* live data: the exporter's counter, scraped every second, with a 2 s step so
  that the whole file needs only seconds of wall time;
* ``vector(...)`` expressions, which Prometheus evaluates at any time without
  stored data: minute-step behaviour (gaps, splitting, rounding, NaN) over
  hours in the past, deterministic and instant.

Counts from live data are checked exactly. ``increase()`` extrapolates, so it
is not used for that; the template below subtracts the counter's last scraped
value one step earlier from its last scraped value, which is the exact number
of increments scraped in ``(t - step, t]``, and telescopes over a range.
"""

from __future__ import annotations

import math
import random
import socket
import threading
import time
from datetime import datetime, timedelta, timezone

import httpx
import pandas as pd
import pytest

from forecaster.ingest.prometheus import (
    DEFAULT_QUERY_TEMPLATE,
    PrometheusQueryError,
    PrometheusSource,
    PrometheusUnavailable,
    escape_promql_string,
    exact_count_query,
)
from forecaster.ingest.validate import build_count_batch
from forecaster.settings import Settings
from tests.prom_fixtures import SERIES_NAME

STEP = 2  # seconds, for live data
DIFF_TEMPLATE = (
    f'sum({SERIES_NAME}{{{{model_name="{{model_id}}"}}}}) '
    f'- sum({SERIES_NAME}{{{{model_name="{{model_id}}"}}}} offset {STEP}s)'
)
VALUE_TEMPLATE = f'sum({SERIES_NAME}{{{{model_name="{{model_id}}"}}}})'
HOUR = datetime(2024, 3, 1, 12, 0, tzinfo=timezone.utc)  # a past, hour-aligned start for vector() queries
WEIRD_ID = 'we"ird\\id'
_LIVE_RANGE: dict[str, int] = {}  # the range of the exact-count test, reused by the next test


def _ts(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def _ceil(t: float, step: int = STEP) -> int:
    return math.ceil(t / step) * step


def _latest_step_end(live: int) -> int:
    """The latest step boundary not after now and not before ``live`` (waits if needed)."""
    end = max(live, math.floor(time.time() / STEP) * STEP)
    _wait_until(end + 0.05)
    return end


def _wait_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


@pytest.fixture(scope="module")
def live(prom_server):
    """Creates the live series at once; returns a step-aligned time after all were scraped."""
    counter = prom_server.counter
    counter.labels(model_name="m-count").inc(0)
    counter.labels(model_name="dup-a").inc(1)
    counter.labels(model_name="dup-b").inc(1)
    counter.labels(model_name=WEIRD_ID).inc(3)
    stamps = [
        prom_server.wait_for_value("m-count", 0),
        prom_server.wait_for_value("dup-a", 1),
        prom_server.wait_for_value("dup-b", 1),
        prom_server.wait_for_value(WEIRD_ID, 3),
    ]
    base = _ceil(max(stamps))  # every series has a sample at or before base
    return base


def _minute_source(url: str, **kwargs) -> PrometheusSource:
    return PrometheusSource(url, VALUE_TEMPLATE, **kwargs)


# --- live data ----------------------------------------------------------------


def test_counts_per_step_equal_the_increments(prom_server, live):
    start = live
    _wait_until(start + 0.05)  # increments must be scraped after start
    counter = prom_server.counter.labels(model_name="m-count")
    counter.inc(5)
    s1 = prom_server.wait_for_value("m-count", 5)
    time.sleep(STEP + 0.2)  # the second burst is scraped in a later step
    counter.inc(7)
    s2 = prom_server.wait_for_value("m-count", 12)
    end = _ceil(s2) + STEP  # one quiet step after the burst
    _wait_until(end + 0.05)

    with PrometheusSource(prom_server.url, DIFF_TEMPLATE, step_seconds=STEP) as source:
        raw, windows = source.fetch(["m-count"], _ts(start), _ts(end))

    assert windows.to_dict("records") == [
        {"unique_id": "m-count", "start": pd.Timestamp(start, unit="s", tz="UTC"),
         "end": pd.Timestamp(end, unit="s", tz="UTC")}
    ]
    # One row per step, zeros included, every step of the window.
    expected_ds = pd.date_range(_ts(start), _ts(end), freq=f"{STEP}s", inclusive="left")
    assert list(raw["ds"]) == list(expected_ds)
    assert list(raw.columns) == ["unique_id", "ds", "y", "row", "field"]
    assert raw["y"].dtype == "int64"
    assert list(raw["row"]) == list(range(1, len(raw) + 1))
    # A scrape at s is counted in the step (t - STEP, t] with t = ceil(s): ds = t - STEP.
    nonzero = {row.ds: row.y for row in raw.itertuples() if row.y}
    ds1 = pd.Timestamp(_ceil(s1) - STEP, unit="s", tz="UTC")
    ds2 = pd.Timestamp(_ceil(s2) - STEP, unit="s", tz="UTC")
    assert ds1 != ds2
    assert nonzero == {ds1: 5, ds2: 7}
    assert raw["y"].sum() == 12
    _LIVE_RANGE.update(start=start, end=end)


def test_live_counts_feed_build_count_batch_and_refetch_is_identical(prom_server):
    if not _LIVE_RANGE:
        pytest.skip("needs test_counts_per_step_equal_the_increments")
    start, end = _LIVE_RANGE["start"], _LIVE_RANGE["end"]
    with PrometheusSource(prom_server.url, DIFF_TEMPLATE, step_seconds=STEP) as source:
        raw, windows = source.fetch(["m-count"], _ts(start), _ts(end))
        again = source.fetch(["m-count"], _ts(start), _ts(end))
    pd.testing.assert_frame_equal(raw, again[0])
    pd.testing.assert_frame_equal(windows, again[1])
    batch = build_count_batch(
        raw, source="prometheus", step_seconds=STEP, now=datetime.now(timezone.utc), windows=windows
    )
    assert batch.total_invocations == 12
    assert sorted(batch.counts["y"]) == [5, 7]
    assert batch.covered_steps == (end - start) // STEP
    assert batch.model_ids == ["m-count"]


def test_the_default_query_counts_every_increment_once_across_resets_new_and_gone_series(prom_server):
    """The default query's form (:func:`exact_count_query`, here with the test's 2 s step and 1 s scrapes):
    single requests at random phases, so that some are scraped across a step boundary, where ``increase()`` loses
    or extrapolates them; a restart (the counter falls to 0) in the middle; a pod that appears, and one that goes
    away right after its last scrape."""
    counter = prom_server.counter
    sparse, new, gone = "exact-sparse", "exact-new", "exact-gone"
    counter.labels(model_name=sparse).inc(0)
    counter.labels(model_name=gone).inc(0)
    prom_server.wait_for_value(sparse, 0)
    prom_server.wait_for_value(gone, 0)
    start = _ceil(time.time()) + STEP
    _wait_until(start + 0.05)
    rng = random.Random(11)
    sent = 0
    for i in range(10):
        time.sleep(rng.uniform(0.3, 1.7))
        counter.labels(model_name=sparse).inc()
        sent += 1
        if i == 2:
            counter.labels(model_name=new).inc(0)  # a new pod: its first scrape holds 0
        if i == 4:
            counter.labels(model_name=new).inc(2)
            counter.labels(model_name=gone).inc(3)
            prom_server.wait_for_value(gone, 3)
            counter.remove(gone)  # its pod goes away: Prometheus marks the series stale
        if i == 6:
            prom_server.wait_for_value(sparse, float(i + 1))
            counter.remove(sparse)  # a restart: the same series starts again at 0 ...
            counter.labels(model_name=sparse).inc(0)
            prom_server.wait_for_value(sparse, 0)  # ... after one scrape showed the request before it
    prom_server.wait_for_value(sparse, float(sent - 7))
    end = _ceil(time.time()) + STEP
    _wait_until(end + 0.05)

    template = exact_count_query(f'{SERIES_NAME}{{{{model_name="{{model_id}}"}}}}', f"{STEP}s")
    with PrometheusSource(prom_server.url, template, step_seconds=STEP) as source:
        raw, windows = source.fetch([sparse, new, gone], _ts(start), _ts(end))
    totals = raw.groupby("unique_id")["y"].sum().to_dict()
    assert totals == {sparse: sent, new: 2, gone: 3}
    assert set(raw["y"]) <= {0, 1, 2, 3}  # counts, not extrapolations
    sparse_window = windows.set_index("unique_id").loc[sparse]
    assert (sparse_window["start"], sparse_window["end"]) == (_ts(start), _ts(end))


def test_the_default_query_is_the_settings_default():
    assert Settings().prometheus_query_template == DEFAULT_QUERY_TEMPLATE
    assert DEFAULT_QUERY_TEMPLATE == exact_count_query('vllm:request_success_total{{model_name="{model_id}"}}')


def test_model_without_series_has_no_window(prom_server, live):
    end = _latest_step_end(live)
    with PrometheusSource(prom_server.url, VALUE_TEMPLATE, step_seconds=STEP) as source:
        raw, windows = source.fetch(["never-seen", "dup-a"], _ts(end - 2 * STEP), _ts(end))
    assert "never-seen" not in set(windows["unique_id"])  # unknown, not zero
    assert "never-seen" not in set(raw["unique_id"])
    assert "dup-a" in set(windows["unique_id"])  # a present series in the same call is covered


def test_default_template_is_valid_promql_and_gives_no_window_without_data(prom_server):
    with PrometheusSource(prom_server.url) as source:
        raw, windows = source.fetch(["llama"], HOUR, HOUR + timedelta(minutes=5))
    assert raw.empty and windows.empty
    assert list(raw.columns) == ["unique_id", "ds", "y", "row", "field"]
    assert list(windows.columns) == ["unique_id", "start", "end"]


def test_non_aggregated_query_with_two_series_is_rejected(prom_server, live):
    end = _latest_step_end(live)
    template = f'{SERIES_NAME}{{{{model_name=~"{{model_id}}-.*"}}}}'
    with PrometheusSource(prom_server.url, template, step_seconds=STEP) as source:
        with pytest.raises(PrometheusQueryError) as info:
            source.fetch(["dup"], _ts(end - 2 * STEP), _ts(end))
    message = str(info.value)
    assert "sum(" in message and "'dup'" in message and "dup-a" in message and "dup-b" in message
    assert info.value.error_type == "multiple_series"
    assert info.value.model_id == "dup"


def test_model_ids_with_quotes_are_escaped(prom_server, live):
    end = _latest_step_end(live)
    injection = 'x"} or vector(99) or {__name__="y'
    with PrometheusSource(prom_server.url, VALUE_TEMPLATE, step_seconds=STEP) as source:
        assert source.query_for(WEIRD_ID) == f'sum({SERIES_NAME}{{model_name="we\\"ird\\\\id"}})'
        raw, windows = source.fetch([WEIRD_ID, injection], _ts(end - 2 * STEP), _ts(end))
    assert list(windows["unique_id"]) == [WEIRD_ID]  # the injection matched no series
    assert set(raw["y"]) == {3}
    assert set(raw["unique_id"]) == {WEIRD_ID}


def test_escape_promql_string():
    assert escape_promql_string('a"b\\c\nd\x01') == 'a\\"b\\\\c\\nd\\x01'
    filled = DEFAULT_QUERY_TEMPLATE.format(model_id=escape_promql_string('m"1'))
    assert 'vllm:request_success_total{model_name="m\\"1"}[1m]' in filled and "{{" not in filled


# --- errors -----------------------------------------------------------------------


def test_bad_promql_is_a_query_error(prom_server):
    template = 'sum(rate(prewarm_test_requests_total{{model_name="{model_id}"}}[1m])'
    with PrometheusSource(prom_server.url, template) as source:
        with pytest.raises(PrometheusQueryError) as info:
            source.fetch(["m1"], HOUR, HOUR + timedelta(minutes=3))
    message = str(info.value)
    assert "'m1'" in message
    assert 'sum(rate(prewarm_test_requests_total{model_name="m1"}[1m])' in message
    assert "unclosed left parenthesis" in message
    assert info.value.error_type == "bad_data"


def test_execution_error_is_a_query_error(prom_server):
    query = 'vector(1) + on() group_left label_replace(vector(1) or label_replace(vector(2), "a", "b", "", ""), "c", "d", "", "")'
    with PrometheusSource(prom_server.url, VALUE_TEMPLATE) as source:
        with pytest.raises(PrometheusQueryError) as info:
            source.fetch(["m1"], HOUR, HOUR + timedelta(minutes=3), query_overrides={"m1": query})
    assert info.value.error_type == "execution"
    assert "many-to-many" in str(info.value)


@pytest.mark.parametrize("expr, kind", [("vector(NaN)", "NaN"), ("vector(-Inf)", "infinite")])
def test_nan_and_inf_are_errors_naming_model_and_time(prom_server, expr, kind):
    # Finite everywhere except at 12:10 (the step 12:09-12:10).
    query = f"vector(1) and on() (vector(time() % 3600) != 600) or ({expr} and on() (vector(time() % 3600) == 600))"
    with PrometheusSource(prom_server.url, VALUE_TEMPLATE) as source:
        with pytest.raises(PrometheusQueryError) as info:
            source.fetch(["m-nan"], HOUR, HOUR + timedelta(minutes=30), query_overrides={"m-nan": query})
    message = str(info.value)
    assert "'m-nan'" in message and kind in message
    assert "2024-03-01T12:10:00+00:00" in message


def test_closed_port_is_unavailable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with PrometheusSource(f"http://127.0.0.1:{port}", VALUE_TEMPLATE) as source:
        with pytest.raises(PrometheusUnavailable):
            source.fetch(["m1"], HOUR, HOUR + timedelta(minutes=3))


def test_server_that_never_answers_is_unavailable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)  # connections complete in the kernel; nothing ever answers
        port = sock.getsockname()[1]
        with PrometheusSource(f"http://127.0.0.1:{port}", VALUE_TEMPLATE, timeout_s=0.3) as source:
            with pytest.raises(PrometheusUnavailable, match="did not answer"):
                source.fetch(["m1"], HOUR, HOUR + timedelta(minutes=3))


def test_http_error_status_is_unavailable(prom_server):
    with PrometheusSource(prom_server.url + "/no-such-prefix", VALUE_TEMPLATE) as source:
        with pytest.raises(PrometheusUnavailable, match="404"):
            source.fetch(["m1"], HOUR, HOUR + timedelta(minutes=3))


@pytest.mark.parametrize(
    "status, body, error",
    [
        (503, {"status": "error", "errorType": "timeout", "error": "query timed out"}, PrometheusUnavailable),
        (500, "internal", PrometheusUnavailable),
        (200, "<html>not prometheus</html>", PrometheusUnavailable),
        (200, {"status": "success", "data": {"resultType": "vector", "result": []}}, PrometheusQueryError),
    ],
)
def test_error_classification(status, body, error):
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, dict):
            return httpx.Response(status, json=body)
        return httpx.Response(status, text=body)

    client = httpx.Client(transport=httpx.MockTransport(handler))
    source = PrometheusSource("http://prometheus.invalid", VALUE_TEMPLATE, client=client)
    with pytest.raises(error):
        source.fetch(["m1"], HOUR, HOUR + timedelta(minutes=3))
    client.close()


# --- ranges, coverage, values -----------------------------------------------------


def test_alignment_and_range_arguments():
    source = PrometheusSource("http://127.0.0.1:9", VALUE_TEMPLATE)  # never contacted
    with pytest.raises(ValueError, match="start .* not aligned"):
        source.fetch(["m"], HOUR + timedelta(seconds=30), HOUR + timedelta(minutes=5))
    with pytest.raises(ValueError, match="end .* not aligned"):
        source.fetch(["m"], HOUR, HOUR + timedelta(minutes=5, seconds=1))
    with pytest.raises(ValueError, match="before start"):
        source.fetch(["m"], HOUR, HOUR - timedelta(minutes=5))
    raw, windows = source.fetch(["m"], HOUR, HOUR)
    assert raw.empty and windows.empty
    with pytest.raises(ValueError, match="non-empty"):
        source.fetch([""], HOUR, HOUR + timedelta(minutes=5))
    assert PrometheusSource("http://x", VALUE_TEMPLATE, step_seconds=5).step_seconds == 5
    with pytest.raises(ValueError, match="model_id"):
        PrometheusSource("http://x", 'sum(x{model_name="{model}"})')
    with pytest.raises(ValueError):
        PrometheusSource("http://x", VALUE_TEMPLATE, max_points_per_query=11_001)


def test_window_is_the_first_contiguous_run_of_samples(prom_server):
    overrides = {
        # no sample at 12:30 (the step 12:29-12:30): covered [12:00, 12:29)
        "mid-gap": "vector(1) and on() (vector(time() % 3600) != 1800)",
        # no samples at 12:00-12:05 nor at 13:00: the leading gap is skipped, covered [12:05, 12:59)
        "leading-gap": "vector(1) and on() (vector(time() % 3600) > 300)",
        # gaps at 12:00-12:05 and at 12:30: covered [12:05, 12:29)
        "both": "vector(1) and on() (vector(time() % 3600) > 300) and on() (vector(time() % 3600) != 1800)",
        "never": "vector(1) and on() (vector(time()) < 0)",
        "full": "vector(2)",
    }
    with PrometheusSource(prom_server.url, VALUE_TEMPLATE) as source:
        raw, windows = source.fetch(list(overrides), HOUR, HOUR + timedelta(hours=1), query_overrides=overrides)
    got = {r["unique_id"]: (r["start"], r["end"]) for r in windows.to_dict("records")}
    h = pd.Timestamp(HOUR)
    minute = pd.Timedelta(minutes=1)
    assert got == {
        "mid-gap": (h, h + 29 * minute),
        "leading-gap": (h + 5 * minute, h + 59 * minute),
        "both": (h + 5 * minute, h + 29 * minute),
        "full": (h, h + 60 * minute),
    }
    per_model = raw.groupby("unique_id")["ds"].agg(["min", "max", "count"])
    for uid, (start, end) in got.items():
        assert per_model.loc[uid, "min"] == start
        assert per_model.loc[uid, "max"] == end - minute
        assert per_model.loc[uid, "count"] == (end - start) / minute
    assert set(raw.loc[raw["unique_id"] == "full", "y"]) == {2}


def test_values_are_rounded_and_clipped(prom_server):
    overrides = {"a": "vector(2.4)", "b": "vector(2.5)", "c": "vector(2.6)", "d": "vector(-0.4)", "e": "vector(-3)"}
    with PrometheusSource(prom_server.url, VALUE_TEMPLATE) as source:
        raw, _ = source.fetch(list(overrides), HOUR, HOUR + timedelta(minutes=2), query_overrides=overrides)
    assert raw.groupby("unique_id")["y"].unique().map(list).to_dict() == {
        "a": [2], "b": [2], "c": [3], "d": [0], "e": [0]
    }


def test_split_ranges_give_the_same_result_as_one_query(prom_server):
    overrides = {
        "m-split": "vector(time() % 420 / 60) and on() (vector(time() % 3600) != 1500)",
        "m-other": "vector(3)",
    }
    start, end = HOUR, HOUR + timedelta(hours=2)  # 120 steps
    requests: list[httpx.Request] = []
    lock = threading.Lock()

    def record(request: httpx.Request) -> None:
        with lock:
            requests.append(request)

    with PrometheusSource(prom_server.url, VALUE_TEMPLATE) as whole:
        raw_one, windows_one = whole.fetch(list(overrides), start, end, query_overrides=overrides)
    client = httpx.Client(event_hooks={"request": [record]})
    with PrometheusSource(prom_server.url, VALUE_TEMPLATE, max_points_per_query=7, client=client) as split:
        raw_split, windows_split = split.fetch(list(overrides), start, end, query_overrides=overrides)
    client.close()

    pd.testing.assert_frame_equal(raw_one, raw_split)
    pd.testing.assert_frame_equal(windows_one, windows_split)
    assert raw_one["y"].nunique() > 1
    assert len(requests) == 2 * math.ceil(120 / 7)
    for request in requests:
        params = request.url.params
        points = (int(params["end"]) - int(params["start"])) // 60 + 1
        assert points in range(1, 8)  # never more than max_points_per_query
        assert params["step"] == "60s"


def test_evaluation_times_after_now_are_not_asked_for(prom_server):
    now = datetime.now(timezone.utc)
    this_minute = now.replace(second=0, microsecond=0)
    start = this_minute - timedelta(minutes=3)
    end = this_minute + timedelta(minutes=10)
    with PrometheusSource(prom_server.url, VALUE_TEMPLATE) as source:
        raw, windows = source.fetch(["m"], start, end, query_overrides={"m": "vector(1)"})
    assert windows["end"].iloc[0] <= pd.Timestamp(datetime.now(timezone.utc))
    assert windows["start"].iloc[0] == pd.Timestamp(start)
    assert raw["ds"].max() < pd.Timestamp(datetime.now(timezone.utc))


def test_naive_datetimes_are_utc(prom_server):
    naive = HOUR.replace(tzinfo=None)
    with PrometheusSource(prom_server.url, VALUE_TEMPLATE) as source:
        raw, windows = source.fetch(["m"], naive, naive + timedelta(minutes=2), query_overrides={"m": "vector(1)"})
    assert windows["start"].iloc[0] == pd.Timestamp(HOUR)
    assert str(raw["ds"].dtype) == "datetime64[ns, UTC]"


# --- into the batch contract -----------------------------------------------------


def test_result_feeds_build_count_batch(prom_server):
    overrides = {
        "busy": "vector(time() % 300 / 60)",  # 0,1,2,3,4 requests per minute, repeating
        "gappy": "vector(5) and on() (vector(time() % 3600) != 600)",  # covered [12:00, 12:09)
        "absent": "vector(1) and on() (vector(time()) < 0)",
    }
    start, end = HOUR, HOUR + timedelta(minutes=30)
    with PrometheusSource(prom_server.url, VALUE_TEMPLATE) as source:
        raw, windows = source.fetch(list(overrides), start, end, query_overrides=overrides)

    batch = build_count_batch(
        raw, source="prometheus", step_seconds=60, now=datetime.now(timezone.utc), windows=windows
    )
    assert batch.source == "prometheus"
    assert batch.model_ids == ["busy", "gappy"]
    assert batch.covered_steps == 30 + 9
    # busy: value at t = (t % 300) / 60 for the minute [t-60, t): 6 cycles of 1+2+3+4+0
    assert batch.total_invocations == 6 * 10 + 9 * 5
    assert (batch.counts["y"] > 0).all()  # zeros stay only in the windows
    assert len(batch.counts[batch.counts["unique_id"] == "busy"]) == 30 - 6
    first_busy = batch.counts[batch.counts["unique_id"] == "busy"].iloc[0]
    assert first_busy["ds"] == pd.Timestamp(HOUR) and first_busy["y"] == 1
    assert batch.windows.set_index("unique_id").loc["gappy", "end"] == pd.Timestamp(HOUR + timedelta(minutes=9))
