"""The forecast-error rollup against a real PostgreSQL: equal to the direct computation, idempotent, re-scored on
late counts, and what the fleet endpoint's error sorts read."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.main import create_app
from forecaster.ingest.service import push_counts
from forecaster.jobs.error_scoring import score_errors_job
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.dashboard import P_ANY_BAND_EDGES, p_any_band_names, read_fleet_page, read_forecast_series
from forecaster.store.forecast_errors import hours_due, score_hour
from forecaster.store.forecasts import write_forecasts
from forecaster.store.tokens import create_token

HOURS = [datetime(2026, 11, 29, h, tzinfo=timezone.utc) for h in (10, 11, 12)]
FIRST_RUN = datetime(2026, 11, 29, 9, 0, 10, tzinfo=timezone.utc)
LAST_RUN = datetime(2026, 11, 29, 12, 59, 10, tzinfo=timezone.utc)
NOW = datetime(2026, 11, 29, 13, 10, tzinfo=timezone.utc)
MODELS = [f"m{i}" for i in range(8)]
HORIZONS = [1, 5, 10, 15, 30, 60]
MIN = timedelta(minutes=1)


def run_frame(models: list[str], issued_at: datetime, points: np.ndarray, first_offset_min: int = 0,
              with_p_any: bool = True) -> pd.DataFrame:
    """Runs of ``models`` issued at ``issued_at``: row i's elements from the issuing minute (+ offset) on.

    ``p_any`` (with ``with_p_any``) is a quarter from 0 to 1 made from the point, NaN (unknown) for every
    seventh quarter-step of it: exact as real, so the rollup's sums equal the direct ones exactly.
    """
    first = pd.Timestamp(issued_at).floor("min") + pd.Timedelta(minutes=first_offset_min)
    steps = points.shape[1]
    frame = pd.DataFrame({"unique_id": np.repeat(models, steps),
                          "ds": np.tile(pd.date_range(first, periods=steps, freq="min"), len(models)),
                          "point": points.reshape(-1)})
    frame["q0.1"], frame["q0.9"] = (frame["point"] - 5).clip(lower=0.0), frame["point"] + 5
    if with_p_any:
        quarters = np.rint(frame["point"].to_numpy() * 4).astype(np.int64)
        frame["p_any"] = np.where(quarters % 7 == 0, np.nan, (quarters % 5) / 4)
    return frame


@pytest.fixture
def store(engine, settings):
    """Eight models, counts 10:00-13:00 with gaps, a run per model and minute 09:00-12:59, and the edge cases:
    two runs in one minute (the later wins; a later short one loses the horizons it does not reach), runs whose
    first element is a minute after their issuing minute, 5-minute coverage (unknown at a 1-minute step), a
    model with no runs and one with no counts."""
    rng = np.random.default_rng(16)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in MODELS])
    rows = []
    for i, model in enumerate(MODELS[:7]):
        start, end = (HOURS[0] + 20 * MIN, HOURS[1] + 40 * MIN) if model == "m3" else (HOURS[0], NOW - 10 * MIN)
        minutes = pd.date_range(start, end, freq="min", inclusive="left")
        counts = rng.integers(0, 40, len(minutes)) * (i % 3)  # m0, m3, m6 all zeros: wMAPE undefined
        rows += [{"model_id": model, "minute": t.isoformat(), "count": int(c)}
                 for t, c in zip(minutes, counts) if c or rng.random() < 0.3]  # zeros left out inside the window
    push_counts(engine, settings, rows, now=NOW)
    with engine.begin() as conn:  # m4: a 5-minute source over 09:00-10:30 (unknown at a 1-minute step)
        conn.execute(text("INSERT INTO coverage (model_id, source, step_seconds, ranges) VALUES ('m4', 'coarse', 300, "
                          "tstzmultirange(tstzrange('2026-11-29T09:00Z', '2026-11-29T10:30Z', '[)')))"))
    runners = MODELS[:6] + ["m7"]  # m6 has counts but no runs; m7 runs but no counts
    issued = FIRST_RUN
    while issued <= LAST_RUN:
        points = np.round(rng.uniform(0, 60, (len(runners), 60)) * 4) / 4  # quarters: exact as real
        offset_rows = [1] if issued.minute % 7 == 0 else []  # m1: first element a minute after issuing
        plain = [r for j, r in enumerate(runners) if j not in offset_rows]
        write_forecasts(engine, run_frame(plain, issued, points[[j for j in range(len(runners))
                                                                  if j not in offset_rows]]),
                        issued_at=issued, model_version_id=None)
        if offset_rows:
            write_forecasts(engine, run_frame(["m1"], issued + timedelta(seconds=1), points[offset_rows], 1,
                                              with_p_any=False),
                            issued_at=issued + timedelta(seconds=1), model_version_id=None)
        issued += MIN
    later = HOURS[1] + 30 * MIN + timedelta(seconds=40)  # a second m0 run at 11:30, later in the minute
    write_forecasts(engine, run_frame(["m0", "m2"], later, np.full((2, 60), 99.5)), issued_at=later,
                    model_version_id=None)
    short = HOURS[0] + 15 * MIN + timedelta(seconds=50)  # a later but shorter m2 run at 10:15: horizons 1..10
    write_forecasts(engine, run_frame(["m2"], short, np.full((1, 10), 7.25)), issued_at=short, model_version_id=None)


def page(conn, *, horizon: int, window_min: int, end: datetime, sort: str = "wmape", **kw):
    return read_fleet_page(conn, end=end, window_min=window_min, horizon_min=horizon, sort=sort, limit=100, **kw)


def figures(result) -> list[tuple]:
    return [(r.model_id, r.rank, r.error.scored_minutes, r.error.mae, r.error.wmape, r.actual_total,
             r.forecast_total, r.error.p_any_minutes, r.error.brier_any, r.error.p_any_mean, r.error.invoked_share)
            for r in result.rows]


def test_rollup_ranking_equals_the_direct_computation(engine, store):
    cases = [(h, window, end, sort) for h in HORIZONS for window, end in ((60, HOURS[2]), (120, NOW), (180, NOW))
             for sort in ("wmape", "mae", "brier_any")]
    with engine.connect() as conn:
        direct = {case: page(conn, horizon=case[0], window_min=case[1], end=case[2], sort=case[3]) for case in cases}
    assert {p.error_source for p in direct.values()} == {"runs"}  # nothing scored yet
    for hour in HOURS:
        score_hour(engine, hour=hour, horizons_min=HORIZONS)
    with engine.connect() as conn:
        for case in cases:
            rolled = page(conn, horizon=case[0], window_min=case[1], end=case[2], sort=case[3])
            assert rolled.error_source == "rollup", case
            assert (rolled.error_start, rolled.error_end) == (direct[case].error_start, direct[case].error_end)
            assert figures(rolled) == figures(direct[case]), case  # quarters and counts: exact sums
    sample = direct[(5, 120, NOW, "wmape")]
    assert (sample.error_start, sample.error_end) == (HOURS[1], NOW.replace(minute=0))  # 11:00-13:00 whole hours
    by_id = {r.model_id: r for r in sample.rows}
    assert by_id["m0"].error.wmape is None and by_id["m0"].error.scored_minutes > 0  # zero actuals
    assert by_id["m6"].error.scored_minutes == 0 and by_id["m7"].error.scored_minutes == 0
    assert 0 < by_id["m3"].error.scored_minutes <= 40  # covered until 11:40 at most
    order = [r.model_id for r in sample.rows]  # no wMAPE (zero actuals, nothing scored): last, by MAE, then id
    assert set(order[-4:-2]) == {"m0", "m3"} and order[-2:] == ["m6", "m7"]
    # ranked by p_any's Brier score: worst first, models without a scored p_any last
    brier = [r.error.brier_any for r in direct[(5, 120, NOW, "brier_any")].rows]
    known = [b for b in brier if b is not None]
    assert len(known) == 6 and known == sorted(known, reverse=True) and brier[6:] == [None, None]
    # p_any: unknown elements and m1's runs without it are left out of its figures only
    assert 0 < by_id["m1"].error.p_any_minutes < by_id["m1"].error.scored_minutes
    assert by_id["m0"].error.invoked_share == 0.0 and by_id["m7"].error.brier_any is None
    # the model page's series (numpy over the same minutes) reads the fleet's figures for one model and hour
    fleet = {r.model_id: r for r in direct[(5, 60, HOURS[2], "wmape")].rows}["m5"].error
    with engine.connect() as conn:
        series = read_forecast_series(conn, model_id="m5", start=HOURS[1], end=HOURS[2], horizon_min=5).error()
    assert 0 < fleet.p_any_minutes < fleet.scored_minutes == series.scored_minutes
    assert (series.p_any_minutes, series.mae) == (fleet.p_any_minutes, pytest.approx(fleet.mae))
    assert (series.brier_any, series.p_any_mean, series.invoked_share) == pytest.approx(
        (fleet.brier_any, fleet.p_any_mean, fleet.invoked_share))


def test_scoring_an_hour_again_replaces_it(engine, store):
    first = score_hour(engine, hour=HOURS[1], horizons_min=HORIZONS)
    with engine.connect() as conn:
        before = conn.execute(text("SELECT * FROM forecast_errors ORDER BY horizon_min, model_id")).all()
    again = score_hour(engine, hour=HOURS[1], horizons_min=HORIZONS)
    with engine.connect() as conn:
        after = conn.execute(text("SELECT * FROM forecast_errors ORDER BY horizon_min, model_id")).all()
        hours = conn.execute(text("SELECT hour, horizons_min, models FROM forecast_error_hours")).all()
    assert after == before and len(after) == first.rows == again.rows
    # m1, m2, m4, m5 (and m0, m3 with zero actuals) scored at each horizon; m6 has no runs, m7 no counts
    assert first.rows == 6 * len(HORIZONS) and first.models == 6
    assert hours == [(HOURS[1], HORIZONS, 6)]
    assert first.runs_read > 0
    with pytest.raises(ValueError, match="whole UTC hour"):
        score_hour(engine, hour=HOURS[1] + MIN, horizons_min=HORIZONS)


def test_the_job_scores_due_hours_once_and_late_counts_again(engine, settings, store):
    settings = settings.model_copy(update={"error_rollup_lookback_h": 4, "error_rollup_delay_s": 180})
    with engine.connect() as conn:  # 13:00 ended 10 minutes ago: 12:00 is due, 13:00 is not
        assert hours_due(conn, now=NOW, delay_s=180, lookback_h=4, horizons_min=HORIZONS, limit=10) == [
            HOURS[2], HOURS[1], HOURS[0], HOURS[0] - timedelta(hours=1)]
        assert hours_due(conn, now=HOURS[2] + timedelta(hours=1, seconds=179), delay_s=180, lookback_h=4,
                         horizons_min=HORIZONS, limit=10)[0] == HOURS[1]
    done = score_errors_job(engine, settings, NOW, max_hours=3)
    assert [s["hour"] for s in done["scored"]] == [h.isoformat() for h in reversed(HOURS)]
    assert done["horizons_min"] == HORIZONS
    rest = score_errors_job(engine, settings, NOW, max_hours=3)
    assert [s["hour"] for s in rest["scored"]] == [(HOURS[0] - timedelta(hours=1)).isoformat()]
    assert score_errors_job(engine, settings, NOW)["scored"] == []  # all scored: nothing to do
    # late, corrected counts for m1 in 11:10-11:20: only 11:00 is re-scored, and equals the direct figures again
    push_counts(engine, settings, [{"model_id": "m1", "minute": (HOURS[1] + (10 + k) * MIN).isoformat(), "count": 500}
                                   for k in range(10)], now=NOW)
    with engine.connect() as conn:
        stale = page(conn, horizon=5, window_min=60, end=HOURS[2])
        assert hours_due(conn, now=NOW, delay_s=180, lookback_h=4, horizons_min=HORIZONS, limit=10) == [HOURS[1]]
    assert [s["hour"] for s in score_errors_job(engine, settings, NOW)["scored"]] == [HOURS[1].isoformat()]
    with engine.begin() as conn:
        fresh = page(conn, horizon=5, window_min=60, end=HOURS[2])
        conn.execute(text("DELETE FROM forecast_error_hours"))  # the rollup gone: the runs, the same figures
        direct = page(conn, horizon=5, window_min=60, end=HOURS[2])
    assert (stale.error_source, fresh.error_source, direct.error_source) == ("rollup", "rollup", "runs")
    m1 = {r.model_id: r for r in fresh.rows}["m1"]
    assert m1.actual_total > {r.model_id: r for r in stale.rows}["m1"].actual_total
    assert figures(fresh) == figures(direct)


def test_a_changed_horizon_set_rescores(engine, store):
    score_hour(engine, hour=HOURS[2], horizons_min=[1, 5])
    with engine.connect() as conn:
        assert hours_due(conn, now=NOW, delay_s=180, lookback_h=1, horizons_min=[1, 5], limit=5) == []
        assert hours_due(conn, now=NOW, delay_s=180, lookback_h=1, horizons_min=HORIZONS, limit=5) == [HOURS[2]]
        assert page(conn, horizon=5, window_min=60, end=NOW).error_source == "rollup"
        assert page(conn, horizon=10, window_min=60, end=NOW).error_source == "runs"  # not scored at 10


def test_the_fleet_endpoint_ranks_errors_from_the_rollup(engine, settings, store):
    for hour in HOURS:
        score_hour(engine, hour=hour, horizons_min=HORIZONS)
    token = create_token(engine, name="read", scopes=["read"])
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        params = {"horizon": 5, "window_min": 60, "end": "2026-11-29T12:37:00Z"}
        body = client.get("/v1/fleet", params=params).json()
        assert (body["error_source"], body["error_start"], body["error_end"]) == (
            "rollup", "2026-11-29T11:00:00Z", "2026-11-29T12:00:00Z")
        assert (body["start"], body["end"]) == ("2026-11-29T11:37:00Z", "2026-11-29T12:37:00Z")
        assert body["data"][3]["error"]["wmape"] is not None and body["data"][4]["error"]["wmape"] is None
        last = body["data"][3]["model_id"]  # the lowest ranked model with a wMAPE
        with engine.begin() as conn:  # the ranking follows the rollup's rows, not the runs
            conn.execute(text("UPDATE forecast_errors SET abs_error = abs_error + 1e9 WHERE model_id = :m "
                              "AND horizon_min = 5 AND hour = :h"), {"m": last, "h": HOURS[1]})
        moved = client.get("/v1/fleet", params=params).json()
        assert moved["data"][0]["model_id"] == last and moved["data"][0]["error"]["wmape"] > 1e4
        paged = client.get("/v1/fleet", params={**params, "limit": 2, "offset": 2}).json()
        assert [r["rank"] for r in paged["data"]] == [3, 4] and paged["count"] == len(MODELS)
        assert [r["model_id"] for r in paged["data"]] == [r["model_id"] for r in moved["data"][2:4]]
        unscored = client.get("/v1/fleet", params={**params, "horizon": 7}).json()
        assert unscored["error_source"] == "runs"
        # no end given at 13:00:30 with 12:00-13:00 not scored yet: the errors are those of 11:00-12:00
    with TestClient(create_app(settings, engine, clock=lambda: HOURS[2] + timedelta(hours=1, seconds=30))) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM forecast_error_hours WHERE hour = :h"), {"h": HOURS[2]})
        body = client.get("/v1/fleet", params={"horizon": 5}).json()
        assert (body["end"], body["error_start"], body["error_end"], body["error_source"]) == (
            "2026-11-29T13:00:00Z", "2026-11-29T11:00:00Z", "2026-11-29T12:00:00Z", "rollup")
        asked = client.get("/v1/fleet", params={"horizon": 5, "end": "2026-11-29T13:00:00Z"}).json()
        assert (asked["error_start"], asked["error_source"]) == ("2026-11-29T12:00:00Z", "runs")


def _gauges(client) -> dict[tuple, float]:
    """/metrics' forecast-error samples: (name, horizon_min label) -> value; (name, horizon_min, p_any_band) for
    the bands."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, s.labels.get("horizon_min"), *([s.labels["p_any_band"]] if "p_any_band" in s.labels else [])):
            s.value
            for family in text_string_to_metric_families(client.get("/metrics").text)
            if family.name.startswith(("prewarm_forecast_error", "prewarm_forecast_wmape", "prewarm_forecast_p_any",
                                       "prewarm_forecast_invoked"))
            for s in family.samples}


def test_metrics_export_the_fleets_error_over_the_newest_scored_hour(engine, settings, store):
    """The gauges the forecast alerts read pool every model of the newest scored hour, as the runs give them."""
    with engine.begin() as conn:  # m1's p_any a 64th and m2's an 8th of the fixture's (exact): other p_any bands
        for model, divisor in (("m1", 64), ("m2", 8)):
            conn.execute(text("UPDATE forecasts SET p_any = (SELECT array_agg(x / :d ORDER BY k) "
                              "FROM unnest(p_any) WITH ORDINALITY AS u(x, k)) WHERE model_id = :m AND p_any IS NOT NULL"),
                         {"m": model, "d": divisor})
    with engine.connect() as conn:  # the direct computation from the runs, per model, 12:00-13:00
        direct = {h: page(conn, horizon=h, window_min=60, end=NOW).rows for h in HORIZONS}
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        assert _gauges(client) == {}  # nothing scored: no figure, not a 0
        for hour in HOURS:
            score_hour(engine, hour=hour, horizons_min=HORIZONS)
        gauges = _gauges(client)
        assert gauges[("prewarm_forecast_error_hour_timestamp_seconds", None)] == HOURS[2].timestamp()
        for h, rows in direct.items():
            scored = [r.error for r in rows if r.error.scored_minutes]
            with_p = [e for e in scored if e.p_any_minutes]
            abs_error = sum(e.mae * e.scored_minutes for e in scored)
            p_minutes = sum(e.p_any_minutes for e in with_p)
            assert gauges[("prewarm_forecast_error_models", str(h))] == len(scored) == 5  # m3's counts end at 11:40
            assert gauges[("prewarm_forecast_wmape", str(h))] == pytest.approx(
                abs_error / sum(r.actual_total for r in rows))
            for name, field in (("prewarm_forecast_p_any_brier", "brier_any"), ("prewarm_forecast_p_any_mean",
                                                                                "p_any_mean"),
                                ("prewarm_forecast_invoked_share", "invoked_share")):
                assert gauges[(name, str(h))] == pytest.approx(
                    sum(getattr(e, field) * e.p_any_minutes for e in with_p) / p_minutes), (name, h)
            # p_any's reliability per band of each model's mean p_any over the hour
            edges = (0.0, *P_ANY_BAND_EDGES, float("inf"))
            for band, lo, hi in zip(p_any_band_names(), edges[:-1], edges[1:]):
                mine = [e for e in with_p if lo <= e.p_any_mean < hi]
                key = ("prewarm_forecast_p_any_band_minutes", str(h), band)
                if not mine:
                    assert key not in gauges
                    continue
                minutes = sum(e.p_any_minutes for e in mine)
                assert gauges[key] == minutes
                for name, field in (("prewarm_forecast_p_any_band_mean", "p_any_mean"),
                                    ("prewarm_forecast_p_any_band_invoked_share", "invoked_share")):
                    assert gauges[(name, str(h), band)] == pytest.approx(
                        sum(getattr(e, field) * e.p_any_minutes for e in mine) / minutes), (name, h, band)
            assert {k[2] for k in gauges if len(k) == 3 and k[1] == str(h)} <= set(p_any_band_names())
        assert len({k[2] for k in gauges if len(k) == 3}) >= 3  # m1, m2 and the rest in three bands
        # read once per scored hour: a changed row shows only once the hour is scored again
        with engine.begin() as conn:
            conn.execute(text("UPDATE forecast_errors SET abs_error = abs_error + 1e6 WHERE hour = :h"),
                         {"h": HOURS[2]})
        assert _gauges(client) == gauges
        with engine.begin() as conn:
            conn.execute(text("UPDATE forecast_error_hours SET scored_at = scored_at + interval '1 second' "
                              "WHERE hour = :h"), {"h": HOURS[2]})
        assert _gauges(client)[("prewarm_forecast_wmape", "5")] > 100 > gauges[("prewarm_forecast_wmape", "5")]
