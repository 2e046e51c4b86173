"""The planner's cost settings and the latency table it reads (the fleet state is in :mod:`forecaster.contracts.fleet`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from forecaster.contracts.phases import PHASES, START_STATES, STATE_RANK


@dataclass(frozen=True)
class PlannerSettings:
    """Cost settings and guardrails of the planner.

    Attributes:
        horizon_min: minutes ahead to plan (forecast horizons used).
        gpu_second_cost: price of one idle GPU-second (the unit of all costs).
        count_queued_wait: charge a cold start for every request that queues
            behind it (D + lambda D^2 / 2 seconds of wait) rather than for the
            first request only (D seconds).
        replica_utilisation: share of a replica's capacity planned to be used.
        gpu_budget: GPUs the planner may hold warm across all models (None: the
            fleet's GPUs in use by models plus the free ones, less ``gpu_headroom``).
        gpu_headroom: share of those GPUs left for the reactive path when the
            budget is not set.
        max_transfers_per_node: concurrent pulls/fetches per node.
        max_transfers_per_registry: concurrent pulls per image registry or
            weights bucket (the thundering herd guard).
        tiers: plan prepull/preload (False: scale-ahead only).
        max_tier_nodes: nodes prepared per model at most.
        max_tier_actions: prepull/preload actions per plan at most, the most
            valuable first (the rest wait for a later plan).
        byte_cost: GPU-second equivalent of moving one byte from a registry/S3.
        host_byte_second_cost: GPU-second equivalent of holding one byte of host
            memory for one second (disk is taken as free).
        lead_margin_s, lead_margin_frac: start actions this much earlier than the
            predicted latency (absolute + relative safety margin).
        release_hold_min: minutes of forecast below the current replicas before
            a release (hysteresis; 0 releases as soon as the next minute allows).
        quantile_for_shape: level used to size replicas beyond the first when the
            newsvendor level falls outside the forecast's levels.
    """

    horizon_min: int = 5
    gpu_second_cost: float = 1.0
    count_queued_wait: bool = True
    replica_utilisation: float = 0.8
    gpu_budget: float | None = None
    gpu_headroom: float = 0.1
    max_transfers_per_node: int = 2
    max_transfers_per_registry: int = 48
    tiers: bool = True
    max_tier_nodes: int = 8
    max_tier_actions: int = 64
    byte_cost: float = 2e-10
    host_byte_second_cost: float = 2e-13
    lead_margin_s: float = 5.0
    lead_margin_frac: float = 0.2
    release_hold_min: int = 0
    quantile_for_shape: float = 0.9

    def lead(self, seconds: np.ndarray | float) -> np.ndarray | float:
        """Lead time for an action predicted to take ``seconds``."""
        return np.asarray(seconds) * (1.0 + self.lead_margin_frac) + self.lead_margin_s


def latency_table(latency: pd.DataFrame, model_ids: pd.Index, fleet=None) -> dict[str, np.ndarray]:
    """Per start state, (N,) predicted totals and phases aligned to ``model_ids`` (NaN where missing).

    A per-node latency frame (with a ``node_id`` column, see
    :meth:`forecaster.coldstart.model.ColdStartModel.latency_table`) is first
    reduced to one row per (model, state) by :func:`node_latency`, for the
    nodes of ``fleet`` a replica could start on (all its nodes when ``fleet`` is None).
    """
    missing = [c for c in ("model_id", "state", "total_s") if c not in latency.columns]
    if missing:
        raise ValueError(f"latency lacks columns {missing}")
    if "node_id" in latency.columns:
        latency = node_latency(latency, fleet)
    # numpy, not a pandas select/drop_duplicates/reindex per state: every replayed minute calls this
    out: dict[str, np.ndarray] = {}
    state = latency["state"].to_numpy()
    model = latency["model_id"].to_numpy()
    values = {c: latency[c].to_numpy(dtype="float64") for c in ("total_s", *PHASES) if c in latency.columns}
    for s in START_STATES:
        rows = np.flatnonzero(state == s)
        first = rows[~pd.Index(model[rows]).duplicated(keep="first")]  # the row drop_duplicates keeps
        pos = pd.Index(model[first]).get_indexer(model_ids)
        found = pos >= 0
        take = first[np.maximum(pos, 0)] if len(first) else np.zeros(len(pos), dtype=np.int64)
        for c, v in values.items():
            aligned = np.where(found, v[take], np.nan) if len(first) else np.full(len(pos), np.nan)
            out[s if c == "total_s" else f"{s}:{c}"] = aligned
    # a state missing from the table costs what the next colder state costs
    for colder, warmer in zip(START_STATES, START_STATES[1:]):
        out[warmer] = np.where(np.isnan(out[warmer]), out[colder], out[warmer])
    return out


def node_states(fleet) -> pd.DataFrame:
    """Per (model, node) the warmest state the node holds for the model (``none`` where nothing): long frame.

    Columns ``model_id, node_id, state``; every model of ``fleet`` on every node.
    """
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


def node_latency(latency: pd.DataFrame, fleet=None) -> pd.DataFrame:
    """One row per (model, state) from a per-node latency frame: the nodes a start from that state would use.

    A start from state ``s`` happens on a node whose warmest state for the
    model is ``s`` and that has room for a replica (``gpus_free`` at least the
    model's ``gpus``): ``total_s`` is the median over those nodes. Where no
    node qualifies (or ``fleet`` is None) it is the median over the nodes with
    room, else over every node in the frame. Phases are the median too.
    """
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
    held = node_states(fleet)
    here = frame.merge(held, on=["model_id", "node_id"], how="left", suffixes=("", "_held"))
    here = here[room & (here["state"] == here["state_held"]).to_numpy()]
    on_holders = here.groupby(["model_id", "state"], sort=False)[value_columns].median()
    out = on_holders.combine_first(with_room).combine_first(everywhere)
    return out.reset_index()
