"""Registry, nightly retrain (champion/challenger) and the per-minute forecast job, on a real store."""

from __future__ import annotations

import functools
import json
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text

import forecaster.forecast.registry as registry
from forecaster.data import AZURE2019_TOP100, sample_path
from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.members import MovingAverage, Naive, SeasonalNaive
from forecaster.forecast.sharded import ShardedEnsemble
from forecaster.ingest.service import ingest_trace_file
from forecaster.jobs.forecasting import forecast_job, model_ids, retrain_job

DAY_END = datetime(2019, 7, 16, tzinfo=timezone.utc)  # the shipped sample covers 2019-07-15


class Broken(Naive):
    name = "broken"

    def _fit(self, panel):
        raise RuntimeError("out of memory (simulated)")


@pytest.fixture
def ingested(engine, settings, now):
    ingest_trace_file(engine, settings, sample_path(AZURE2019_TOP100), now=now, register=True)
    return settings.model_copy(update={"train_window_min": 1440, "forecast_lookback_min": 240,
                                       "retrain_holdout_min": 120})


def small(*members, fallback=True):
    return lambda: Ensemble(members=list(members), horizon=60, fallback=fallback)


def test_first_retrain_becomes_champion_and_forecasts_use_it(engine, ingested, monkeypatch):
    first = retrain_job(engine, ingested, DAY_END, cache=registry.ChampionCache(),
                        ensemble_factory=small(MovingAverage(60), Broken()))
    assert first["promoted"] and first["previous_champion"] is None and first["series"] == 100
    assert "broken" in " ".join(first["failures"])  # reported and skipped, the run went on
    folder = ingested.models_dir / first["version"]
    assert sorted(p.name for p in folder.iterdir()) == ["ensemble.pkl", "metadata.json"]
    metadata = json.loads((folder / "metadata.json").read_text())
    assert metadata["scores"]["challenger"]["wql"] == pytest.approx(first["scores"]["challenger"]["wql"])
    assert "broken" not in [m["name"] for m in metadata["members"]]

    loads = []
    original = registry.load_ensemble
    monkeypatch.setattr(registry, "load_ensemble", lambda path: loads.append(path) or original(path))
    cache = registry.ChampionCache()
    for minute in range(3):
        result = forecast_job(engine, ingested, DAY_END + timedelta(minutes=minute), cache=cache)
        assert result["models"] == 100 and result["model_version"] == first["version"]
    assert len(loads) == 1  # the champion is loaded once, not every minute
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT count(*), count(DISTINCT model_id), bool_and(model_version_id = :v) "
                                 "FROM forecasts WHERE issued_at = :t"), {"t": DAY_END, "v": first["version"]}).one()
        rows = conn.execute(text(
            "SELECT count(*), min(f.first_target + (u.k - 1) * f.step_seconds * interval '1 second'), "
            "max(f.first_target + (u.k - 1) * f.step_seconds * interval '1 second'), bool_and(u.point >= 0), "
            "bool_and(f.quantiles[array_position(f.quantile_levels, CAST(0.9 AS real))][u.k] >= u.point) "
            "FROM forecasts f CROSS JOIN LATERAL unnest(f.point) WITH ORDINALITY AS u(point, k) "
            "WHERE f.issued_at = :t"), {"t": DAY_END}).one()
    assert tuple(runs) == (100, 100, True)  # one row per model and run
    assert rows[0] == 100 * 60 and rows[1] == DAY_END and rows[2] == DAY_END + timedelta(minutes=59)
    assert rows[3] and rows[4]


def test_a_worse_challenger_is_not_promoted(engine, ingested):
    good = retrain_job(engine, ingested, DAY_END, cache=registry.ChampionCache(),
                       ensemble_factory=small(SeasonalNaive(15)))
    # naive without the fallback: its own conformal intervals only; on this data it scores worse wQL
    worse = retrain_job(engine, ingested, DAY_END + timedelta(minutes=1), cache=registry.ChampionCache(),
                        ensemble_factory=small(MovingAverage(1440), fallback=False))
    assert good["promoted"]
    assert worse["scores"]["challenger"]["wql"] > worse["scores"]["champion"]["wql"]
    assert not worse["promoted"] and worse["previous_champion"] == good["version"]
    with engine.connect() as conn:
        statuses = dict(conn.execute(text("SELECT id, status FROM model_versions WHERE kind = 'forecast'")).all())
        latency = dict(conn.execute(text("SELECT id, status FROM model_versions WHERE kind = 'latency'")).all())
    assert statuses == {good["version"]: "champion", worse["version"]: "rejected"}
    # each nightly retrain also refits the latency model; the newest is its champion
    assert latency == {good["latency_model"]: "retired", worse["latency_model"]: "champion"}


def test_a_holdout_with_no_known_minute_keeps_the_champion(engine, ingested):
    """The same worse challenger, retrained two hours past the data (an ingest outage before the nightly run): its
    holdout has no known minute, neither candidate can be scored, and the champion stays."""
    good = retrain_job(engine, ingested, DAY_END, cache=registry.ChampionCache(),
                       ensemble_factory=small(SeasonalNaive(15)))
    blind = retrain_job(engine, ingested, DAY_END + timedelta(hours=2), cache=registry.ChampionCache(),
                        ensemble_factory=small(MovingAverage(1440), fallback=False))
    assert blind["scores"]["challenger"]["wql"] is None and blind["scores"]["champion"]["wql"] is None
    assert not blind["promoted"] and "not comparable" in blind["decision"]
    assert registry.champion(engine).id == good["version"]


def test_an_all_zero_holdout_does_not_promote_a_challenger_scored_inf():
    """Every holdout actual 0: a champion forecasting 0 scores 0/0 (None), any other forecast x/0 (inf)."""
    import numpy as np

    from forecaster.forecast.backtest import MethodForecasts, evaluate
    from forecaster.forecast.panel import Panel
    from forecaster.jobs.forecasting import _holdout_protocol, _promotion, _scores

    values = np.random.default_rng(0).poisson(5, (5, 600)).astype(float)
    values[:, -120:] = 0.0
    panel = Panel(np.array(list("abcde"), dtype=object), DAY_END, timedelta(minutes=1), values)
    protocol = _holdout_protocol(panel.n_steps, 120, 15)
    shape = (5, len(protocol.origins), 15)
    zeros, awful = np.zeros(shape), np.full(shape, 1e6)
    result = evaluate(panel, protocol, {"challenger": MethodForecasts(awful, awful, awful),
                                        "champion": MethodForecasts(zeros, zeros, zeros)})
    scores = {name: _scores(result, name) for name in ("challenger", "champion")}
    assert scores["challenger"]["wql"] == float("inf") and scores["champion"]["wql"] is None
    promoted, decision = _promotion(scores, champion_id="v1")
    assert not promoted and "not comparable" in decision
    assert _promotion({"challenger": scores["challenger"]}, champion_id="v1")[0]  # a champion that could not forecast
    assert _promotion({"challenger": scores["challenger"]}, champion_id=None)[0]  # no champion yet


def test_forecast_job_without_champion_falls_back(engine, ingested):
    result = forecast_job(engine, ingested, DAY_END, cache=registry.ChampionCache())
    assert result["models"] == 100 and result["model_version"] is None and result["rows"] == 6000


def test_a_champion_that_cannot_be_loaded_never_stops_the_forecast_job(engine, ingested, monkeypatch):
    """Artefacts gone (a deleted folder, an unmounted volume): the job forecasts with what it holds, retries later."""
    first = retrain_job(engine, ingested, DAY_END, cache=registry.ChampionCache(),
                        ensemble_factory=small(SeasonalNaive(15)))
    folder = ingested.models_dir / first["version"]
    hidden = folder.with_name(folder.name + ".away")
    folder.rename(hidden)
    loads, seconds = [], [0.0]
    original = registry.load_ensemble
    monkeypatch.setattr(registry, "load_ensemble", lambda path: loads.append(path) or original(path))
    cache = registry.ChampionCache(retry_after_s=600, clock=lambda: seconds[0])

    result = forecast_job(engine, ingested, DAY_END, cache=cache)  # nothing held yet: the fallback model
    assert result["models"] == 100 and result["rows"] == 6000 and result["model_version"] is None
    assert first["version"] in result["champion_error"] and "No such file" in result["champion_error"]
    seconds[0] = 599.0
    assert forecast_job(engine, ingested, DAY_END + timedelta(minutes=1), cache=cache)["model_version"] is None
    assert len(loads) == 1  # not retried every minute
    hidden.rename(folder)  # the volume is back
    seconds[0] = 600.0
    result = forecast_job(engine, ingested, DAY_END + timedelta(minutes=2), cache=cache)
    assert result["model_version"] == first["version"] and result["champion_error"] is None and len(loads) == 2

    # a newer champion whose folder is missing: the previous champion goes on, under its own version
    second = retrain_job(engine, ingested, DAY_END + timedelta(minutes=3), cache=registry.ChampionCache(),
                         ensemble_factory=small(MovingAverage(60)))
    registry.promote(engine, second["version"])
    (ingested.models_dir / second["version"] / "ensemble.pkl").write_bytes(b"truncated")
    result = forecast_job(engine, ingested, DAY_END + timedelta(minutes=4), cache=cache)
    assert result["models"] == 100 and result["model_version"] == first["version"]
    assert second["version"] in result["champion_error"]
    with engine.connect() as conn:
        versions = conn.execute(text("SELECT DISTINCT model_version_id FROM forecasts WHERE issued_at = :t"),
                                {"t": DAY_END + timedelta(minutes=4)}).scalars().all()
    assert versions == [first["version"]]


def test_forecast_job_stores_every_forecast_level_and_the_api_serves_them(engine, ingested):
    from fastapi.testclient import TestClient

    from api.main import create_app
    from forecaster.store.tokens import create_token

    first = retrain_job(engine, ingested, DAY_END, cache=registry.ChampionCache(),
                        ensemble_factory=small(SeasonalNaive(15)))
    forecast_job(engine, ingested, DAY_END, cache=registry.ChampionCache())
    with engine.connect() as conn:
        stored = conn.execute(text(
            "SELECT DISTINCT quantile_levels::text, bool_and(p_any IS NOT NULL), "
            "bool_and(model_version_id = :v) FROM forecasts GROUP BY 1"), {"v": first["version"]}).all()
        # per run and minute: q0.5 <= q0.9 <= q0.95 <= q0.99, p_any in [0, 1]
        ordered = conn.execute(text(
            "SELECT bool_and(q[2][k] <= q[3][k] AND q[3][k] <= q[4][k] AND q[4][k] <= q[5][k] "
            "AND p_any[k] BETWEEN 0 AND 1) FROM (SELECT quantiles AS q, p_any FROM forecasts) f "
            "CROSS JOIN generate_series(1, 60) AS k")).scalar()
    assert [tuple(row) for row in stored] == [("{0.1,0.5,0.9,0.95,0.99}", True, True)] and ordered

    model_id = min(model_ids(engine))
    read = create_token(engine, name="read", scopes=["read"])
    app = create_app(ingested, engine, clock=lambda: DAY_END + timedelta(seconds=20))
    with TestClient(app) as client:
        headers = {"Authorization": f"Bearer {read}"}
        body = client.get(f"/v1/models/{model_id}/forecast?horizon=5", headers=headers).json()
        assert len(body["points"]) == 5
        assert set(body["points"][0]["quantiles"]) == {"0.1", "0.5", "0.9", "0.95", "0.99"}  # the default: all
        asked = client.get(f"/v1/models/{model_id}/forecast?horizon=5&quantiles=0.95,0.99", headers=headers).json()
        assert [set(p["quantiles"]) for p in asked["points"]] == [{"0.95", "0.99"}] * 5
        assert all(p["quantiles"]["0.95"] <= p["quantiles"]["0.99"] for p in asked["points"])
        assert [p["quantiles"]["0.99"] for p in asked["points"]] == [p["quantiles"]["0.99"] for p in body["points"]]
        assert client.get(f"/v1/models/{model_id}/forecast?quantiles=0.975", headers=headers).status_code == 422


def test_backtest_command_writes_store_and_csv(engine, ingested, db_url, tmp_path):
    from typer.testing import CliRunner

    from forecaster.cli import app

    csv = tmp_path / "bt.csv"
    result = CliRunner().invoke(app, ["backtest", "--csv", str(csv), "--members", "fallback"],
                                env={"DATABASE_URL": db_url, "PREWARM_DATA_DIR": str(tmp_path),
                                     "PREWARM_MODELS_DIR": str(tmp_path / "models")})
    assert result.exit_code == 0, result.output
    assert "backtest run 1 stored" in result.output
    import pandas as pd

    table = pd.read_csv(csv)
    summary = pd.read_csv(csv.with_suffix(".summary.csv"))
    # generic protocol on 1,440 minutes: fit on 1,152, origins every hour, horizons 1..15
    assert set(table["h"]) == set(range(1, 16)) and table["unique_id"].nunique() == 100
    assert set(summary["method"]) == {"ensemble", "naive", "moving_average_60"}
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT count(*), count(DISTINCT method) FROM backtest_results "
                                   "WHERE run_id = 1")).one()
        protocol = conn.execute(text("SELECT protocol->>'fit_steps' FROM backtest_runs WHERE id = 1")).scalar()
    assert stored == (len(table), 3) and protocol == "1152"


def test_backtest_rejects_unknown_members(engine, ingested, db_url, tmp_path):
    from typer.testing import CliRunner

    from forecaster.cli import app

    result = CliRunner().invoke(app, ["backtest", "--members", "prophet"],
                                env={"DATABASE_URL": db_url, "PREWARM_DATA_DIR": str(tmp_path),
                                     "PREWARM_MODELS_DIR": str(tmp_path / "models")})
    assert result.exit_code == 2 and "unknown members ['prophet']" in result.output


def test_forecast_job_stores_each_models_request_rate_over_its_look_back(engine, ingested):
    """The plan job weights cold costs by it (PREWARM_PLANNER_COLD_COST_WEIGHTING=model): one definition, the
    forecast job's look-back read from the store, none of it re-read by the plan job."""
    import numpy as np

    from forecaster.contracts.forecast import history_request_rate_rpm
    from forecaster.store.invocations import read_grid

    forecast_job(engine, ingested, DAY_END, cache=registry.ChampionCache())
    ids, _, grid = read_grid(engine, sorted(model_ids(engine)),
                             DAY_END - timedelta(minutes=ingested.forecast_lookback_min), DAY_END)
    ids = [str(m) for m in ids]
    expected = history_request_rate_rpm(grid)
    with engine.connect() as conn:
        stored = dict(conn.execute(text("SELECT model_id, request_rate_rpm FROM forecasts")).all())
    assert sorted(stored) == ids
    np.testing.assert_allclose([stored[m] for m in ids], expected, rtol=1e-6)  # real: float32
    assert len(set(np.round(expected, 3))) > 10 and min(expected) > 0  # the models differ; none at 0


def sharded(*members):
    return lambda: ShardedEnsemble(functools.partial(Ensemble, members=list(members), horizon=60), shard_max_series=25)


def _two_champions(engine, ingested, first_factory, second_factory) -> tuple[dict, dict]:
    """Two retrains a minute apart, the second promoted over the first (the newest former champion); their results."""
    first = retrain_job(engine, ingested, DAY_END, cache=registry.ChampionCache(), ensemble_factory=first_factory)
    second = retrain_job(engine, ingested, DAY_END + timedelta(minutes=1), cache=registry.ChampionCache(),
                         ensemble_factory=second_factory)
    registry.promote(engine, second["version"])
    return first, second


def _stored_versions(engine, issued_at) -> dict:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT model_version_id, count(*) FROM forecasts WHERE issued_at = :t "
                                      "GROUP BY 1"), {"t": issued_at}).all())


def test_unusable_shard_files_are_found_before_a_champion_is_accepted_and_a_failed_shard_is_stored_unversioned(
        engine, ingested):
    import forecaster.forecast.sharded as sharded_module

    first, second = _two_champions(engine, ingested, sharded(MovingAverage(60)), sharded(SeasonalNaive(15)))
    shards = ingested.models_dir / second["version"] / "shards"
    (shards / "s1.pkl").rename(shards.parent / "s1.away")  # the volume holds the model file, not yet this shard
    sharded_module._loaded.clear()

    # a scheduler started after the promotion: it holds no model, and forecasts with the previous champion
    result = forecast_job(engine, ingested, DAY_END, cache=registry.ChampionCache())
    assert result["models"] == 100 and result["model_version"] == first["version"]
    assert second["version"] in result["champion_error"] and "s1.pkl" in result["champion_error"]
    assert _stored_versions(engine, DAY_END) == {first["version"]: 100}

    # whole again: accepted; then a shard file damaged under it: that shard's series come from the fallback model
    (shards.parent / "s1.away").rename(shards / "s1.pkl")
    cache = registry.ChampionCache()
    version, champion = cache.get(engine)
    assert version == second["version"] and cache.last_error is None
    (shards / "s2.pkl").write_bytes((shards / "s2.pkl").read_bytes()[:100])
    result = forecast_job(engine, ingested, DAY_END + timedelta(minutes=1), cache=cache)
    assert result["model_version"] == second["version"] and set(result["shards"]["failed_shards"]) == {"s2"}
    assert set(result["fallback_shards"]) == {"s2"} and result["fallback_series"] == 25
    assert _stored_versions(engine, DAY_END + timedelta(minutes=1)) == {second["version"]: 75, None: 25}
    with engine.connect() as conn:
        unversioned = conn.execute(text("SELECT model_id FROM forecasts WHERE issued_at = :t AND "
                                        "model_version_id IS NULL"), {"t": DAY_END + timedelta(minutes=1)}).scalars()
        assert sorted(unversioned) == sorted(champion.shard_ids_["s2"])


class Switched(MovingAverage):
    """A moving average whose forecast raises while ``failing`` (a member that breaks after the retrain)."""

    failing = False

    @property
    def name(self) -> str:
        return "switched"

    def _forecast(self, panel, origins, h):
        if type(self).failing:
            raise RuntimeError("booster corrupted (simulated)")
        return super()._forecast(panel, origins, h)


def test_a_member_failing_at_forecast_time_is_in_each_runs_summary_and_warned_once(engine, ingested, monkeypatch,
                                                                                     caplog):
    from forecaster.forecast.ensemble import member_failure_log

    monkeypatch.setattr(member_failure_log, "clock", lambda: 0.0)
    member_failure_log.clear()
    monkeypatch.setattr(Switched, "failing", False)
    retrain_job(engine, ingested, DAY_END, cache=registry.ChampionCache(), ensemble_factory=small(Switched(60)))
    cache = registry.ChampionCache()
    _, champion = cache.get(engine)
    champion.weights_[:80] = [1.0, 0.0]  # 80 series rely on the member, 20 on the fallback
    champion.weights_[80:] = [0.0, 1.0]
    monkeypatch.setattr(Switched, "failing", True)
    caplog.set_level("WARNING")
    for minute in range(2):
        result = forecast_job(engine, ingested, DAY_END + timedelta(minutes=minute), cache=cache)
        assert result["rows"] == 6000  # the fallback member forecast them
        assert result["member_failures"] == {
            "switched": {"series": 80, "error": "RuntimeError: booster corrupted (simulated)"}}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "switched failed at forecast time for 80 series" in warnings[0]
    monkeypatch.setattr(Switched, "failing", False)
    assert forecast_job(engine, ingested, DAY_END + timedelta(minutes=2), cache=cache)["member_failures"] == {}


def _damaged_sharded_champion(engine, settings):
    """A sharded champion (4 shards of 25) whose shard s2's file is damaged after it was accepted: a cache that
    holds it, and the settings (no shard retries)."""
    settings = settings.model_copy(update={"shard_retries": 0})
    trained = retrain_job(engine, settings, DAY_END, cache=registry.ChampionCache(),
                          ensemble_factory=sharded(MovingAverage(60)))
    cache = registry.ChampionCache()
    cache.get(engine)
    shards = settings.models_dir / trained["version"] / "shards"
    (shards / "s2.pkl").write_bytes((shards / "s2.pkl").read_bytes()[:100])
    return settings, cache


def test_a_run_with_a_fallback_shard_reaches_a_polling_snapshot_whole(engine, ingested, monkeypatch):
    """The run's versioned rows and its fallback rows (no version) used to be two transactions with one
    issued_at; the API snapshot loads only runs issued after the newest it has, so a poll between the two commits
    left the failed shard's models on an older run for good. Now the run is one write."""
    import forecaster.jobs.forecasting as forecasting
    from api.snapshot import ForecastSnapshot

    settings, cache = _damaged_sharded_champion(engine, ingested)
    snapshot = ForecastSnapshot(engine, refresh_s=2.0, settings=settings, clock=lambda: DAY_END)
    snapshot.refresh()
    write = forecasting.write_forecast_arrays

    def polled_after_each_commit(*args, **kwargs):
        rows = write(*args, **kwargs)
        snapshot.refresh()  # a poll of the snapshot landing right after this commit
        return rows

    monkeypatch.setattr(forecasting, "write_forecast_arrays", polled_after_each_commit)
    issued = DAY_END + timedelta(minutes=1)
    result = forecast_job(engine, settings, issued, cache=cache)
    assert result["fallback_series"] == 25
    snapshot.refresh()
    stale = [m for m, view in snapshot.models.items() if view.forecast is None or view.forecast.issued_at != issued]
    assert len(snapshot.models) == 100 and not stale
    assert _stored_versions(engine, issued) == {result["model_version"]: 75, None: 25}


def test_a_failed_shards_fallback_is_fitted_once_over_the_forecast_jobs_runs(engine, ingested, monkeypatch):
    """Each run forecasts a copy of the cached champion (holding the run's executor); the failed shard's fallback
    used to be kept on that throwaway copy, so it was fitted again on every run instead of once an hour."""
    settings, cache = _damaged_sharded_champion(engine, ingested)
    fits = []
    fit = Ensemble.fit_panel

    def counted(self, panel):
        if self.members == []:  # a fallback-only ensemble
            fits.append(panel.n_series)
        return fit(self, panel)

    monkeypatch.setattr(Ensemble, "fit_panel", counted)
    for minute in (1, 2, 3):
        result = forecast_job(engine, settings, DAY_END + timedelta(minutes=minute), cache=cache)
        assert set(result["fallback_shards"]) == {"s2"} and result["fallback_series"] == 25
    assert fits == [25]
    # the retrain's holdout forecast of the champion (on the batch executor) fits a fallback of its own, on its
    # past origins, and leaves the forecast job's be
    from forecaster.jobs.forecasting import _with_executor, history

    _, champion = cache.get(engine)
    panel = history(engine, model_ids(engine), end=DAY_END, minutes=240)
    _with_executor(champion, settings).forecast(panel, [120, 135], 15)
    assert fits == [25, 25]
    result = forecast_job(engine, settings, DAY_END + timedelta(minutes=4), cache=cache)
    assert set(result["fallback_shards"]) == {"s2"} and fits == [25, 25]


def _break_at_forecast_time(settings, version: str) -> None:
    """Rewrite ``version``'s model file as code from before ``shard_of_`` would have pickled it: it loads, and
    raises when it forecasts."""
    import pickle

    path = settings.models_dir / version / "ensemble.pkl"
    model = pickle.loads(path.read_bytes())
    del model.__dict__["shard_of_"]
    path.write_bytes(pickle.dumps(model))


def test_a_champion_that_loads_but_fails_to_forecast_is_replaced_by_the_previous_one_in_the_same_run(
        engine, ingested):
    first, second = _two_champions(engine, ingested, sharded(SeasonalNaive(15)), sharded(SeasonalNaive(15)))
    _break_at_forecast_time(ingested, second["version"])
    seconds = [0.0]
    cache = registry.ChampionCache(retry_after_s=600, clock=lambda: seconds[0])

    result = forecast_job(engine, ingested, DAY_END, cache=cache)

    # the run went on with the previous champion and stored every row under its version
    assert result["models"] == 100 and result["rows"] == 6000 and result["model_version"] == first["version"]
    assert f"champion {second['version']} failed to forecast" in result["champion_error"]
    assert _stored_versions(engine, DAY_END) == {first["version"]: 100}
    seconds[0] = 60.0  # the next minute: the failed champion is not tried again before retry_after_s
    result = forecast_job(engine, ingested, DAY_END + timedelta(minutes=1), cache=cache)
    assert result["model_version"] == first["version"] and second["version"] in result["champion_error"]
    # the nightly retrain replaces the champion that cannot forecast (it is not compared with the former one)
    third = retrain_job(engine, ingested, DAY_END + timedelta(minutes=2), cache=cache,
                        ensemble_factory=sharded(MovingAverage(1440)))
    assert third["promoted"] and third["previous_champion"] == second["version"]
    assert "unusable" in third["decision"] and "failed to forecast" in third["decision"]
    assert registry.champion(engine).id == third["version"]


def test_a_sole_champion_that_fails_to_forecast_leaves_the_run_to_the_fallback_model(engine, ingested):
    only = retrain_job(engine, ingested, DAY_END, cache=registry.ChampionCache(),
                       ensemble_factory=sharded(SeasonalNaive(15)))
    _break_at_forecast_time(ingested, only["version"])
    result = forecast_job(engine, ingested, DAY_END, cache=registry.ChampionCache())
    assert result["models"] == 100 and result["rows"] == 6000 and result["model_version"] is None
    assert only["version"] in result["champion_error"]
    assert _stored_versions(engine, DAY_END) == {None: 100}


def test_a_version_saved_in_another_artefact_format_is_refused_at_load(engine, ingested):
    first, second = _two_champions(engine, ingested, small(SeasonalNaive(15)), small(SeasonalNaive(15)))
    metadata_file = ingested.models_dir / second["version"] / "metadata.json"
    metadata = json.loads(metadata_file.read_text())
    metadata_file.write_text(json.dumps({**metadata, "artefact_format": 999}))  # saved by code of a future format

    result = forecast_job(engine, ingested, DAY_END, cache=registry.ChampionCache())

    assert result["model_version"] == first["version"] and result["rows"] == 6000
    assert f"champion {second['version']} could not be loaded" in result["champion_error"]
    assert "artefact format 999" in result["champion_error"]
    assert metadata["artefact_format"] == registry.ARTEFACT_FORMAT  # what save_version wrote
    # saved before the field existed: read as the legacy format, which is this one (a failure at forecast time is
    # caught by the forecast job)
    del metadata["artefact_format"]
    metadata_file.write_text(json.dumps(metadata))
    assert registry.load_ensemble(metadata_file.parent) is not None


def test_a_champion_whose_files_are_gone_is_replaced_by_the_retrain_not_compared_with_a_former_one(
        engine, ingested):
    import shutil

    first, second = _two_champions(engine, ingested, sharded(SeasonalNaive(15)), sharded(SeasonalNaive(15)))
    shutil.rmtree(ingested.models_dir / second["version"])
    cache = registry.ChampionCache()  # a scheduler started after the deletion: it holds the former champion
    assert forecast_job(engine, ingested, DAY_END + timedelta(minutes=2), cache=cache)["model_version"] == \
        first["version"]

    # a challenger worse than the former champion: still promoted, the champion cannot forecast at all
    third = retrain_job(engine, ingested, DAY_END + timedelta(minutes=3), cache=cache,
                        ensemble_factory=sharded(MovingAverage(1440)))

    assert third["previous_champion"] == second["version"] and third["promoted"]
    assert f"champion {second['version']} is unusable" in third["decision"]
    assert second["version"] in third["champion_error"] and "champion" not in third["scores"]
    assert registry.champion(engine).id == third["version"]


def test_a_version_whose_registration_fails_leaves_no_folder(engine, ingested, monkeypatch):
    import forecaster.jobs.forecasting as forecasting

    def outage(*args, **kwargs):
        raise ConnectionError("the database went away (simulated)")

    monkeypatch.setattr(forecasting, "register", outage)
    with pytest.raises(ConnectionError):
        retrain_job(engine, ingested, DAY_END, cache=registry.ChampionCache(),
                    ensemble_factory=small(SeasonalNaive(15)))
    left = sorted(p.name for p in ingested.models_dir.iterdir() if not p.name.startswith("latency-"))
    assert left == []  # neither the published folder nor its staging folder


def test_an_unwritable_models_dir_fails_the_retrain_before_the_fit(engine, ingested):
    blocker = ingested.models_dir.parent / "not-a-folder"
    blocker.write_text("a file where models_dir's parent should be")
    settings = ingested.model_copy(update={"models_dir": blocker / "models"})
    fits = []

    def factory():
        fits.append(1)
        return small(SeasonalNaive(15))()

    with pytest.raises(OSError) as raised:
        retrain_job(engine, settings, DAY_END, cache=registry.ChampionCache(), ensemble_factory=factory)
    assert fits == []  # failed before the challenger was built, let alone fitted
    assert "models_dir is not writable" in str(raised.value) and str(settings.models_dir) in str(raised.value)


class _BadSeries:
    """A champion whose output has one series with an infinite value and one with negative values."""

    name = "bad-series"

    def forecast(self, panel, origins, h):
        import numpy as np

        point = np.full((panel.n_series, 1, h), 5.0)
        point[0, 0, 3] = np.inf
        point[1, 0, :] = -2.0
        return {"bad-series": point, "q0.9": point + 1.0, "p_any": np.full_like(point, 0.5)}


class _BadSeriesCache:
    last_error = None

    def get(self, engine):
        return None, _BadSeries()


def test_one_bad_series_never_fails_the_forecast_job(engine, ingested, caplog):
    """The store refuses infinite and negative values; the job drops the infinite series (its model keeps its
    previous run) and clips the negative one to 0, logged and counted, and stores every other model."""
    ids = model_ids(engine)
    with caplog.at_level("WARNING", logger="forecaster.jobs.forecasting"):
        result = forecast_job(engine, ingested, DAY_END, cache=_BadSeriesCache())
    assert result["dropped_series"] == 1 and result["clipped_series"] == 1
    assert result["rows"] == (result["models"] - 1) * ingested.forecast_horizon_min
    assert "not stored this run" in caplog.text and "clipped to 0" in caplog.text
    with engine.connect() as conn:
        stored = dict(conn.execute(text("SELECT model_id, (SELECT min(v) FROM unnest(point) v) FROM forecasts")).all())
    assert len(stored) == result["models"] - 1 and min(stored.values()) == 0.0
    assert len(ids) >= result["models"]


def test_an_executor_that_cannot_start_is_not_blamed_on_the_champion(engine, ingested, monkeypatch):
    """With the forecast job's shards in a child process by default, a pool that could not run them (here its
    temporary folder, as under a read-only /tmp) was charged to the champion and then to every former champion: the
    fleet went to the fallback model, and the next retrain promoted its challenger unscored over an 'unusable'
    champion. Now the run forecasts the same champion in process and says why."""
    from forecaster.distributed import executor as executor_module

    first, second = _two_champions(engine, ingested, sharded(SeasonalNaive(15)), sharded(SeasonalNaive(15)))

    def read_only(self):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(executor_module.PoolExecutor, "_tokens", read_only)
    cache = registry.ChampionCache()
    out = forecast_job(engine, ingested, DAY_END + timedelta(minutes=2), cache=cache)
    assert out["model_version"] == second["version"] and out["champion_error"] is None
    assert "Read-only file system" in out["executor_error"] and out["models"] == 100
    assert _stored_versions(engine, DAY_END + timedelta(minutes=2)) == {second["version"]: 100}
    assert cache.get(engine)[0] == second["version"]  # still the champion, not dropped for retry_after_s
