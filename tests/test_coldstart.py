"""The cold-start latency model: physics prior, training from the cold_starts table, baselines, Lambda check."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

from forecaster.coldstart.lambda_perf import (LambdaLatencyModel, evaluate_lambda, lag_features, lambda_sampling_floor,
                                              load_lambda)
from forecaster.coldstart.model import (ColdStartModel, baseline_predictions, load_cold_starts, running_at_start,
                                        with_concurrency)
from forecaster.coldstart.physics import phase_seconds, physics_latency_table
from forecaster.contracts.phases import PHASES
from forecaster.ingest.service import push_cold_starts
from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.store.catalog import ServingModelSpec, upsert_models

UTC = timezone.utc
SMALL_TREES = {"n_estimators": 60, "learning_rate": 0.1, "num_leaves": 7, "min_child_samples": 5}


def test_physics_phases_are_bytes_over_shared_bandwidth():
    cfg = FleetConfig(peak_slowdown=1.0)
    out = phase_seconds(np.array([10e9, 10e9]), np.array([16e9, 16e9]), np.array([0, 3]),
                        concurrent=np.array([0.0, 0.0]), config=cfg)
    # none: pull 10 GB at 0.2 GB/s, fetch 16 GB at 0.6 GB/s, load 16 GB from disk at 2 GB/s
    assert out["image_pull_s"][0] == pytest.approx(50.0)
    assert out["weight_fetch_s"][0] == pytest.approx(16 / 0.6)
    assert out["weight_load_s"].tolist() == pytest.approx([8.0, 16 / 12])
    assert out["total_s"][1] == pytest.approx(16 / 12 + 10.3 + 2.0)
    # a node NIC shared by 30 other transfers drops the pull below its 0.2 GB/s cap
    crowded = phase_seconds(np.array([10e9]), np.array([16e9]), np.array([0]), concurrent=30.0, config=cfg)
    assert crowded["image_pull_s"][0] == pytest.approx(10e9 / (3.125e9 / 31))
    table = physics_latency_table(pd.DataFrame({"image_bytes": [10e9], "weights_bytes": [16e9]},
                                               index=pd.Index(["m"], name="model_id")), config=cfg)
    assert table.sort_values("total_s")["state"].tolist() == ["host", "disk", "image", "none"]


def synthetic_events(n: int, seed: int = 0, start: datetime = datetime(2026, 11, 20, tzinfo=UTC),
                     drift_after: int | None = None) -> pd.DataFrame:
    """Cold starts from the physics with contention, a slow hour and noise; optionally a registry that slows later."""
    rng = np.random.default_rng(seed)
    cfg = FleetConfig()
    sizes = {"small": (9e9, 1e9), "mid": (12.6e9, 16e9), "big": (12.6e9, 141e9)}
    rows = []
    for k in range(n):
        model = rng.choice(list(sizes))
        image, weights = sizes[model]
        state = int(rng.integers(0, 4))
        busy = float(rng.integers(0, 6))
        when = start + timedelta(minutes=37 * k)
        phases = phase_seconds(np.array([image]), np.array([weights]), np.array([state]), concurrent=busy,
                               hour=when.hour, config=cfg)
        slow = 1.6 if drift_after is not None and k >= drift_after else 1.0
        values = {p: float(phases[p][0]) * rng.lognormal(0, 0.08) * (slow if p == "image_pull_s" else 1.0)
                  for p in PHASES}
        rows.append({"model_id": model, "node_id": f"node-{k % 5}", "started_at": when,
                     "total_seconds": sum(values.values()), **values,
                     "cache_state": ("none", "image", "disk", "host")[state], "image_bytes": image,
                     "weights_bytes": weights, "concurrent_node_transfers": busy, "concurrent_registry_pulls": 0.0})
    return pd.DataFrame(rows)


def small_model(**kw) -> ColdStartModel:
    return ColdStartModel(tree_params=SMALL_TREES, **kw)


def test_model_beats_last_value_and_trailing_median_on_held_out_starts():
    events = synthetic_events(240, seed=1)
    train, test = events.iloc[:160], events.iloc[160:]
    model = small_model().fit(train)
    predicted = model.predict(test)["total_seconds"].to_numpy()
    base = baseline_predictions(train, test)
    actual = test["total_seconds"].to_numpy()
    mae = np.abs(predicted - actual).mean()
    assert mae < np.abs(base["last_value"] - base["actual"]).mean()
    assert mae < np.abs(base["trailing_median"] - base["actual"]).mean()
    # per tier the warmer start is faster, for every model
    table = model.latency_table(pd.DataFrame({"image_bytes": [12.6e9], "weights_bytes": [16e9]},
                                             index=pd.Index(["mid"])), hour=3)
    assert table.set_index("state").loc[["none", "image", "disk", "host"], "total_s"].is_monotonic_decreasing


def test_recent_member_tracks_a_slower_registry_without_refit():
    """Image pulls get 60 % slower after event 200; observing newer starts (no refit) cuts the error."""
    events = synthetic_events(360, seed=2, drift_after=200)
    model = small_model().fit(events.iloc[:200])
    late = events.iloc[200:].reset_index(drop=True)
    cold = late.index[late["cache_state"] == "none"]
    split = cold[len(cold) // 2]
    judged = late.iloc[split:]
    judged = judged[judged["cache_state"] == "none"]

    def error() -> float:
        return float(np.abs(model.predict(judged)["total_seconds"] - judged["total_seconds"].to_numpy()).mean())

    before = error()
    model.observe(late.iloc[:split])
    assert error() < before


def test_too_few_events_fall_back_to_the_physics_prior_and_save_load_round_trips(tmp_path):
    few = synthetic_events(10)
    model = ColdStartModel().fit(few)
    assert model.trees_ is None
    models = pd.DataFrame({"image_bytes": [9e9], "weights_bytes": [1e9]}, index=pd.Index(["small"]))
    prior = physics_latency_table(models)
    table = model.latency_table(models, hour=0)
    assert table["total_s"].to_numpy() == pytest.approx(prior["total_s"].to_numpy())
    trained = small_model().fit(synthetic_events(80))
    again = ColdStartModel.load(trained.save(tmp_path / "coldstart"))
    pd.testing.assert_frame_equal(trained.latency_table(models, hour=5), again.latency_table(models, hour=5))


def test_trained_from_the_cold_starts_table(engine, settings, now):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="small", image_size_bytes=int(9e9), weights_size_bytes=int(1e9)),
                             ServingModelSpec(id="mid", image_size_bytes=int(12.6e9), weights_size_bytes=int(16e9)),
                             ServingModelSpec(id="big", image_size_bytes=int(12.6e9),
                                              weights_size_bytes=int(141e9))])
        for k in range(5):  # node-4 never reported its bandwidth
            conn.execute(text("INSERT INTO nodes (id, gpus_total, gpus_free, network_bytes_per_s) "
                              "VALUES (:id, 8, 8, :bw)"), {"id": f"node-{k}", "bw": None if k == 4 else 3.125e9})
    events = synthetic_events(60, start=now - timedelta(days=3))
    payload = [{"model_id": r.model_id, "node_id": r.node_id, "started_at": r.started_at.isoformat(),
                "total_seconds": r.total_seconds, "cache_state": r.cache_state,
                **{p: getattr(r, p) for p in PHASES}} for r in events.itertuples()]
    push_cold_starts(engine, settings, payload, now=now)
    loaded = load_cold_starts(engine)
    assert len(loaded) == 60
    assert set(loaded.columns) >= {"image_bytes", "weights_bytes", "concurrent_node_transfers", *PHASES}
    assert loaded.loc[loaded.model_id == "big", "weights_bytes"].iloc[0] == 141e9
    assert loaded.loc[loaded.node_id == "node-0", "node_bytes_per_s"].eq(3.125e9).all()
    assert loaded.loc[loaded.node_id == "node-4", "node_bytes_per_s"].isna().all()
    # starts 37 minutes apart on 5 nodes: a start from nothing that lasts longer overlaps the next ones
    assert (loaded["concurrent_registry_pulls"] >= 0).all()
    model = small_model().fit(loaded)
    assert model.trees_ is not None and model.n_events_ == 60
    table = model.latency_table(pd.DataFrame({"image_bytes": [12.6e9, 9e9], "weights_bytes": [141e9, 1e9]},
                                             index=pd.Index(["big", "small"])), hour=12)
    none = table[table.state == "none"].set_index("model_id")["total_s"]
    assert none["big"] > none["small"]


# --------------------------------------------------------------------------- AWS Lambda


def _lambda_csv(path, days: int = 60, seed: int = 0):
    """A small file in the real schema: two configurations, one drifting upwards, one flat."""
    rng = np.random.default_rng(seed)
    rows = []
    for d in range(days):
        date = (datetime(2025, 1, 1) + timedelta(days=d)).strftime("%Y-%m-%d")
        for rid, mem, base, slope in (("lambda-perf-python312", 128, 120.0, 1.5), ("lambda-perf-nodejs20", 512, 140.0,
                                                                                  0.0)):
            samples = base + slope * d + rng.normal(0, 4, size=10)
            rows.append({"date": date, "runtime_id": rid, "display_name": "", "package_type": "zip",
                         "memory_mb": mem, "architecture": "x86_64", "n_samples": 10,
                         "init_durations_ms": ";".join(f"{v:.2f}" for v in samples),
                         "avg_cold_start_ms": samples.mean(), "avg_duration_ms": 1.0, "avg_memory_used_mb": 40})
    pd.DataFrame(rows).to_csv(path, index=False)


def test_lambda_rows_target_the_next_measured_day_with_causal_lags(tmp_path):
    _lambda_csv(tmp_path / "lambda.csv")
    frame = load_lambda(tmp_path / "lambda.csv")
    rows = lag_features(frame)
    one = rows[rows["config"].str.startswith("lambda-perf-python312")].reset_index(drop=True)
    assert (one["target_date"] - one["date"]).dt.days.eq(1).all()
    assert one["target"].iloc[0] == pytest.approx(one["log_last"].pipe(np.exp).iloc[1])
    assert one["log_med7"].iloc[6] == pytest.approx(np.log(np.median(np.exp(one["log_last"].iloc[:7]))))


def test_lambda_trees_beat_both_baselines_on_a_drift(tmp_path):
    _lambda_csv(tmp_path / "lambda.csv", days=160)
    result = evaluate_lambda(tmp_path / "lambda.csv", split_date="2025-04-15",
                             model=LambdaLatencyModel(n_estimators=80, min_child_samples=5, num_leaves=7))
    methods = result["methods"]
    assert result["rows_test"] > 0 and result["configs"] == 2
    best = min(methods["trees"]["mae_ms"], methods["ensemble"]["mae_ms"])
    assert best < methods["trailing_median"]["mae_ms"]
    assert best < methods["last_value"]["mae_ms"]


def test_lambda_sampling_floor_is_the_error_of_a_mean_of_ten_draws_on_the_scored_days(tmp_path):
    """Draws are normal with sd 4 around each day's mean: E|mean - mu| = sqrt(2 / pi) * 4 / sqrt(10) = 1.009 ms."""
    _lambda_csv(tmp_path / "lambda.csv", days=400)
    floor = lambda_sampling_floor(tmp_path / "lambda.csv", split_date="2025-03-01")
    # 2 configurations, days from 2025-03-01 (day 59) to day 399, each with an earlier day: 2 x 341
    assert floor["days"] == 682 and floor["median_draws"] == 10
    expected = np.sqrt(2 / np.pi) * 4 / np.sqrt(10)
    assert floor["normal_ms"] == pytest.approx(expected, rel=0.08)
    assert floor["split_half_ms"] == pytest.approx(expected, rel=0.12)
    # the first measured day of a configuration is never scored, whatever the split
    early = lambda_sampling_floor(tmp_path / "lambda.csv", split_date="2024-01-01")
    assert early["days"] == 2 * 399


# --------------------------------------------------------------------------- bad rows, concurrency, transfers


def test_bad_rows_are_skipped_and_counted_never_raised():
    events = synthetic_events(60, seed=3)
    events["started_at"] = events["started_at"].astype(object)
    events.loc[0, "started_at"] = datetime(1, 1, 1, tzinfo=UTC)  # a broken clock
    events.loc[1, "total_seconds"] = np.nan
    events.loc[2, "total_seconds"] = np.inf
    events.loc[3, "image_pull_s"] = -np.inf
    events.loc[4, "started_at"] = "not a time"
    model = small_model().fit(events)
    assert model.skipped_ == {"bad_started_at": 2, "bad_total": 2, "bad_phase": 1}
    assert model.n_events_ == 55 and model.trees_ is not None
    table = model.latency_table(pd.DataFrame({"image_bytes": [9e9], "weights_bytes": [1e9]},
                                             index=pd.Index(["small"])), hour=3)
    assert np.isfinite(table["total_s"]).all()
    model.observe(events.iloc[:5])  # conditioning on bad rows skips them too
    assert len(model.history_) == 55


def test_concurrency_sweep_equals_the_overlap_matrix_definition():
    rng = np.random.default_rng(7)
    n = 400
    start = rng.integers(0, 300, n).astype("float64")  # many ties
    end = start + rng.integers(0, 30, n)  # some zero-length
    counted = rng.random(n) < 0.5
    start[::37] = np.nan
    running = (start[None, :] < start[:, None]) & (end[None, :] > start[:, None]) & counted[None, :]
    expected = np.where(np.isfinite(start), running.sum(axis=1), 0)
    assert running_at_start(start, end, counted).tolist() == expected.tolist()
    frame = pd.DataFrame({"node_id": rng.choice(["a", "b", "c"], n), "started_s": start, "total_seconds": end - start,
                          "cache_state": rng.choice(["none", "disk"], n)})
    out = with_concurrency(frame)
    node = frame["node_id"].to_numpy()
    same_node = (start[None, :] < start[:, None]) & (end[None, :] > start[:, None]) & (node[None, :] == node[:, None])
    assert out["concurrent_node_transfers"].tolist() == np.where(np.isfinite(start), same_node.sum(1), 0).tolist()


def test_transfers_set_the_pull_and_fetch_rates_of_the_prior():
    """Pre-pulls observed at 50 MB/s (the prior says 200 MB/s): the image pull prediction moves toward them."""
    models = pd.DataFrame({"image_bytes": [10e9], "weights_bytes": [16e9]}, index=pd.Index(["m"]))
    none = pd.DataFrame(columns=["model_id", "node_id", "started_at", "total_seconds", "cache_state", "image_bytes",
                                 "weights_bytes"])
    before = ColdStartModel().fit(none).latency_table(models, hour=3).set_index("state")
    transfers = pd.DataFrame({"kind": ["prepull"] * 20 + ["preload"] * 20,
                              "bytes": [5e9] * 40, "image_pull_s": [100.0] * 20 + [np.nan] * 20,
                              "weight_fetch_s": [np.nan] * 20 + [5e9 / 0.6e9] * 20})
    model = ColdStartModel().fit(none, transfers)
    after = model.latency_table(models, hour=3).set_index("state")
    # the geometric mean of 20 observed rates and the prior's rate counted 3 times
    rate = np.exp((20 * np.log(50e6) + 3 * np.log(FleetConfig().image_pull_bytes_per_s)) / 23)
    assert before.loc["none", "image_pull_s"] == pytest.approx(10e9 / 200e6)
    assert after.loc["none", "image_pull_s"] == pytest.approx(10e9 / rate)
    assert after.loc["none", "image_pull_s"] > 0.8 * 10e9 / 50e6  # most of the way to what the agents saw
    assert after.loc["none", "weight_fetch_s"] == pytest.approx(before.loc["none", "weight_fetch_s"])  # same rate
    assert after.loc["none", "total_s"] > before.loc["none", "total_s"] + 100  # the lead time moves with it
    assert after.loc["disk", "image_pull_s"] == 0.0  # a node with the weights holds the image: no pull
    assert model.rates_.n_ == {"image_pull_s": 20, "weight_fetch_s": 20}


def test_a_rate_measured_in_peak_hours_predicts_itself_at_peak_and_the_base_rate_off_peak():
    """Pre-pulls at 160 MB/s measured at 15:00 UTC (a peak hour, the prior slows rates 1.25x there): the learned
    base rate is 200 MB/s, so a peak-hour prediction is the pull time the agents saw, and off-peak is faster."""
    cfg = FleetConfig()
    models = pd.DataFrame({"image_bytes": [10e9], "weights_bytes": [16e9]}, index=pd.Index(["m"]))
    none = pd.DataFrame(columns=["model_id", "node_id", "started_at", "total_seconds", "cache_state", "image_bytes",
                                 "weights_bytes"])
    measured = cfg.image_pull_bytes_per_s / cfg.peak_slowdown * 0.5  # half the prior's peak rate
    transfers = pd.DataFrame({"kind": ["prepull"] * 1000, "bytes": [5e9] * 1000,
                              "started_at": pd.Timestamp("2026-01-05T15:00Z"),
                              "image_pull_s": [5e9 / measured] * 1000, "weight_fetch_s": np.nan})
    model = ColdStartModel(config=cfg).fit(none, transfers)
    peak = model.latency_table(models, hour=15).set_index("state")
    off_peak = model.latency_table(models, hour=3).set_index("state")
    assert peak.loc["none", "image_pull_s"] == pytest.approx(10e9 / measured, rel=0.01)
    assert off_peak.loc["none", "image_pull_s"] == pytest.approx(10e9 / measured / cfg.peak_slowdown, rel=0.01)


def test_train_save_load_through_the_registry(engine, settings, now):
    from forecaster.coldstart.service import latency_version, load_latency_model, train_latency_model
    from forecaster.forecast.registry import champion

    prior = load_latency_model(engine, settings)
    assert prior.trees_ is None and latency_version(engine, settings) is None  # nothing saved: the prior
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in ("small", "mid", "big")])
        conn.execute(text("INSERT INTO model_versions (id, status, path) VALUES ('f1', 'champion', 'models/f1')"))
        # rows ingest would refuse, written behind its back: the model must skip them, not crash; the one dated
        # in year 1 lies outside the retrain's window (the 30 days before the newest) and is not even read
        conn.execute(text("INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, source) "
                          "VALUES ('small', 'node-0', '0001-01-01T00:00:00Z', 30, 'manual'), "
                          "('small', 'node-0', :t, 'NaN', 'manual')"), {"t": now - timedelta(days=2)})
    events = synthetic_events(60, start=now - timedelta(days=3))
    push_cold_starts(engine, settings, [
        {"model_id": r.model_id, "node_id": r.node_id, "started_at": r.started_at.isoformat(),
         "total_seconds": r.total_seconds, "cache_state": r.cache_state, **{p: getattr(r, p) for p in PHASES}}
        for r in events.itertuples()], now=now)
    first = train_latency_model(engine, settings, now, tree_params=SMALL_TREES)
    loaded = load_latency_model(engine, settings)
    assert loaded is load_latency_model(engine, settings)  # cached per version
    assert loaded.trees_ is not None and loaded.n_events_ == 60 and loaded.skipped_ == {"bad_total": 1}
    assert (settings.models_dir / first / "metadata.json").exists()
    second = train_latency_model(engine, settings, now + timedelta(days=1), tree_params=SMALL_TREES)
    with engine.connect() as conn:
        rows = dict(conn.execute(text("SELECT id, status FROM model_versions WHERE kind = 'latency'")).all())
    assert rows == {first: "retired", second: "champion"}
    assert champion(engine).id == "f1"  # the forecasting champion is another kind, untouched
    assert latency_version(engine, settings) == second


def _one_model_events(n: int, *, seconds: float, state: str | None, start: datetime, node: str = "n1"
                      ) -> pd.DataFrame:
    return pd.DataFrame({"model_id": "a", "node_id": node, "started_at": [start + timedelta(minutes=7 * k)
                                                                           for k in range(n)],
                         "total_seconds": seconds, "cache_state": state, "image_bytes": 9e9, "weights_bytes": 1e9})


def test_a_start_of_unknown_tier_is_never_learned_as_a_start_from_nothing():
    """The collector leaves cache_state out when it found no Pulled event, the API calls such starts 'unknown':
    ten warm 16 s starts without a tier must not teach the model that a start from nothing takes 16 s."""
    t0 = datetime(2026, 11, 20, tzinfo=UTC)
    known = pd.concat([_one_model_events(40, seconds=120.0, state="none", start=t0),
                       _one_model_events(20, seconds=16.0, state="host", start=t0 + timedelta(minutes=3))],
                      ignore_index=True)
    unknown = _one_model_events(10, seconds=16.0, state=None, start=t0 + timedelta(days=1))
    sizes = pd.DataFrame({"image_bytes": [9e9], "weights_bytes": [1e9]}, index=pd.Index(["a"]))

    def from_nothing(model: ColdStartModel) -> float:
        table = model.latency_table(sizes, hour=3, nodes=["n1"])
        return float(table.loc[table["state"] == "none", "total_s"].iloc[0])

    clean = small_model().fit(known)
    fitted = small_model().fit(pd.concat([known, unknown], ignore_index=True))
    assert from_nothing(clean) > 60
    assert from_nothing(fitted) == pytest.approx(from_nothing(clean))
    assert fitted.skipped_ == {"unknown_cache_state": 10} and fitted.n_events_ == 60
    observed = small_model().fit(known)
    observed.observe(unknown)  # conditioning on newer starts skips them too
    assert len(observed.history_) == 60 and from_nothing(observed) == pytest.approx(from_nothing(clean))


def test_a_zero_second_total_is_skipped_not_learned():
    """A total of 0 (or 1e-320) stored before ingest refused it is no cold start: three of them drove the
    from-nothing prediction to 2.5 s."""
    events = synthetic_events(60, seed=4)
    events.loc[0, "total_seconds"] = 0.0
    events.loc[1, "total_seconds"] = 1e-320
    events.loc[2, "total_seconds"] = 0.05
    model = small_model().fit(events)
    assert model.skipped_ == {"bad_total": 3} and model.n_events_ == 57
    observed = small_model().fit(events.iloc[3:])
    observed.observe(events.iloc[:3])  # conditioning on them skips them too
    assert len(observed.history_) == 57
