"""The planner's cost settings and the latency table it reads (the fleet state is in :mod:`forecaster.contracts.fleet`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from forecaster.contracts.latency import NodeLatencyTable
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
        quantile_for_shape: with the top level, the two quantiles through which an
            exponential tail is drawn when the newsvendor level is above the forecast's
            top level (:meth:`~forecaster.planning.planner.ForecastArrays.quantile`);
            at or above the top level, sizing stops at the top quantile.
        cold_cost_weighting: ``"model"``: each model's cold cost is multiplied by the mean request rate of the
            planned models over its own (the forecast's ``request_rate_rpm``), so every model's share of
            cold-start requests weighs alike; ``"request"``: cold costs as given (every request's wait alike).
            See :func:`forecaster.planning.step.weighted_cold_costs`.
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
    cold_cost_weighting: str = "model"

    def lead(self, seconds: np.ndarray | float) -> np.ndarray | float:
        """Lead time for an action predicted to take ``seconds``."""
        return np.asarray(seconds) * (1.0 + self.lead_margin_frac) + self.lead_margin_s


def latency_table(latency, model_ids: pd.Index, fleet=None) -> dict[str, np.ndarray]:
    """Per start state, (N,) predicted totals and phases aligned to ``model_ids`` (NaN where missing).

    ``latency`` is a frame with one row per (model, state), or a per-node table:
    a :class:`~forecaster.contracts.latency.NodeLatencyTable` (what the latency
    model's service answers, see
    :meth:`forecaster.coldstart.model.ColdStartModel.node_latency_table`) or a
    long frame with a ``node_id`` column. A per-node table is first reduced to
    one value per (model, state) by :func:`node_latency`, for the nodes of
    ``fleet`` a replica could start on (all its nodes when ``fleet`` is None).
    """
    if isinstance(latency, NodeLatencyTable):
        return _aligned(reduce_node_latency(latency, fleet), latency.model_ids, model_ids)
    missing = [c for c in ("model_id", "state", "total_s") if c not in latency.columns]
    if missing:
        raise ValueError(f"latency lacks columns {missing}")
    if "node_id" in latency.columns:
        table = NodeLatencyTable.from_frame(latency)
        return _aligned(reduce_node_latency(table, fleet), table.model_ids, model_ids)
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
    return _colder_fills(out)


def _colder_fills(out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A state missing from the table costs what the next colder state costs."""
    for colder, warmer in zip(START_STATES, START_STATES[1:]):
        out[warmer] = np.where(np.isnan(out[warmer]), out[colder], out[warmer])
    return out


def _aligned(reduced: dict[str, np.ndarray], table_ids: pd.Index, model_ids: pd.Index) -> dict[str, np.ndarray]:
    """:func:`latency_table`'s answer from :func:`reduce_node_latency`'s (M, S) arrays, rows as ``model_ids``."""
    pos = pd.Index(table_ids.astype(str)).get_indexer(pd.Index(model_ids).astype(str))
    found = pos >= 0
    take = np.maximum(pos, 0)
    out: dict[str, np.ndarray] = {}
    for column, values in reduced.items():
        for k, s in enumerate(START_STATES):
            aligned = np.where(found, values[take, k], np.nan) if len(table_ids) else np.full(len(pos), np.nan)
            out[s if column == "total_s" else f"{s}:{column}"] = aligned
    return _colder_fills(out)


def node_state_ranks(fleet, model_ids: pd.Index | None = None, node_ids: pd.Index | None = None) -> np.ndarray:
    """(models, nodes) int8: the rank in :data:`START_STATES` of the warmest state each node holds for each model.

    0 (``none``) where the node holds nothing for the model. Rows follow ``model_ids`` and columns ``node_ids``
    (default the fleet's own; a model or node not in the fleet holds nothing).
    """
    models = fleet.models.index.astype(str) if model_ids is None else pd.Index(model_ids).astype(str)
    nodes = fleet.nodes.index.astype(str) if node_ids is None else pd.Index(node_ids).astype(str)
    rank = np.zeros((len(models), len(nodes)), dtype=np.int8)
    if len(fleet.images) and len(models) and len(nodes):
        refs = fleet.models["image_ref"].astype(str)
        refs.index = refs.index.astype(str)
        refs = refs.reindex(models).fillna("").to_numpy(dtype=object)
        held = fleet.images.assign(pos=nodes.get_indexer(fleet.images["node_id"].astype(str)))
        held = held[held["pos"] >= 0]
        ref_pos = pd.Index(pd.unique(held["image_ref"].astype(str)))
        model_ref = ref_pos.get_indexer(pd.Index(refs).astype(str))
        by_ref = np.zeros((len(ref_pos), len(nodes)), dtype=bool)
        by_ref[ref_pos.get_indexer(held["image_ref"].astype(str)), held["pos"].to_numpy()] = True
        has = model_ref >= 0
        rank[has] = np.where(by_ref[model_ref[has]], STATE_RANK["image"], 0)
    if len(fleet.cache):
        cache = fleet.cache[fleet.cache["state"].isin(START_STATES)]
        m = models.get_indexer(cache["model_id"].astype(str))
        n = nodes.get_indexer(cache["node_id"].astype(str))
        ok = (m >= 0) & (n >= 0)
        np.maximum.at(rank, (m[ok], n[ok]), cache["state"].map(STATE_RANK).to_numpy(dtype=np.int8)[ok])
    return rank


def node_states(fleet) -> pd.DataFrame:
    """Per (model, node) the warmest state the node holds for the model (``none`` where nothing): long frame.

    Columns ``model_id, node_id, state``; every model of ``fleet`` on every node (see :func:`node_state_ranks`
    for the array the planner reads).
    """
    models = fleet.models.index.astype(str)
    nodes = fleet.nodes.index.astype(str)
    rank = node_state_ranks(fleet)
    return pd.DataFrame({"model_id": np.repeat(models.to_numpy(dtype=object), len(nodes)),
                         "node_id": np.tile(nodes.to_numpy(dtype=object), len(models)),
                         "state": np.asarray(START_STATES, dtype=object)[rank.ravel()]})


def masked_median(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(M,) median of each row of ``values`` (M, K) over the columns where ``mask`` is True and the value not NaN.

    NaN where no column counts; an even count averages the two middle values (as pandas' median does). One sort
    per row with the left-out columns at +inf: no per-row Python.
    """
    values = np.asarray(values, dtype="float64")
    n_rows, n_cols = values.shape
    if n_cols == 0:
        return np.full(n_rows, np.nan)
    keep = np.asarray(mask, dtype=bool) & ~np.isnan(values)
    count = keep.sum(axis=1)
    ordered = np.sort(np.where(keep, values, np.inf), axis=1)  # kept values first, ascending
    rows = np.arange(n_rows)
    lo = ordered[rows, np.clip((count - 1) // 2, 0, n_cols - 1)]
    hi = ordered[rows, np.clip(count // 2, 0, n_cols - 1)]
    with np.errstate(invalid="ignore"):
        return np.where(count > 0, (lo + hi) / 2.0, np.nan)


def reduce_node_latency(table: NodeLatencyTable, fleet=None) -> dict[str, np.ndarray]:
    """Per column, (M, S) values per (model, state) of ``table``: the median over the nodes a start would use.

    A start from state ``s`` happens on a node whose warmest state for the
    model is ``s`` and that has room for a replica (``gpus_free`` at least the
    model's ``gpus``): the value is the median over those nodes. Where no node
    qualifies (or ``fleet`` is None) it is the median over the nodes with room,
    else over every node of the table (each column on its own, NaN skipped:
    the semantics the long frame's groupby medians and ``combine_first`` had).
    A node-independent column (``table.per_model``) is its own value wherever
    the chosen set has a node. Arrays of (models, nodes), no long frame.
    """
    n_models, n_nodes, n_states = table.total_s.shape
    everywhere = np.ones((n_models, n_nodes), dtype=bool)
    room = held = None
    if fleet is not None and len(fleet.nodes):
        gpus = fleet.models["gpus"].astype("float64")
        gpus.index = gpus.index.astype(str)
        free = fleet.nodes["gpus_free"].astype("float64")
        free.index = free.index.astype(str)
        room = free.reindex(table.node_ids.astype(str)).to_numpy()[None, :] \
            >= gpus.reindex(table.model_ids.astype(str)).to_numpy()[:, None]
        held = node_state_ranks(fleet, table.model_ids, table.node_ids)
    out = {c: np.full((n_models, n_states), np.nan) for c in (*table.per_node, *table.per_model)}
    for s in range(n_states):
        choices = [everywhere] if room is None else [room & (held == s), room, everywhere]
        for column, values in table.per_node.items():
            v = values[:, :, s]
            for mask in choices:  # per (model, state), the first set that gives a value
                rows = np.flatnonzero(np.isnan(out[column][:, s]))
                if not len(rows):
                    break
                out[column][rows, s] = masked_median(v[rows], mask[rows])
        for column, values in table.per_model.items():
            v = values[:, s].astype("float64")
            for mask in choices:
                fill = np.isnan(out[column][:, s]) & mask.any(axis=1)
                out[column][fill, s] = v[fill]
    return out


def node_latency(latency, fleet=None) -> pd.DataFrame:
    """One row per (model, state) from a per-node latency table: the nodes a start from that state would use.

    ``latency``: a long frame (``model_id, node_id, state, total_s`` [, phases]) or a
    :class:`~forecaster.contracts.latency.NodeLatencyTable`; see :func:`reduce_node_latency` for the rule.
    Returns ``model_id, state`` and the value columns, model-major (a (model, state) with no value anywhere is
    left out, as the groupby left it out).
    """
    table = latency if isinstance(latency, NodeLatencyTable) else NodeLatencyTable.from_frame(latency)
    reduced = reduce_node_latency(table, fleet)
    n_models, n_states = len(table.model_ids), len(START_STATES)
    out = pd.DataFrame({"model_id": np.repeat(table.model_ids.astype(str).to_numpy(dtype=object), n_states),
                        "state": np.tile(np.asarray(START_STATES, dtype=object), n_models)})
    for column, values in reduced.items():
        out[column] = values.reshape(-1)
    present = ~np.all(np.isnan(np.stack([v.reshape(-1) for v in reduced.values()])), axis=0)
    return out[present].reset_index(drop=True)
