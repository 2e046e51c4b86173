"""The lead time of a model: how long before a replica is needed the planner starts it, from the latency model.

One function for every reader: the API's recommendation endpoint and the
dashboard serve exactly what the planner uses for its scale actions, the
latency model's predicted total for the state a new replica would start from,
plus the planner's safety margins (:meth:`PlannerSettings.lead`). The latency
table is aligned the way the planner aligns it
(:func:`forecaster.planning.fleet.latency_table`: a state missing from the
table costs what the next colder state costs).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from forecaster.contracts.fleet import FleetState
from forecaster.contracts.latency import NodeLatencyTable
from forecaster.contracts.phases import START_STATES, STATE_RANK
from forecaster.planning.fleet import PlannerSettings, latency_table


def start_seconds_by_state(latency: pd.DataFrame, model_ids, fleet: FleetState | None = None) -> pd.DataFrame:
    """Predicted cold-start seconds per model (rows) and start state (columns :data:`START_STATES`), as the planner
    reads them: per-node rows reduced over ``fleet`` (see :func:`start_seconds`), a state missing from the table
    costing what the next colder one costs, and 0 where nothing is known."""
    ids = pd.Index([str(m) for m in model_ids])
    by_state = latency_table(latency, ids, fleet)
    d = np.stack([np.nan_to_num(by_state[s], nan=0.0) for s in START_STATES], axis=1)
    return pd.DataFrame(d, index=ids, columns=list(START_STATES))


def start_seconds(latency: pd.DataFrame, states: Mapping[str, str] | pd.Series, model_ids,
                  fleet: FleetState | None = None) -> pd.Series:
    """Predicted cold-start seconds per model when a new replica starts from its state in ``states``.

    Args:
        latency: the planner's latency input (``model_id, state, total_s`` ..., optionally per ``node_id``, or a
            :class:`~forecaster.contracts.latency.NodeLatencyTable`).
        fleet: with a per-node ``latency``, the fleet whose nodes the planner would start on (see
            :func:`forecaster.planning.fleet.node_latency`); None: the median over the frame's nodes.
        states: model id -> start state (one of :data:`START_STATES`); a model left out starts from ``none``.
        model_ids: the models to answer for (the index of the result).
    """
    ids = pd.Index([str(m) for m in model_ids])
    states = pd.Series(states, dtype=object).reindex(ids).fillna("none")
    unknown = sorted(set(states) - set(START_STATES))
    if unknown:
        raise ValueError(f"unknown start states {unknown}; expected some of {list(START_STATES)}")
    d = start_seconds_by_state(latency, ids, fleet).to_numpy()
    rank = states.map(STATE_RANK).to_numpy(dtype=np.int64)
    return pd.Series(d[np.arange(len(ids)), rank], index=ids, name="start_s")


def lead_time_s(latency: pd.DataFrame, states: Mapping[str, str] | pd.Series, settings: PlannerSettings,
                model_ids=None, fleet: FleetState | None = None) -> pd.Series:
    """Lead time in seconds per model: ``settings.lead`` of the predicted start from its state.

    Args:
        latency: the latency model's table (see :func:`forecaster.coldstart.service.latency_table`).
        states: model id -> the state a new replica would start from (its warmest cached state on any node);
            models left out start from ``none``.
        settings: the planner's settings (``lead_margin_s``, ``lead_margin_frac``).
        model_ids: models to answer for; default every model in ``latency``.
        fleet: see :func:`start_seconds` (the planner passes its fleet; so does the API's snapshot).
    """
    if model_ids is None:
        model_ids = latency.model_ids if isinstance(latency, NodeLatencyTable) \
            else pd.unique(latency["model_id"].astype(str))
    d = start_seconds(latency, states, model_ids, fleet)
    return pd.Series(np.asarray(settings.lead(d.to_numpy()), dtype="float64"), index=d.index, name="lead_time_s")


def warmest_states(fleet: FleetState) -> pd.Series:
    """Per model of ``fleet``, its warmest cached state on any node (``none`` when nothing is cached).

    Unlike the planner's own choice this ignores whether the node has a free
    GPU now: it says what the caches hold, as the API reads them from ``node_cache``.
    """
    ids = fleet.models.index.astype(str)
    rank = pd.Series(0, index=ids, dtype=np.int64)
    if len(fleet.images):
        refs = fleet.models["image_ref"].astype(str)
        held = set(fleet.images["image_ref"].astype(str))
        rank[refs.isin(held).to_numpy()] = STATE_RANK["image"]
    if len(fleet.cache):
        cache = fleet.cache[fleet.cache["state"].isin(START_STATES)]
        best = cache.assign(rank=cache["state"].map(STATE_RANK)).groupby(cache["model_id"].astype(str))["rank"].max()
        best = best.reindex(ids).fillna(0).astype(np.int64)
        rank = np.maximum(rank, best)
    return pd.Series(np.asarray(START_STATES, dtype=object)[rank.to_numpy()], index=ids, name="state")
