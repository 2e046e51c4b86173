"""The per-node latency table as arrays: the model's fast path against its row-by-row predictions, and the
planner's array reduction against the long-frame pandas semantics it replaced (random fleets)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest

from forecaster.coldstart.model import ColdStartModel
from forecaster.coldstart.physics import phase_seconds
from forecaster.contracts.fleet import FleetState
from forecaster.contracts.latency import NodeLatencyTable
from forecaster.contracts.phases import PHASES, START_STATES, STATE_RANK
from forecaster.planning.fleet import latency_table, masked_median, node_latency, node_states

UTC = timezone.utc
SMALL_TREES = {"n_estimators": 60, "learning_rate": 0.1, "num_leaves": 7, "min_child_samples": 5}


# --------------------------------------------------------------------------- the old long-frame semantics


def reference_node_states(fleet) -> pd.DataFrame:
    """node_states as it was (a models x nodes long frame), the reference for the array version."""
    models = fleet.models.index.astype(str)
    nodes = fleet.nodes.index.astype(str)
    rank = np.zeros((len(models), len(nodes)), dtype=np.int64)
    node_pos = pd.Index(nodes)
    if len(fleet.images):
        refs = fleet.models["image_ref"].astype(str).to_numpy()
        held = fleet.images.assign(pos=node_pos.get_indexer(fleet.images["node_id"].astype(str)))
        held = held[held["pos"] >= 0]
        for ref, rows in held.groupby(held["image_ref"].astype(str))["pos"]:
            rank[np.ix_(np.flatnonzero(refs == ref), rows.to_numpy())] = STATE_RANK["image"]
    if len(fleet.cache):
        cache = fleet.cache[fleet.cache["state"].isin(START_STATES)]
        m = models.get_indexer(cache["model_id"].astype(str))
        n = node_pos.get_indexer(cache["node_id"].astype(str))
        ok = (m >= 0) & (n >= 0)
        np.maximum.at(rank, (m[ok], n[ok]), cache["state"].map(STATE_RANK).to_numpy(dtype=np.int64)[ok])
    return pd.DataFrame({"model_id": np.repeat(models.to_numpy(dtype=object), len(nodes)),
                         "node_id": np.tile(nodes.to_numpy(dtype=object), len(models)),
                         "state": np.asarray(START_STATES, dtype=object)[rank.ravel()]})


def reference_node_latency(latency: pd.DataFrame, fleet=None) -> pd.DataFrame:
    """node_latency as it was: pandas groupby medians and merges over the long per-node frame."""
    frame = latency.assign(model_id=latency["model_id"].astype(str), node_id=latency["node_id"].astype(str))
    value_columns = [c for c in ("total_s", *PHASES) if c in frame.columns]
    everywhere = frame.groupby(["model_id", "state"], sort=False)[value_columns].median()
    if fleet is None or not len(fleet.nodes):
        return everywhere.reset_index()
    gpus = fleet.models["gpus"].astype("float64")
    gpus.index = gpus.index.astype(str)
    free = fleet.nodes["gpus_free"].astype("float64")
    free.index = free.index.astype(str)
    room = free.reindex(frame["node_id"]).to_numpy() >= gpus.reindex(frame["model_id"]).to_numpy()
    with_room = frame[room].groupby(["model_id", "state"], sort=False)[value_columns].median()
    held = reference_node_states(fleet)
    here = frame.merge(held, on=["model_id", "node_id"], how="left", suffixes=("", "_held"))
    here = here[room & (here["state"] == here["state_held"]).to_numpy()]
    on_holders = here.groupby(["model_id", "state"], sort=False)[value_columns].median()
    out = on_holders.combine_first(with_room).combine_first(everywhere)
    return out.reset_index()


def random_fleet(rng, n_models: int, n_nodes: int, extra_nodes: int = 0):
    """Models needing 1-8 GPUs, nodes with 0-8 free, images and cache entries on random nodes; the latency frame
    also covers ``extra_nodes`` nodes the fleet does not have and misses some cells (NaN)."""
    models = [f"m{i}" for i in range(n_models)]
    nodes = [f"n{k}" for k in range(n_nodes)]
    gpus = rng.choice([1, 2, 4, 8], n_models)
    fleet = FleetState.build(
        models=[{"model_id": m, "image_ref": f"reg/img{i % 5}:1", "gpus": float(g)}
                for i, (m, g) in enumerate(zip(models, gpus))],
        nodes=[{"node_id": n, "gpus_free": int(rng.integers(0, 9))} for n in nodes],
        cache=[{"node_id": str(rng.choice(nodes)), "model_id": str(rng.choice(models)),
                "state": str(rng.choice(["disk", "host", "gpu", "image"]))} for _ in range(n_models)],
        images=[{"node_id": str(rng.choice(nodes)), "image_ref": f"reg/img{j}:1"} for j in range(3)])
    all_nodes = nodes + [f"x{k}" for k in range(extra_nodes)]
    rows = [(m, n, s) for n in all_nodes for m in models for s in START_STATES]
    frame = pd.DataFrame(rows, columns=["model_id", "node_id", "state"])
    # few distinct values, so medians over even counts and ties both occur
    frame["total_s"] = rng.choice([5.0, 7.5, 20.0, 31.0, 64.0, 100.0], len(frame))
    frame.loc[rng.random(len(frame)) < 0.1, "total_s"] = np.nan
    for phase in PHASES[:2]:
        frame[phase] = rng.uniform(0, 50, len(frame))
    return fleet, frame


def as_series(frame: pd.DataFrame, column: str) -> pd.Series:
    return frame.set_index(["model_id", "state"])[column].sort_index()


@pytest.mark.parametrize("seed", range(6))
def test_the_array_reduction_matches_the_long_frame_one(seed):
    rng = np.random.default_rng(seed)
    fleet, frame = random_fleet(rng, n_models=int(rng.integers(3, 30)), n_nodes=int(rng.integers(1, 12)),
                                extra_nodes=int(rng.integers(0, 3)))
    for over in (fleet, None):
        want = reference_node_latency(frame, over)
        got = node_latency(frame, over)
        for column in ("total_s", *PHASES[:2]):
            pd.testing.assert_series_equal(as_series(got, column), as_series(want, column), check_dtype=False)
        # the planner's aligned arrays (a colder state filling a missing warmer one) agree as well
        ids = pd.Index(fleet.models.index.astype(str).tolist() + ["not-in-table"])
        new = latency_table(frame, ids, over)
        old = latency_table(reference_node_latency(frame, over), ids, over)
        assert set(new) == set(old)
        for key in old:
            np.testing.assert_array_equal(new[key], old[key])


def test_the_reduction_picks_holders_then_room_then_every_node():
    """A wrong set (ignoring the cache, or the free GPUs) gives a different number here, so the test can fail."""
    fleet = FleetState.build(
        models=[{"model_id": "a", "image_ref": "reg/a:1", "gpus": 2.0}],
        nodes=[{"node_id": "holder", "gpus_free": 8}, {"node_id": "other", "gpus_free": 8},
               {"node_id": "full", "gpus_free": 1}],
        cache=[{"node_id": "holder", "model_id": "a", "state": "host"},
               {"node_id": "full", "model_id": "a", "state": "disk"}])
    totals = {"holder": 10.0, "other": 30.0, "full": 1000.0}
    frame = pd.DataFrame([("a", n, s, totals[n]) for n in totals for s in START_STATES],
                         columns=["model_id", "node_id", "state", "total_s"])
    got = as_series(node_latency(frame, fleet), "total_s")
    assert got[("a", "host")] == 10.0  # on the one node with room holding it in host memory
    assert got[("a", "none")] == 30.0  # the node with room holding nothing
    assert got[("a", "disk")] == 20.0  # its disk holder has no room: median over the two with room
    no_room = FleetState.build(models=[{"model_id": "a", "gpus": 16.0}],
                               nodes=[{"node_id": n, "gpus_free": 8} for n in totals])
    assert as_series(node_latency(frame, no_room), "total_s")[("a", "none")] == 30.0  # median of all three


def test_node_states_is_the_old_frame():
    rng = np.random.default_rng(7)
    fleet, _ = random_fleet(rng, 25, 9)
    pd.testing.assert_frame_equal(node_states(fleet), reference_node_states(fleet))


def test_masked_median_is_pandas_median():
    rng = np.random.default_rng(1)
    values = rng.choice([1.0, 2.0, 3.5, np.nan, 10.0], (200, 7))
    mask = rng.random((200, 7)) < 0.6
    want = pd.DataFrame(np.where(mask, values, np.nan)).median(axis=1, skipna=True).to_numpy()
    np.testing.assert_array_equal(masked_median(values, mask), want)


def test_bad_frames_are_refused():
    frame = pd.DataFrame({"model_id": ["a", "a"], "node_id": ["n", "n"], "state": ["none", "none"],
                          "total_s": [1.0, 2.0]})
    with pytest.raises(ValueError, match="duplicate"):
        NodeLatencyTable.from_frame(frame)
    with pytest.raises(ValueError, match="unknown start states"):
        NodeLatencyTable.from_frame(frame.assign(state=["none", "warm"]))


# --------------------------------------------------------------------------- the model's fast path


NODES = {"fast": (1.0, 3.125e9), "slow": (5.0, 3.125e9), "thin": (1.5, 1.25e9), "wide": (0.8, 12.5e9)}


def events(n: int, seed: int = 0) -> pd.DataFrame:
    """Cold starts of six models on four nodes of different speeds and bandwidths."""
    rng = np.random.default_rng(seed)
    start = datetime(2026, 11, 20, tzinfo=UTC)
    sizes = [(9e9, 1e9), (12.6e9, 16e9), (5e9, 60e9), (7e9, 4e9), (11e9, 30e9), (6e9, 2e9)]
    rows = []
    for k in range(n):
        i = int(rng.integers(0, len(sizes)))
        node = str(rng.choice(list(NODES)))
        slow, bandwidth = NODES[node]
        state = int(rng.integers(0, 4))
        when = start + timedelta(minutes=17 * k)
        phases = phase_seconds(np.array([sizes[i][0]]), np.array([sizes[i][1]]), np.array([state]), hour=when.hour,
                               node_bytes_per_s=np.array([bandwidth]))
        values = {p: float(phases[p][0]) * slow * rng.lognormal(0, 0.15) for p in PHASES}
        rows.append({"model_id": f"m{i}", "node_id": node, "started_at": when, "total_seconds": sum(values.values()),
                     **values, "cache_state": START_STATES[state], "image_bytes": sizes[i][0],
                     "weights_bytes": sizes[i][1], "node_bytes_per_s": bandwidth})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def fitted() -> ColdStartModel:
    return ColdStartModel(tree_params=SMALL_TREES).fit(events(500))


def catalogue(n_new: int = 5) -> pd.DataFrame:
    rng = np.random.default_rng(11)
    known = events(500).drop_duplicates("model_id").set_index("model_id")[["image_bytes", "weights_bytes"]]
    new = pd.DataFrame({"image_bytes": rng.uniform(4e9, 15e9, n_new), "weights_bytes": rng.uniform(1e9, 90e9, n_new)},
                       index=pd.Index([f"new{i}" for i in range(n_new)], name="model_id"))
    return pd.concat([known, new])


def test_the_fast_table_is_the_row_by_row_prediction(fitted):
    """Every (model, node, state) cell equals predict() on that row: nodes with and without history, with their
    own bandwidths, models with and without history on them."""
    assert fitted.trees_ is not None and fitted.weight_ + fitted.node_weight_ > 0
    nodes = pd.DataFrame({"node_bytes_per_s": [np.nan, np.nan, np.nan, 6.25e9, np.nan]},
                         index=pd.Index(["fast", "slow", "thin", "wide", "never-seen"], name="node_id"))
    models = catalogue()
    table = fitted.node_latency_table(models, hour=14, nodes=nodes)
    base = fitted._base_rows(models, hour=14, concurrent=0.0, registry_pulls=0.0)
    ids, bandwidth = fitted._node_inputs(nodes)
    reference = fitted._node_totals_by_row(base, ids, bandwidth)
    np.testing.assert_allclose(table.total_s, reference, rtol=1e-6)
    assert table.total_s.dtype == np.float32
    # the nodes differ (the test would not see a node-blind fast path otherwise)
    assert np.ptp(table.total_s, axis=1).max() > 1.0
    long = fitted.latency_table(models, hour=14, nodes=nodes)
    assert list(long.columns) == ["model_id", "node_id", "state", "total_s", *PHASES]
    assert long["node_id"].iloc[0] == "fast" and long["model_id"].iloc[len(START_STATES)] == models.index[1]


def test_the_kept_node_side_follows_the_nodes(fitted):
    """The grid keeps the node side of recent tables (the columns of every question about a few models): two node
    sets of the same shape, asked in turn, each get their own row-by-row answer."""
    models = catalogue(2)
    base = fitted._base_rows(models, hour=9, concurrent=0.0, registry_pulls=0.0)
    index = pd.Index(["fast", "slow", "thin", "wide"], name="node_id")
    tables = {}
    for name, wide in (("a", 6.25e9), ("b", 4e7), ("a", 6.25e9), ("b", 4e7)):
        nodes = pd.DataFrame({"node_bytes_per_s": [np.nan, np.nan, np.nan, wide]}, index=index)
        table = fitted.node_latency_table(models, hour=9, nodes=nodes).total_s
        ids, bandwidth = fitted._node_inputs(nodes)
        np.testing.assert_allclose(table, fitted._node_totals_by_row(base, ids, bandwidth), rtol=1e-6)
        tables.setdefault(name, []).append(table)
    assert np.array_equal(tables["a"][0], tables["a"][1]) and np.array_equal(tables["b"][0], tables["b"][1])
    assert not np.allclose(tables["a"][0][:, 3], tables["b"][0][:, 3])  # the wide node's bandwidth tells


def test_the_prior_alone_per_node(fitted):
    """With too few events the prior answers, per node at that node's bandwidth."""
    prior = ColdStartModel(tree_params=SMALL_TREES).fit(events(10))
    assert prior.trees_ is None
    nodes = pd.DataFrame({"node_bytes_per_s": [5e7, 12.5e9]}, index=pd.Index(["thin", "wide"]))
    models = catalogue(2)
    table = prior.node_latency_table(models, hour=3, nodes=nodes)
    base = prior._base_rows(models, hour=3, concurrent=0.0, registry_pulls=0.0)
    ids, bandwidth = prior._node_inputs(nodes)
    np.testing.assert_allclose(table.total_s, prior._node_totals_by_row(base, ids, bandwidth), rtol=1e-6)
    assert (table.total_s[:, 0, 0] > table.total_s[:, 1, 0]).all()  # a 50 MB/s node pulls slower


def test_a_booster_without_a_grid_form_is_refused_by_name():
    """Categorical splits and multi-tree iterations have no two-sided form: TreeGrid says so, it does not guess."""
    import lightgbm as lgb

    from forecaster.coldstart.treegrid import TreeGrid, UnsupportedBooster

    rng = np.random.default_rng(5)
    x = np.column_stack([rng.integers(0, 6, 400), rng.normal(size=400)]).astype("float64")
    y = np.where(x[:, 0] % 2 == 0, 3.0, -3.0) + x[:, 1]
    params = {"verbose": -1, "min_data_in_leaf": 5, "min_data_per_group": 5, "cat_smooth": 1.0}
    categorical = lgb.train(params, lgb.Dataset(x, y, categorical_feature=[0]), num_boost_round=5)
    assert any(t["tree_structure"].get("decision_type") == "==" for t in categorical.dump_model()["tree_info"])
    with pytest.raises(UnsupportedBooster, match="categorical"):
        TreeGrid(categorical)
    classes = lgb.train({**params, "objective": "multiclass", "num_class": 3},
                        lgb.Dataset(x, rng.integers(0, 3, 400)), num_boost_round=3)
    with pytest.raises(UnsupportedBooster, match="3 trees per iteration"):
        TreeGrid(classes)
    plain = lgb.train(params, lgb.Dataset(x, y), num_boost_round=5)
    TreeGrid(plain)  # a regression booster on numerical splits has one


def test_a_booster_the_grid_refuses_is_predicted_row_by_row(fitted, monkeypatch):
    """The fallback answers the same cells, and warns that it took the slow path."""
    from forecaster.coldstart.treegrid import UnsupportedBooster

    nodes = pd.DataFrame({"node_bytes_per_s": [np.nan, 6.25e9]}, index=pd.Index(["fast", "wide"], name="node_id"))
    models = catalogue(2)
    fast = fitted.node_latency_table(models, hour=9, nodes=nodes)

    def refuse(booster):
        raise UnsupportedBooster("split '==' (categorical) has no grid form")

    monkeypatch.setattr(fitted, "_tree_grid", refuse)
    with pytest.warns(RuntimeWarning, match="row by row .split '=='"):
        slow = fitted.node_latency_table(models, hour=9, nodes=nodes)
    np.testing.assert_allclose(slow.total_s, fast.total_s, rtol=1e-6)
