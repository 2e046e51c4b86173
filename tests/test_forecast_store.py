"""The forecast store: one row per model and run (arrays), daily partitions, retention, and migration 0005."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.db import downgrade, make_engine, upgrade
from forecaster.store.forecasts import (
    forecast_partitions,
    latest_forecast,
    maintain_forecast_partitions,
    read_newest_runs,
    write_forecast_arrays,
    write_forecasts,
)

NOW = datetime(2026, 11, 29, 12, 0, 30, tzinfo=timezone.utc)
MINUTE = timedelta(minutes=1)


def run_frame(model_id: str, first: datetime, points: list[float], *, p_any: float | None = 0.5,
              band: float = 10.0) -> pd.DataFrame:
    frame = pd.DataFrame({"unique_id": model_id, "ds": pd.date_range(first, periods=len(points), freq="min"),
                          "point": points})
    if p_any is not None:
        frame["p_any"] = p_any
    frame["q0.1"] = (frame["point"] - band).clip(lower=0.0)  # the store refuses negative values
    frame["q0.5"] = frame["point"]
    frame["q0.9"] = frame["point"] + band
    return frame


@pytest.fixture
def models(engine):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in ("llama", "mistral", "phi")])
    return engine


def rows(engine, sql: str = "SELECT model_id, issued_at FROM forecasts ORDER BY 1, 2", **params) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql), params).all()]


def test_round_trip_one_row_per_model_and_run(models):
    first = NOW.replace(second=0)
    frame = pd.concat([run_frame("llama", first, [100.0 + k for k in range(60)]),
                       run_frame("mistral", first, [5.0] * 60, p_any=None)])
    frame = frame.sample(frac=1.0, random_state=3)  # any row order
    written = write_forecasts(models, frame, issued_at=NOW, model_version_id=None)
    assert written == 120  # target minutes
    assert rows(models) == [("llama", NOW), ("mistral", NOW)]
    stored = rows(models, "SELECT first_target, step_seconds, cardinality(point), quantile_levels, "
                          "array_length(quantiles, 1), array_length(quantiles, 2), p_any IS NULL "
                          "FROM forecasts ORDER BY model_id")
    assert stored == [(first, 60, 60, [0.1, 0.5, 0.9], 3, 60, False), (first, 60, 60, [0.1, 0.5, 0.9], 3, 60, True)]

    with models.connect() as conn:
        llama = latest_forecast(conn, model_id="llama", horizon_min=5)
        mistral = latest_forecast(conn, model_id="mistral")
        assert latest_forecast(conn, model_id="phi") is None
    assert llama.issued_at == NOW and llama.model_version_id is None
    assert list(llama.frame.columns) == ["target_minute", "point", "p_any", "q0.1", "q0.5", "q0.9"]
    assert [t.astimezone(timezone.utc) for t in llama.frame["target_minute"]] == [first + k * MINUTE
                                                                                  for k in range(5)]
    assert llama.frame["point"].tolist() == [100.0, 101.0, 102.0, 103.0, 104.0]
    assert llama.frame["q0.9"].tolist() == [110.0, 111.0, 112.0, 113.0, 114.0]
    assert llama.frame["p_any"].tolist() == [0.5] * 5
    assert len(mistral.frame) == 60 and mistral.frame["p_any"].isna().all()


def test_rewriting_the_same_issued_at_replaces_the_run(models):
    first = NOW.replace(second=0)
    write_forecasts(models, pd.concat([run_frame("llama", first, [1.0] * 60), run_frame("mistral", first, [2.0] * 60)]),
                    issued_at=NOW, model_version_id=None)
    write_forecasts(models, run_frame("llama", first, [7.0] * 30), issued_at=NOW, model_version_id=None)
    write_forecasts(models, run_frame("llama", first, [9.0] * 60), issued_at=NOW - MINUTE, model_version_id=None)
    assert rows(models) == [("llama", NOW - MINUTE), ("llama", NOW), ("mistral", NOW)]
    with models.connect() as conn:
        llama = latest_forecast(conn, model_id="llama")
        mistral = latest_forecast(conn, model_id="mistral")
    assert llama.frame["point"].tolist() == [7.0] * 30  # the re-run, not the first write
    assert mistral.frame["point"].tolist() == [2.0] * 60  # a model the re-run left out keeps its run


@pytest.mark.parametrize(("gap", "says"), [
    (lambda f: f.drop(index=f.index[(f["unique_id"] == "mistral")][10]), "'mistral'"),
    (lambda f: f.assign(ds=f["ds"].where(f["unique_id"] != "mistral", f["ds"] + pd.Timedelta(seconds=30))),
     "'mistral'"),
    (lambda f: pd.concat([f, f[f["unique_id"] == "mistral"].head(1)]), "'mistral'"),
])
def test_non_consecutive_target_minutes_are_rejected_naming_the_model(models, gap, says):
    first = NOW.replace(second=0)
    frame = pd.concat([run_frame("llama", first, [1.0] * 60), run_frame("mistral", first, [2.0] * 60)],
                      ignore_index=True)
    with pytest.raises(ValueError, match=says):
        write_forecasts(models, gap(frame), issued_at=NOW, model_version_id=None)
    assert rows(models) == []
    with models.connect() as conn:
        assert forecast_partitions(conn) == {}  # nothing written, not even DDL


def test_nan_is_rejected(models):
    frame = run_frame("llama", NOW.replace(second=0), [1.0] * 60)
    frame.loc[3, "q0.9"] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        write_forecasts(models, frame, issued_at=NOW, model_version_id=None)
    assert rows(models) == []


def test_write_creates_the_partition_of_the_issuing_day(models):
    first = NOW.replace(second=0)
    write_forecasts(models, run_frame("llama", first, [1.0] * 60), issued_at=NOW, model_version_id=None)
    yesterday = NOW - timedelta(days=1)
    write_forecasts(models, run_frame("llama", yesterday.replace(second=0), [1.0] * 60), issued_at=yesterday,
                    model_version_id=None)
    with models.connect() as conn:
        assert sorted(forecast_partitions(conn).values()) == ["forecasts_20261128", "forecasts_20261129"]
        located = conn.execute(text("SELECT tableoid::regclass::text FROM forecasts ORDER BY issued_at")).scalars()
        assert list(located) == ["forecasts_20261128", "forecasts_20261129"]


def test_maintenance_drops_only_partitions_past_retention(models):
    for days_ago in (5, 3, 2, 1, 0):
        issued = NOW - timedelta(days=days_ago)
        write_forecasts(models, run_frame("llama", issued.replace(second=0), [float(days_ago)] * 60),
                        issued_at=issued, model_version_id=None)
    result = maintain_forecast_partitions(models, now=NOW, days_ahead=2, retention_days=2)
    # with 2 days kept at 12:00 on the 29th: the 26th ended at 00:00 on the 27th (60 h ago) and goes;
    # the 27th ended 36 h ago and stays
    assert result == {"created": ["forecasts_20261130", "forecasts_20261201"],
                      "dropped": ["forecasts_20261124", "forecasts_20261126"], "skipped": []}
    with models.connect() as conn:
        assert sorted(forecast_partitions(conn).values()) == [
            "forecasts_20261127", "forecasts_20261128", "forecasts_20261129", "forecasts_20261130",
            "forecasts_20261201"]
        assert latest_forecast(conn, model_id="llama").frame["point"].tolist() == [0.0] * 60
    assert [r[1] for r in rows(models)] == [NOW - timedelta(days=d) for d in (2, 1, 0)]
    again = maintain_forecast_partitions(models, now=NOW, days_ahead=2, retention_days=2)
    assert again == {"created": [], "dropped": [], "skipped": []}


def test_newest_runs_as_arrays_per_model_and_cut_to_a_window(models):
    first = NOW.replace(second=0)
    write_forecasts(models, pd.concat([run_frame("llama", first - MINUTE, [1.0] * 60),
                                       run_frame("mistral", first - MINUTE, [2.0] * 60)]),
                    issued_at=NOW - MINUTE, model_version_id=None)
    write_forecasts(models, run_frame("llama", first, [float(k) for k in range(60)], p_any=0.25),
                    issued_at=NOW, model_version_id=None)
    with models.connect() as conn:
        newest = read_newest_runs(conn)
        since = read_newest_runs(conn, issued_after=NOW - MINUTE)
        cut = read_newest_runs(conn, issued_at_most=NOW, targets_from=first + 2 * MINUTE,
                               targets_before=first + 5 * MINUTE, with_p_any=True)
    by_model = dict(zip(newest.model_ids, range(len(newest))))
    assert set(by_model) == {"llama", "mistral"}
    i = by_model["llama"]
    assert newest.issued_at_s[i] == NOW.timestamp() and newest.first_target_s[i] == first.timestamp()
    assert newest.point[newest.offsets[i]:newest.offsets[i + 1]].tolist() == [float(k) for k in range(60)]
    assert newest.levels[i] == (0.1, 0.5, 0.9) and newest.quantiles(i).shape == (60, 3)
    assert newest.quantiles(i)[7].tolist() == [0.0, 7.0, 17.0]
    assert since.model_ids == ["llama"]
    j = cut.model_ids.index("llama")
    assert cut.first_target_s[j] == (first + 2 * MINUTE).timestamp()
    assert cut.point[cut.offsets[j]:cut.offsets[j + 1]].tolist() == [2.0, 3.0, 4.0]
    assert cut.p_any[cut.offsets[j]:cut.offsets[j + 1]].tolist() == [0.25] * 3
    assert cut.quantiles(j)[:, 2].tolist() == [12.0, 13.0, 14.0]
    k = cut.model_ids.index("mistral")  # issued a minute earlier: targets first + 1 .. first + 3 of its run
    assert cut.target_minutes_s()[cut.offsets[k]:cut.offsets[k + 1]].tolist() == [
        (first + m * MINUTE).timestamp() for m in (2, 3, 4)]


def test_migration_converts_forecast_rows_up_and_back_down(empty_db_url):
    engine = make_engine(empty_db_url)
    upgrade(engine, "0004")
    issued = datetime(2026, 11, 28, 23, 59, 30, tzinfo=timezone.utc)
    first = datetime(2026, 11, 28, 23, 59, tzinfo=timezone.utc)
    old_rows = [  # llama: three minutes with p_any; mistral: a gap at the second minute, no p_any, no quantiles
        ("llama", issued, first + k * MINUTE, "v1", 10.5 + k, 0.75, {"0.1": 1.5 + k, "0.9": 20.25 + k})
        for k in range(3)
    ] + [("mistral", issued, first + k * MINUTE, None, 4.0 * k, None, {}) for k in (0, 2)]
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('llama'), ('mistral')"))
        conn.execute(text("INSERT INTO model_versions (id, status, path) VALUES ('v1', 'champion', 'models/v1')"))
        for row in old_rows:
            conn.execute(text("INSERT INTO forecasts (model_id, issued_at, target_minute, model_version_id, point, "
                              "p_any, quantiles) VALUES (:m, :i, :t, :v, :p, :a, CAST(:q AS jsonb))"),
                         dict(zip("mitvpaq", row[:6] + (json.dumps(row[6]),))))

    upgrade(engine, "0005")
    with engine.connect() as conn:
        runs = conn.execute(text(
            "SELECT model_id, issued_at, first_target, step_seconds, model_version_id, point, p_any, "
            "quantile_levels, quantiles, tableoid::regclass::text FROM forecasts ORDER BY model_id")).all()
        indexes = set(conn.execute(text("SELECT indexname FROM pg_indexes")).scalars())
    assert [tuple(r) for r in runs] == [
        ("llama", issued, first, 60, "v1", [10.5, 11.5, 12.5], [0.75] * 3, [0.1, 0.9],
         [[1.5, 2.5, 3.5], [20.25, 21.25, 22.25]], "forecasts_20261128"),
        ("mistral", issued, first, 60, None, [0.0, None, 8.0], None, [], [], "forecasts_20261128"),
    ]
    assert "forecasts_model_horizon_target" not in indexes and "actions_model_time" in indexes
    with engine.connect() as conn:
        gap = latest_forecast(conn, model_id="mistral")
    assert gap.frame["point"].tolist() == [0.0, 8.0]  # the NULL element is no target minute
    assert [t.astimezone(timezone.utc) for t in gap.frame["target_minute"]] == [first, first + 2 * MINUTE]

    downgrade(engine, "0004")
    with engine.connect() as conn:
        back = conn.execute(text(
            "SELECT model_id, issued_at, target_minute, model_version_id, point, p_any, quantiles FROM forecasts "
            "ORDER BY model_id, target_minute")).all()
        indexes = set(conn.execute(text("SELECT indexname FROM pg_indexes")).scalars())
    assert [tuple(r) for r in back] == old_rows
    assert {"forecasts_model_horizon_target", "actions_model_time", "forecasts_pkey"} <= indexes
    upgrade(engine, "0005")  # and up again on the converted-back rows
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM forecasts")).scalar() == 2
    engine.dispose()


def test_runs_without_quantiles_with_unknown_p_any_and_non_ascii_ids(engine):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in ("llama", "Mödell-β")])
    first = NOW.replace(second=0)
    frame = pd.DataFrame({"unique_id": ["llama"] * 3 + ["Mödell-β"] * 2,
                          "ds": [first + k * MINUTE for k in (0, 1, 2, 0, 1)],
                          "point": [1.0, 2.0, 3.0, 4.0, 5.0], "p_any": [0.5, np.nan, 1.0, np.nan, np.nan]})
    write_forecasts(engine, frame, issued_at=NOW, model_version_id=None)
    stored = rows(engine, "SELECT model_id, point, p_any, quantile_levels, quantiles FROM forecasts ORDER BY 1")
    assert [r[0] for r in stored] == ["Mödell-β", "llama"]
    assert stored[0][1:] == ([4.0, 5.0], None, [], [])  # no p_any known at all: NULL
    assert stored[1][1] == [1.0, 2.0, 3.0] and stored[1][2][::2] == [0.5, 1.0] and np.isnan(stored[1][2][1])
    with engine.connect() as conn:
        llama = latest_forecast(conn, model_id="llama")
        runs = read_newest_runs(conn, with_p_any=True)
    assert list(llama.frame.columns) == ["target_minute", "point", "p_any"]
    assert llama.frame["p_any"].tolist()[::2] == [0.5, 1.0] and np.isnan(llama.frame["p_any"][1])
    assert sorted(runs.model_ids) == ["Mödell-β", "llama"] and all(levels == () for levels in runs.levels)


def test_arrays_and_long_frame_store_the_same_run(models):
    """The forecast job writes arrays; the result equals writing the same forecasts as a long frame."""
    first = datetime(2026, 11, 29, 12, 1, tzinfo=timezone.utc)
    points = {"llama": [5.0, 6.0, 7.5], "mistral": [0.0, 1.0, 2.0]}
    frame = pd.concat([run_frame(m, first, v, p_any=0.25) for m, v in points.items()], ignore_index=True)
    long_rows = write_forecasts(models, frame, issued_at=NOW, model_version_id=None)
    with models.connect() as conn:
        expected = {m: latest_forecast(conn, model_id=m).frame for m in points}
    later = NOW + MINUTE
    point = np.array(list(points.values()))
    columns = {"point": point, "p_any": np.full_like(point, 0.25), "q0.9": point + 10, "q0.1": np.maximum(point - 10, 0.0),
               "q0.5": point}
    assert write_forecast_arrays(models, list(points), first, columns, issued_at=later,
                                 model_version_id=None) == long_rows == 6
    with models.connect() as conn:
        for m in points:
            stored = latest_forecast(conn, model_id=m)
            assert stored.issued_at == later
            pd.testing.assert_frame_equal(stored.frame, expected[m])
    columns["q0.9"] = columns["q0.9"] * np.nan
    with pytest.raises(ValueError, match="NaN"):
        write_forecast_arrays(models, list(points), first, columns, issued_at=later + MINUTE, model_version_id=None)
    with pytest.raises(ValueError, match="whole minutes"):
        write_forecast_arrays(models, list(points), first + timedelta(seconds=30), {"point": point},
                              issued_at=later + MINUTE, model_version_id=None)


def test_a_run_with_a_version_per_model_is_one_write(models, tmp_path):
    """A sharded champion's run whose failed shard was forecast by the fallback model stores those models without
    a version and the others under the champion's: one call, one transaction (a reader that loads runs issued
    after the newest it has seen must never find a part of one)."""
    from forecaster.forecast.registry import register

    register(models, version_id="v1", path=tmp_path / "v1", status="champion", train_start=None, train_end=None,
             members=[], scores={})
    first = NOW.replace(second=0) + MINUTE
    ids = ["llama", "mistral", "phi"]
    point = np.arange(9.0).reshape(3, 3)
    with pytest.raises(ValueError, match="2 versions for 3 models"):
        write_forecast_arrays(models, ids, first, {"point": point}, issued_at=NOW, model_version_id=["v1", None])
    assert write_forecast_arrays(models, ids, first, {"point": point, "q0.9": point + 1}, issued_at=NOW,
                                 model_version_id=["v1", None, "v1"]) == 9
    with models.connect() as conn:
        stored = {m: latest_forecast(conn, model_id=m) for m in ids}
        assert {m: s.model_version_id for m, s in stored.items()} == {"llama": "v1", "mistral": None, "phi": "v1"}
        assert all(s.issued_at == NOW for s in stored.values())
        assert stored["mistral"].frame["point"].tolist() == [3.0, 4.0, 5.0]
        assert conn.execute(text("SELECT count(*) FROM forecasts")).scalar() == 3


@pytest.mark.parametrize("bad", [np.inf, -np.inf, -1.0, 1e39])
def test_infinite_negative_or_too_large_values_are_refused_naming_the_model(models, bad):
    """The serving side reads these with math.ceil and int64 (an infinite or negative run crashed it or answered 0);
    the plan step refused them. Nothing is written, from either writer."""
    first = NOW.replace(second=0)
    frame = pd.concat([run_frame("llama", first, [5.0] * 3), run_frame("mistral", first, [5.0] * 3)],
                      ignore_index=True)
    frame.loc[4, "q0.9"] = bad
    with pytest.raises(ValueError, match="'mistral' has an infinite, negative or too large value"):
        write_forecasts(models, frame, issued_at=NOW, model_version_id=None)
    point = np.full((2, 3), 5.0)
    columns = {"point": point.copy(), "q0.9": point + 1}
    columns["point"][1, 2] = bad
    with pytest.raises(ValueError, match="'mistral' has an infinite, negative or too large value"):
        write_forecast_arrays(models, ["llama", "mistral"], first, columns, issued_at=NOW, model_version_id=None)
    with pytest.raises(ValueError, match="p_any"):
        write_forecast_arrays(models, ["llama", "mistral"], first, {"point": point, "p_any": point},
                              issued_at=NOW, model_version_id=None)
    assert rows(models) == []


def test_a_run_stamped_ahead_of_the_database_clock_is_refused(models):
    with models.connect() as conn:
        db_now = conn.execute(text("SELECT clock_timestamp()")).scalar()
    first = db_now.replace(second=0, microsecond=0)
    with pytest.raises(ValueError, match="ahead of the database's clock"):
        write_forecasts(models, run_frame("llama", first, [5.0] * 3), issued_at=db_now + timedelta(minutes=30),
                        model_version_id=None)
    assert rows(models) == []
    # a writer a few seconds ahead is within the tolerance
    write_forecasts(models, run_frame("llama", first, [5.0] * 3), issued_at=db_now + timedelta(seconds=20),
                    model_version_id=None)
    assert len(rows(models)) == 1
