"""Dashboard data endpoints against a real PostgreSQL: exact values on small stored data, auth, validation."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.main import create_app
from forecaster.planning.fleet import PlannerSettings
from forecaster.ingest.service import push_cold_starts, push_counts
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecast_errors import score_hour
from forecaster.store.forecasts import write_forecasts
from forecaster.store.tokens import create_token

NOW = datetime(2026, 11, 29, 12, 0, 30, tzinfo=timezone.utc)
T0 = datetime(2026, 11, 29, 11, 50, tzinfo=timezone.utc)  # first minute with a known count
LLAMA_COUNTS = [10, 12, 0, 8, 20, 30, 25, 0, 5, 10]  # 11:50 .. 11:59
#: The error figures of p_any where no scored minute's run stored one.
NO_P_ANY = {"p_any_minutes": 0, "brier_any": None, "p_any_mean": None, "invoked_share": None}


def minute(hh_mm: str) -> datetime:
    hours, minutes = map(int, hh_mm.split(":"))
    return datetime(2026, 11, 29, hours, minutes, tzinfo=timezone.utc)


def store_run(engine, model_id: str, issued_at: datetime, points: list[float], band: float | None = 100.0,
              p_any: list[float] | None = None) -> None:
    """One forecast run: target minutes from the issuing minute on, ``points[k]`` at horizon k + 1."""
    first = pd.Timestamp(issued_at).floor("min")
    frame = pd.DataFrame({"unique_id": model_id, "ds": pd.date_range(first, periods=len(points), freq="min"),
                          "point": points})
    if p_any is not None:
        frame["p_any"] = p_any
    if band is not None:
        frame["q0.1"] = (frame["point"] - band).clip(lower=0.0)  # the store refuses negative values
        frame["q0.9"] = frame["point"] + band
    write_forecasts(engine, frame, issued_at=issued_at, model_version_id=None)


def add_action(conn, model_id: str, status: str, not_before: datetime | None, deadline: datetime | None,
               kind: str = "prepull", benefit: float | None = None, updated_at: datetime = NOW) -> int:
    return conn.execute(
        text("INSERT INTO actions (kind, model_id, node_id, target, not_before, deadline, reason, expected_benefit, "
             "status, updated_at) VALUES (:k, :m, 'n1', 'img:1', :nb, :dl, 'forecast_spike', :b, :s, :u) "
             "RETURNING id"),
        {"k": kind, "m": model_id, "nb": not_before, "dl": deadline, "b": benefit, "s": status, "u": updated_at},
    ).scalar_one()


@pytest.fixture
def tokens(engine):
    return {scope: create_token(engine, name=scope, scopes=[scope]) for scope in ("read", "ingest")}


@pytest.fixture
def client(engine, settings, tokens):
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        client.headers["Authorization"] = f"Bearer {tokens['read']}"
        yield client


@pytest.fixture
def fleet_data(engine, settings):
    """llama: counts 11:50-11:59 and two runs; mistral: a perfect run; phi: nothing. Cold starts and actions."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in ("llama", "mistral", "phi")])
    rows = [{"model_id": "llama", "minute": (T0 + timedelta(minutes=i)).isoformat(), "count": c}
            for i, c in enumerate(LLAMA_COUNTS) if i != 2]  # 11:52 left out: a zero inside the batch's window
    rows += [{"model_id": "mistral", "minute": (T0 + timedelta(minutes=i)).isoformat(), "count": 10}
             for i in range(10)]
    push_counts(engine, settings, rows, now=NOW)
    # Issued at 11:50:20 for 11:50+k (horizon k + 1) and at 11:51:10 for 11:51+k.
    store_run(engine, "llama", T0 + timedelta(seconds=20), [100.0 + k for k in range(10)])
    store_run(engine, "llama", T0 + timedelta(minutes=1, seconds=10), [200.0 + k for k in range(10)])
    store_run(engine, "mistral", T0 + timedelta(seconds=20), [10.0] * 10)
    events = [{"model_id": "llama", "node_id": "n1", "started_at": t, "total_seconds": s}
              for t, s in (("2026-11-29T11:52:00Z", 40.0), ("2026-11-29T11:58:00Z", 60.0),
                           ("2026-11-29T11:30:00Z", 50.0))]
    push_cold_starts(engine, settings, events, now=NOW)
    with engine.begin() as conn:
        ids = {
            "in_window": add_action(conn, "llama", "succeeded", minute("11:53"), minute("11:58"), benefit=40.0),
            "crosses_end": add_action(conn, "llama", "failed", minute("11:57"), minute("12:05"), benefit=30.0),
            "before": add_action(conn, "llama", "succeeded", minute("11:20"), minute("11:25"), benefit=99.0),
            "crosses_start": add_action(conn, "llama", "succeeded", minute("11:45"), minute("11:51")),
            "unplanned": add_action(conn, "llama", "running", None, None, kind="scale",
                                    updated_at=minute("11:59")),
            "other_model": add_action(conn, "mistral", "succeeded", minute("11:55"), minute("11:56")),
        }
    return ids


# --- series ------------------------------------------------------------------------


def test_series_shows_each_forecast_at_its_own_horizon(client, fleet_data):
    window = {"start": "2026-11-29T11:48:00", "end": "2026-11-29T12:02:00Z"}  # naive start is UTC
    h5 = client.get("/v1/models/llama/series", params={**window, "horizon": 6}).json()
    assert h5["t"][0] == int(minute("11:48").timestamp()) and len(h5["t"]) == 14
    assert all(b - a == 60 for a, b in zip(h5["t"], h5["t"][1:]))
    # unknown before 11:50 and from 12:00; 11:52 is a zero inside the pushed window
    assert h5["actual"] == [None, None, *map(float, LLAMA_COUNTS), None, None]
    # issued 11:50:20 for 11:55 is horizon 6 (11:50 itself is horizon 1); issued 11:51:10 for 11:56 too
    expected = [None] * 14
    expected[7], expected[8] = 105.0, 205.0
    assert h5["forecast"] == expected
    assert h5["band"] == ["0.1", "0.9"]
    assert h5["quantiles"]["0.1"][7] == 5.0 and h5["quantiles"]["0.9"][8] == 305.0
    # 11:55: |105 - 30| = 75 (inside 5..205); 11:56: |205 - 25| = 180 (outside 105..305)
    assert h5["error"] == {"scored_minutes": 2, "mae": 127.5, "wmape": pytest.approx(255 / 55),
                           "band_coverage": 0.5, **NO_P_ANY}  # these runs stored no p_any
    assert set(h5["p_any"]) == {None}

    h5 = client.get("/v1/models/llama/series", params={**window, "horizon": 5}).json()
    assert h5["forecast"][7] == 204.0  # 11:55 at horizon 5 comes from the 11:51 run, not the 11:50 run's 105
    assert h5["forecast"][6] == 104.0 and h5["forecast"][8] is None  # no run was issued at 11:52
    h1 = client.get("/v1/models/llama/series", params={**window, "horizon": 1}).json()
    assert h1["forecast"][2:4] == [100.0, 200.0]  # each run's own issuing minute is 1 minute ahead
    # a run of 10 elements holds horizons 1..10: horizon 10 is its last element, 11 is not stored
    h10 = client.get("/v1/models/llama/series", params={**window, "horizon": 10}).json()
    assert h10["forecast"][11:13] == [109.0, 209.0]
    h11 = client.get("/v1/models/llama/series", params={**window, "horizon": 11}).json()
    assert set(h11["forecast"]) == {None}


def test_series_rerun_in_the_same_minute_wins_and_default_window_runs_past_now(client, engine, fleet_data):
    store_run(engine, "llama", T0 + timedelta(seconds=40), [300.0 + k for k in range(10)], band=None)
    body = client.get("/v1/models/llama/series", params={"horizon": 6, "span_min": 20}).json()
    # default end: after the last minute forecast 6 ahead from now's minute (12:00 + 5, exclusive 12:06)
    assert body["end"] == "2026-11-29T12:06:00Z" and body["start"] == "2026-11-29T11:46:00Z"
    assert body["end_source"] == "now"
    assert body["forecast"][body["t"].index(int(minute("11:55").timestamp()))] == 305.0
    assert body["band"] == ["0.1", "0.9"] and body["quantiles"]["0.1"][9] is None  # the re-run has no band


def test_series_scores_p_any_against_the_minutes_with_an_invocation(client, engine, fleet_data):
    # one run a minute, later in the minute than fleet_data's (the later run wins); horizon 1 is its own minute
    p_any = [0.9, 0.8, 0.5, float("nan"), 1.0, 0.25, 0.7, 0.1, 0.6, 0.95]
    for i, p in enumerate(p_any):
        store_run(engine, "llama", T0 + timedelta(minutes=i, seconds=50), [10.0], p_any=[p])
    window = {"start": "2026-11-29T11:50:00Z", "end": "2026-11-29T12:00:00Z", "horizon": 1}
    body = client.get("/v1/models/llama/series", params=window).json()
    assert body["forecast"] == [10.0] * 10
    assert body["p_any"] == pytest.approx([0.9, 0.8, 0.5, None, 1.0, 0.25, 0.7, 0.1, 0.6, 0.95])  # 11:53: NaN
    # counts 10, 12, 0, 8, 20, 30, 25, 0, 5, 10 (11:52 a known zero); 11:53 has a point but no p_any
    scored = [(p, float(c > 0)) for p, c in zip(p_any, LLAMA_COUNTS) if p == p]
    error = body["error"]
    assert error["scored_minutes"] == 10 and error["p_any_minutes"] == 9
    assert error["brier_any"] == pytest.approx(sum((p - y) ** 2 for p, y in scored) / 9, rel=1e-6)
    assert error["p_any_mean"] == pytest.approx(sum(p for p, _ in scored) / 9, rel=1e-6)
    assert error["invoked_share"] == pytest.approx(7 / 9)


def test_series_of_a_model_without_data_is_all_unknown(client, fleet_data):
    body = client.get("/v1/models/phi/series", params={"start": "2026-11-29T11:00:00Z", "end": "2026-11-29T12:00Z",
                                                       "horizon": 5}).json()
    assert len(body["t"]) == 60 and set(body["actual"]) == {None} and set(body["forecast"]) == {None}
    assert body["quantiles"] == {} and body["band"] is None and set(body["p_any"]) == {None}
    assert body["error"] == {"scored_minutes": 0, "mae": None, "wmape": None, "band_coverage": None, **NO_P_ANY}


# --- cold starts and actions -------------------------------------------------------


def test_cold_starts_observed_only_and_says_no_prediction_is_stored(client, fleet_data, settings):
    window = {"start": "2026-11-29T11:50:00Z", "end": "2026-11-29T12:00:00Z"}
    body = client.get("/v1/models/llama/coldstarts", params=window).json()
    assert [(e["started_at"], e["total_seconds"], e["node_id"]) for e in body["observed"]] == [
        ("2026-11-29T11:52:00Z", 40.0, "n1"), ("2026-11-29T11:58:00Z", 60.0, "n1")]
    assert body["predicted"] == [] and body["predicted_stored"] is False and "observed only" in body["note"]
    # the lead time is the planner's. The catalogue gives no sizes and no version is trained yet (the model has
    # seen none of llama's starts): not the 0-byte physics prior (runtime start-up plus registration, ~12 s) but
    # PREWARM_DEFAULT_COLD_START_S, and the source says so
    assert (body["lead_time_source"], body["latency_model_version"], body["lead_time_start_state"]) == (
        "default", None, "none")
    assert body["lead_time_s"] == pytest.approx(PlannerSettings().lead(settings.default_cold_start_s))
    assert body["observed_median_s"] == 50.0  # median of 40, 50, 60, kept beside it
    quiet = client.get("/v1/models/mistral/coldstarts", params=window).json()
    assert quiet["observed"] == [] and quiet["observed_median_s"] is None
    assert quiet["lead_time_s"] == pytest.approx(PlannerSettings().lead(settings.default_cold_start_s))
    assert quiet["lead_time_source"] == "default"


def test_action_timeline_keeps_actions_overlapping_the_window(client, fleet_data):
    window = {"start": "2026-11-29T11:50:00Z", "end": "2026-11-29T12:00:00Z"}
    body = client.get("/v1/models/llama/actions", params=window).json()
    ids = fleet_data
    assert [a["id"] for a in body["data"]] == [ids["crosses_start"], ids["in_window"], ids["crosses_end"],
                                               ids["unplanned"]]
    assert body["count"] == 4
    first = body["data"][1]
    assert (first["kind"], first["status"], first["not_before"], first["deadline"], first["expected_benefit"]) == (
        "prepull", "succeeded", "2026-11-29T11:53:00Z", "2026-11-29T11:58:00Z", 40.0)
    limited = client.get("/v1/models/llama/actions", params={**window, "limit": 2}).json()
    assert len(limited["data"]) == 2 and limited["count"] == 4


# --- fleet -------------------------------------------------------------------------


def test_fleet_ranks_every_model_by_forecast_error(client, fleet_data):
    params = {"horizon": 6, "window_min": 10, "end": "2026-11-29T12:00:00Z"}
    body = client.get("/v1/fleet", params=params).json()
    assert (body["start"], body["end"], body["count"], body["sort"]) == (
        "2026-11-29T11:50:00Z", "2026-11-29T12:00:00Z", 3, "wmape")
    by_id = {r["model_id"]: r for r in body["data"]}
    assert [r["model_id"] for r in body["data"]] == ["llama", "mistral", "phi"]
    assert [r["rank"] for r in body["data"]] == [1, 2, 3]
    llama = by_id["llama"]
    assert llama["error"] == {"scored_minutes": 2, "mae": 127.5, "wmape": pytest.approx(255 / 55),
                              "band_coverage": None, **NO_P_ANY}
    assert (llama["actual_total"], llama["forecast_total"], llama["cold_starts"]) == (55.0, 310.0, 2)
    assert llama["replay"] is None  # no replay stored
    # planned in the window: 11:53 succeeded (40 s expected), 11:57 failed, 11:59 running; 11:45 and 11:20 not
    assert (llama["actions_total"], llama["actions_succeeded"], llama["actions_failed"],
            llama["expected_wait_avoided_s"]) == (3, 1, 1, 40.0)
    assert llama["last_forecast_at"] == "2026-11-29T11:51:10Z"
    assert by_id["mistral"]["error"] == {"scored_minutes": 1, "mae": 0.0, "wmape": 0.0, "band_coverage": None,
                                         **NO_P_ANY}
    assert by_id["phi"]["error"]["scored_minutes"] == 0 and by_id["phi"]["last_forecast_at"] is None

    h5 = client.get("/v1/fleet", params={**params, "horizon": 5}).json()["data"][0]
    assert h5["model_id"] == "llama" and h5["error"]["mae"] == 129.0  # |104-20| and |204-30|
    by_cold = client.get("/v1/fleet", params={**params, "sort": "cold_starts"}).json()["data"]
    assert by_cold[0]["model_id"] == "llama" and by_cold[0]["cold_starts"] == 2
    found = client.get("/v1/fleet", params={**params, "search": "MIS"}).json()
    assert found["count"] == 1 and found["data"][0]["model_id"] == "mistral" and found["data"][0]["rank"] == 2
    limited = client.get("/v1/fleet", params={**params, "limit": 1}).json()
    assert limited["count"] == 3 and len(limited["data"]) == 1


def test_fleet_defaults_to_the_hour_before_the_current_minute(client, fleet_data):
    body = client.get("/v1/fleet").json()
    assert (body["start"], body["end"], body["window_min"], body["horizon_min"], body["end_source"]) == (
        "2026-11-29T11:00:00Z", "2026-11-29T12:00:00Z", 60, 5, "now")
    assert (body["limit"], body["offset"]) == (50, 0)


def test_fleet_pages_cover_the_ranking_once_with_its_ranks(client, fleet_data):
    params = {"horizon": 6, "window_min": 10, "end": "2026-11-29T12:00:00Z"}
    whole = [r["model_id"] for r in client.get("/v1/fleet", params=params).json()["data"]]
    pages = [client.get("/v1/fleet", params={**params, "limit": 2, "offset": o}).json() for o in (0, 2, 4)]
    assert [p["count"] for p in pages] == [3, 3, 3]  # the total on every page, an empty one past the end too
    assert [r["model_id"] for p in pages for r in p["data"]] == whole == ["llama", "mistral", "phi"]
    assert [r["rank"] for p in pages for r in p["data"]] == [1, 2, 3] and pages[2]["data"] == []
    by_id = client.get("/v1/fleet", params={**params, "sort": "model_id", "limit": 1, "offset": 1}).json()
    assert [(r["model_id"], r["rank"]) for r in by_id["data"]] == [("mistral", 2)]
    # search keeps the rank in the whole fleet and counts the matches
    found = client.get("/v1/fleet", params={**params, "search": "i", "limit": 1, "offset": 1}).json()
    assert found["count"] == 2 and [(r["model_id"], r["rank"]) for r in found["data"]] == [("phi", 3)]


def test_later_pages_rank_over_the_first_pages_window(client, engine, fleet_data):
    """Without an end each request's window ends at its own now, and while the hour that just ended is not scored
    the error figures come from the hour before it: a later page asking the first page's end alone ranked over
    other hours. With the first page's end and error_end every page ranks over the same window."""
    score_hour(engine, hour=minute("10:00"), horizons_min=[5])  # 11:00 not scored yet: the first page follows 10:00
    first = client.get("/v1/fleet", params={"limit": 1}).json()
    assert (first["end"], first["error_start"], first["error_end"], first["error_source"]) == (
        "2026-11-29T12:00:00Z", "2026-11-29T10:00:00Z", "2026-11-29T11:00:00Z", "rollup")
    whole = client.get("/v1/fleet").json()
    pinned = {"end": first["end"], "error_end": first["error_end"]}
    pages = [client.get("/v1/fleet", params={**pinned, "limit": 1, "offset": o}).json() for o in (0, 1, 2)]
    assert [r for p in pages for r in p["data"]] == whole["data"] and pages[0]["data"] == first["data"]
    assert {(p["error_start"], p["error_end"], p["error_source"]) for p in pages} == {
        (first["error_start"], first["error_end"], "rollup")}
    # the end alone is another window: the runs of 11:00, where llama has scored minutes
    end_only = client.get("/v1/fleet", params={"end": first["end"]}).json()
    assert (end_only["error_end"], end_only["error_source"]) == ("2026-11-29T12:00:00Z", "runs")
    assert end_only["data"] != whole["data"]
    # the hour of end itself may be asked as well; anything else is refused, as is error_end without end
    same = client.get("/v1/fleet", params={"end": first["end"], "error_end": "2026-11-29T12:00:00Z"}).json()
    assert same["data"] == end_only["data"]
    for params, says in (({"error_end": first["error_end"]}, "needs end"),
                         ({"end": first["end"], "error_end": "2026-11-29T09:00:00Z"}, "error_end must be"),
                         ({"end": first["end"], "error_end": "2026-11-29T11:30:00Z"}, "error_end must be")):
        refused = client.get("/v1/fleet", params=params)
        assert refused.status_code == 422 and says in refused.text, (params, refused.text)


def test_fleet_search_finds_ids_whatever_their_letters(client, engine):
    """Both sides lower-cased by PostgreSQL: Python's lower() of the query disagreed with PostgreSQL's of the ids
    outside ASCII (a final sigma, the dotted capital I), and those ids were never found, even searched verbatim."""
    ids = ["llama-7b", "ΟΔΟΣ-7b", "İzmir-chat", "Straße-1b", "ǅemal-1b"]
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in ids])
    params = {"end": "2026-11-29T12:00:00Z", "sort": "model_id"}

    def found(q: str) -> list[str]:
        body = client.get("/v1/fleet", params={**params, "search": q}).json()
        assert body["count"] == len(body["data"])
        return [r["model_id"] for r in body["data"]]

    for model_id in ids:  # every id finds itself, verbatim and by a part of it
        assert found(model_id) == [model_id], model_id
        assert model_id in found(model_id[:4]), model_id
    assert found("ΟΔΟΣ-7b") == ["ΟΔΟΣ-7b"] and found("İzmir-chat") == ["İzmir-chat"]
    assert found("LLAMA") == ["llama-7b"] and found("-7B") == ["llama-7b", "ΟΔΟΣ-7b"]


def test_windows_follow_the_newest_data_when_nothing_recent_is_stored(engine, settings, tokens, fleet_data):
    """Served a month after the counts end (a 2019 trace served today): windows end at the newest count."""
    later = NOW + timedelta(days=30)
    with TestClient(create_app(settings, engine, clock=lambda: later)) as late:
        late.headers["Authorization"] = f"Bearer {tokens['read']}"
        fleet = late.get("/v1/fleet", params={"horizon": 6, "window_min": 10}).json()
        assert (fleet["end"], fleet["end_source"]) == ("2026-11-29T12:00:00Z", "newest_data")
        assert fleet["data"][0]["model_id"] == "llama" and fleet["data"][0]["error"]["scored_minutes"] == 2
        context = late.get("/v1/dashboard/context").json()
        assert (context["known_until"], context["default_end"], context["end_source"]) == (
            "2026-11-29T12:00:00Z", "2026-11-29T12:00:00Z", "newest_data")
        series = late.get("/v1/models/llama/series", params={"horizon": 6, "span_min": 20}).json()
        # after the last minute forecast 6 ahead from the newest count's end (12:00 + 5, exclusive 12:06)
        assert (series["start"], series["end"], series["end_source"]) == (
            "2026-11-29T11:46:00Z", "2026-11-29T12:06:00Z", "newest_data")
        assert series["forecast"][series["t"].index(int(minute("11:55").timestamp()))] == 105.0
        colds = late.get("/v1/models/llama/coldstarts").json()
        assert colds["end"] == "2026-11-29T12:01:00Z" and len(colds["observed"]) == 3
        actions = late.get("/v1/models/llama/actions").json()
        assert actions["end"] == "2026-11-29T13:01:00Z" and actions["count"] == 5
        # an explicit end (the page's date picker) is taken as given, even far from the data
        picked = late.get("/v1/fleet", params={"end": "2026-12-20T08:30:00Z"}).json()
        assert (picked["end"], picked["end_source"]) == ("2026-12-20T08:30:00Z", "request")
        assert all(r["error"]["scored_minutes"] == 0 for r in picked["data"])
    # with recent counts the wall clock leads: the hour before now's minute
    with TestClient(create_app(settings, engine, clock=lambda: NOW + timedelta(minutes=30))) as soon:
        soon.headers["Authorization"] = f"Bearer {tokens['read']}"
        body = soon.get("/v1/fleet").json()
        assert (body["end"], body["end_source"]) == ("2026-11-29T12:30:00Z", "now")


def test_offered_horizons_are_those_the_store_holds(client, engine, settings, fleet_data):
    stored = client.get("/v1/dashboard/context").json()
    assert stored["stored_horizon_min"] == 10 and stored["horizons_min"] == [1, 5, 10]  # the runs hold 10 minutes
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM forecasts"))
    none_stored = client.get("/v1/dashboard/context").json()  # the setting says what the job will store
    assert none_stored["stored_horizon_min"] == settings.forecast_horizon_min == 60
    assert none_stored["horizons_min"] == [1, 5, 10, 15, 30, 60]


def test_a_job_run_of_forecast_horizon_min_minutes_holds_that_horizon(client, engine, settings, fleet_data):
    """The off-by-one at its source: a run of PREWARM_FORECAST_HORIZON_MIN elements scores at that horizon."""
    h = settings.forecast_horizon_min
    issued = T0 - timedelta(minutes=h - 1, seconds=-5)  # its last element targets 11:50
    store_run(engine, "mistral", issued, [10.0] * h)
    body = client.get("/v1/fleet", params={"horizon": h, "window_min": 10, "end": "2026-11-29T12:00:00Z",
                                           "sort": "model_id"}).json()
    mistral = next(r for r in body["data"] if r["model_id"] == "mistral")
    assert mistral["error"]["scored_minutes"] == 1 and mistral["error"]["mae"] == 0.0
    over = client.get("/v1/fleet", params={"horizon": h + 1, "window_min": 10, "end": "2026-11-29T12:00:00Z",
                                           "search": "mistral"}).json()["data"][0]
    assert over["error"]["scored_minutes"] == 0  # one minute further than the run holds


# --- auth, validation, index -------------------------------------------------------


DASHBOARD_PATHS = ["/v1/fleet", "/v1/dashboard/context", "/v1/models/llama/series", "/v1/models/llama/coldstarts",
                   "/v1/models/llama/actions"]


@pytest.mark.parametrize("path", DASHBOARD_PATHS)
def test_dashboard_endpoints_need_a_read_token(client, tokens, fleet_data, path):
    assert client.get(path, headers={"Authorization": ""}).status_code == 401
    assert client.get(path, headers={"Authorization": "Bearer pw_nope"}).status_code == 401
    refused = client.get(path, headers={"Authorization": f"Bearer {tokens['ingest']}"})
    assert refused.status_code == 403 and "read" in refused.json()["detail"]
    assert client.get(path).status_code == 200


@pytest.mark.parametrize(("path", "params", "status", "says"), [
    ("/v1/models/nope/series", {}, 404, "not registered"),
    ("/v1/models/nope/coldstarts", {}, 404, "not registered"),
    ("/v1/models/nope/actions", {}, 404, "not registered"),
    ("/v1/models/llama/series", {"start": "2026-11-29T12:00:00Z", "end": "2026-11-29T12:00:00Z"}, 422, "before end"),
    ("/v1/models/llama/series", {"start": "2026-10-01T00:00:00Z", "end": "2026-11-29T00:00:00Z"}, 422, "31 days"),
    ("/v1/models/llama/actions", {"start": "0001-01-01T00:00:00Z"}, 422, "between 1970 and 2200"),
    ("/v1/models/llama/series", {"horizon": -1}, 422, None),
    ("/v1/models/llama/series", {"horizon": 0}, 422, None),  # horizon 1 is the issuing minute
    ("/v1/fleet", {"horizon": 0}, 422, None),
    ("/v1/fleet", {"end": "2200-01-01T00:00:00Z"}, 422, "between 1970 and 2200"),
    ("/v1/fleet", {"end": "1969-12-31T23:59:00Z"}, 422, "between 1970 and 2200"),
    ("/v1/fleet", {"end": "2026-12-01T12:00:00Z"}, 422, "more than a day after now"),
    ("/v1/models/llama/series", {"end": "2027-01-01T00:00:00Z"}, 422, "more than a day after now"),
    ("/v1/models/llama/actions", {"end": "2026-12-25T00:00:00Z"}, 422, "more than a day after now"),
    ("/v1/fleet", {"end": "yesterday-ish"}, 422, None),
    ("/v1/fleet", {"limit": 0}, 422, None),
    ("/v1/fleet", {"limit": 1001}, 422, None),
    ("/v1/fleet", {"offset": -1}, 422, None),
    ("/v1/fleet", {"search": "a\x00b"}, 422, "control character"),
    ("/v1/fleet", {"window_min": 0}, 422, None),
    ("/v1/fleet", {"sort": "random"}, 422, None),
])
def test_bad_requests_are_answered_with_4xx(client, fleet_data, path, params, status, says):
    response = client.get(path, params=params)
    assert response.status_code == status
    if says:
        assert says in response.json()["detail"]


def test_series_read_scans_the_primary_key(engine, fleet_data):
    """The forecasts made h minutes ahead of a window are one primary-key range scan of the model's runs."""
    from forecaster.store.dashboard import _SERIES_SQL, _issued_bounds

    others = [f"model-{i:03d}" for i in range(300)]  # a fleet: the issued_at index alone would read all of it
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in others])
    for k in range(15):
        issued = T0 - timedelta(minutes=5) + k * timedelta(minutes=1)
        write_forecasts(engine, pd.DataFrame({"unique_id": [m for m in others for _ in range(60)],
                                              "ds": list(pd.date_range(issued, periods=60, freq="min")) * 300,
                                              "point": 1.0}), issued_at=issued, model_version_id=None)
    with engine.connect() as conn:
        conn.execute(text("ANALYZE forecasts"))
        conn.execute(text("SET enable_seqscan = off"))
        plan = "\n".join(conn.exec_driver_sql("EXPLAIN " + _SERIES_SQL, {
            "m": "llama", "h": 5, "s": T0, "e": NOW, **_issued_bounds(T0, NOW, 5)}).scalars())
    assert "forecasts_20261129_pkey" in plan, plan


# --- the page ----------------------------------------------------------------------


def test_dashboard_page_and_uplot_are_served_from_the_package(client):
    moved = client.get("/dashboard", follow_redirects=False)
    assert moved.status_code in (301, 307) and moved.headers["location"].endswith("/dashboard/")
    page = client.get("/dashboard/", headers={"Authorization": ""})  # static files need no token
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    references = re.findall(r'(?:src|href)="([^"#]+)"', page.text)
    assert {"vendor/uplot/uPlot.iife.min.js", "vendor/uplot/uPlot.min.css", "dashboard.js", "dashboard.css"} <= \
        set(references)
    for ref in references:  # every asset is served by the app itself: nothing from a CDN
        assert not ref.startswith(("http:", "https:", "//")), ref
        if ref.startswith("data:"):
            continue  # inline (the empty favicon)
        assert client.get(f"/dashboard/{ref}").status_code == 200, ref
    script = client.get("/dashboard/dashboard.js").text
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", script)
    assert "MIT" in client.get("/dashboard/vendor/uplot/LICENSE").text


def test_band_is_the_central_one_when_the_sizing_levels_are_stored():
    import numpy as np

    from forecaster.store.dashboard import ForecastSeries

    def series(levels):
        zeros = np.zeros(3)
        return ForecastSeries(model_id="m", start=T0, end=T0, horizon_min=1, minutes=zeros, actual=zeros,
                              point=zeros, quantiles={level: zeros for level in levels})

    assert series(["0.1", "0.5", "0.9", "0.95", "0.99"]).band == ("0.1", "0.9")  # not 0.1 .. 0.99
    assert series(["0.5", "0.99"]).band == ("0.5", "0.99")  # no mirrored pair: the widest
    assert series(["0.9"]).band is None


def test_a_database_error_under_the_series_raw_cursor_is_answered_not_a_500(client, fleet_data, monkeypatch):
    """The model page reads its forecasts through a raw psycopg cursor: an error there (a statement timeout, a
    dropped connection) was a psycopg error the API's handlers did not know, so a 500. It is SQLAlchemy's now,
    answered as any database error is."""
    from forecaster.store import dashboard

    monkeypatch.setattr(dashboard, "_SERIES_SQL", "SELECT 1 / (%(h)s - %(h)s)")
    response = client.get("/v1/models/llama/series", params={"start": "2026-11-29T10:00:00Z",
                                                               "end": "2026-11-29T11:00:00Z", "horizon": 5})
    assert response.status_code == 422, response.text  # SQLSTATE class 22, as for any statement
    assert response.json()["reason"] == "value_out_of_range" and "22012" in response.json()["detail"]
