"""The latency model per node: a node's own history, the fallback without one, hours never seen, the planner's node."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest

from forecaster.coldstart.model import ColdStartModel, baseline_predictions
from forecaster.coldstart.physics import phase_seconds
from forecaster.contracts.fleet import FleetState
from forecaster.contracts.phases import PHASES
from forecaster.planning.fleet import latency_table, node_latency

UTC = timezone.utc
SMALL_TREES = {"n_estimators": 60, "learning_rate": 0.1, "num_leaves": 7, "min_child_samples": 5}
SIZES = {"small": (9e9, 1e9), "mid": (12.6e9, 16e9)}
#: the hidden speed of each node: every phase on "slow" takes this many times the physics
SLOWDOWN = {"fast": 1.0, "slow": 6.0}


def node_events(n: int, seed: int = 0, hours: tuple[int, int] = (0, 24)) -> pd.DataFrame:
    """Cold starts on a fast and a slow node (6x every phase), both reporting the same bandwidth."""
    rng = np.random.default_rng(seed)
    start = datetime(2026, 11, 20, tzinfo=UTC)
    rows = []
    for k in range(n):
        model = ("small", "mid")[k % 2]
        node = ("fast", "slow")[(k // 2) % 2]
        state = int(rng.integers(0, 4))
        day, minute = divmod(k * 23, (hours[1] - hours[0]) * 60)
        when = start + timedelta(days=day, hours=hours[0], minutes=minute)
        image, weights = SIZES[model]
        phases = phase_seconds(np.array([image]), np.array([weights]), np.array([state]), hour=when.hour)
        values = {p: float(phases[p][0]) * SLOWDOWN[node] * rng.lognormal(0, 0.1) for p in PHASES}
        rows.append({"model_id": model, "node_id": node, "started_at": when, "total_seconds": sum(values.values()),
                     **values, "cache_state": ("none", "image", "disk", "host")[state], "image_bytes": image,
                     "weights_bytes": weights})
    return pd.DataFrame(rows)


def models() -> pd.DataFrame:
    return pd.DataFrame({"image_bytes": [s[0] for s in SIZES.values()], "weights_bytes": [s[1] for s in SIZES.values()]},
                        index=pd.Index(list(SIZES), name="model_id"))


@pytest.fixture(scope="module")
def fitted() -> ColdStartModel:
    return ColdStartModel(tree_params=SMALL_TREES).fit(node_events(240))


def test_two_nodes_with_different_histories_get_different_predictions(fitted):
    table = fitted.latency_table(models(), hour=3, nodes=["fast", "slow", "never-seen"])
    assert set(table.columns) >= {"model_id", "node_id", "state", "total_s", *PHASES}
    assert len(table) == 2 * 3 * 4
    by = table.set_index(["model_id", "node_id", "state"])["total_s"]
    for model in SIZES:
        for state in ("none", "image", "disk", "host"):
            fast, slow = by[(model, "fast", state)], by[(model, "slow", state)]
            assert slow > 3.0 * fast, (model, state, fast, slow)  # the truth is 6x
    # a node with no history falls back to the model's and tier's history: the node-less answer
    plain = fitted.latency_table(models(), hour=3).set_index(["model_id", "state"])["total_s"]
    unseen = table[table["node_id"] == "never-seen"].set_index(["model_id", "state"])["total_s"]
    pd.testing.assert_series_equal(unseen, plain.loc[unseen.index], check_names=False)
    assert ((unseen > by.xs("fast", level="node_id").loc[unseen.index])
            & (unseen < by.xs("slow", level="node_id").loc[unseen.index])).all()


def test_per_node_model_beats_per_node_baselines_on_held_out_starts(fitted):
    events = node_events(360, seed=3)
    train, test = events.iloc[:240], events.iloc[240:]
    model = ColdStartModel(tree_params=SMALL_TREES).fit(train)
    predicted = model.predict(test)["total_seconds"].to_numpy()
    base = baseline_predictions(train, test)
    actual = base["actual"].to_numpy()
    mae = np.abs(predicted - test["total_seconds"].to_numpy()).mean()
    for name in ("trailing_median", "node_trailing_median", "node_state_trailing_median"):
        assert mae < np.abs(base[name].to_numpy() - actual).mean(), name
    # members were chosen on the validation tail of the training window, from the grids
    assert model.validation_["events"] == 48
    assert model.weight_ in model.weights_grid and model.node_weight_ in model.node_weights_grid
    assert model.validation_["mae_s"]["chosen"] <= model.validation_["mae_s"]["trees"] + 1e-9


def test_hours_never_seen_are_not_extrapolated():
    """Trained only on 00:00-06:00 starts: an off-peak hour never seen predicts what a seen off-peak hour does."""
    model = ColdStartModel(tree_params=SMALL_TREES).fit(node_events(200, hours=(0, 6)))
    seen = model.latency_table(models(), hour=2, nodes=["fast", "slow"])
    unseen = model.latency_table(models(), hour=23, nodes=["fast", "slow"])
    assert unseen["total_s"].to_numpy() == pytest.approx(seen["total_s"].to_numpy(), rel=1e-12)


def test_bad_nodes_argument_is_a_clear_error(fitted):
    with pytest.raises(ValueError, match="node id"):
        fitted.latency_table(models(), hour=3, nodes="fast")
    with pytest.raises(ValueError, match="node id"):
        fitted.latency_table(models(), hour=3, nodes=["fast", ""])


def test_save_load_keeps_per_node_answers(fitted, tmp_path):
    again = ColdStartModel.load(fitted.save(tmp_path / "m"))
    pd.testing.assert_frame_equal(fitted.latency_table(models(), hour=5, nodes=["fast", "slow"]),
                                  again.latency_table(models(), hour=5, nodes=["fast", "slow"]))


def test_the_planner_reads_the_node_a_start_would_use(fitted):
    """mid's weights are on disk only on the slow node, the full node has no GPU free: the planner's disk start
    of mid is the slow node's, its start from nothing the fast node's."""
    fleet = FleetState.build(
        models=[{"model_id": m, "image_ref": f"reg/{m}:1", "image_bytes": i, "weights_uri": f"s3://w/{m}",
                 "weights_bytes": w, "gpus": 1, "replica_rpm": 60.0, "cold_cost": 1.0, "slo_s": np.nan,
                 "replicas": 0} for m, (i, w) in SIZES.items()],
        nodes=[{"node_id": "fast", "gpus_free": 8}, {"node_id": "slow", "gpus_free": 8},
               {"node_id": "full", "gpus_free": 0}],
        cache=[{"node_id": "slow", "model_id": "mid", "state": "disk"}])
    table = fitted.latency_table(models(), hour=3, nodes=["fast", "slow", "full"])
    by = table.set_index(["model_id", "node_id", "state"])["total_s"]
    reduced = node_latency(table, fleet).set_index(["model_id", "state"])["total_s"]
    assert reduced[("mid", "disk")] == pytest.approx(by[("mid", "slow", "disk")])
    # from nothing: the one node with room that holds nothing of mid
    assert reduced[("mid", "none")] == pytest.approx(by[("mid", "fast", "none")])
    # no node holds small's weights: its disk figure is the median over the nodes with room
    assert reduced[("small", "disk")] == pytest.approx(np.median([by[("small", "fast", "disk")],
                                                                  by[("small", "slow", "disk")]]))
    aligned = latency_table(table, pd.Index(["mid", "small"]), fleet)
    assert aligned["disk"][0] == pytest.approx(by[("mid", "slow", "disk")])
