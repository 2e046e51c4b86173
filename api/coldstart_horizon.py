"""The cold-start horizon of a model: the latency model's predicted start per cache tier, the lead time prewarm
acts on, and the observed rolling p90, for ``GET /v1/models/{id}/cold-start`` and the ``/metrics`` gauges.

Predicted seconds are the planner's numbers (the same path as :class:`api.snapshot.ForecastSnapshot`'s lead times):
the latency champion's per-node prediction for the plan job's fleet
(:meth:`forecaster.coldstart.model.ColdStartModel.latency_table`), reduced per start tier the way the planner
reduces it (:func:`forecaster.planning.lead_time.start_seconds_by_state`), for the UTC hour of ``now``. The
latency model is called directly for the models asked about (not through the service's per-fleet table cache, which
the plan job and the snapshot share and a per-model answer would evict), unless the API's snapshot holds the
whole catalogue's table for this hour, champion and fleet: their rows are then read from it. The lead time is the
predicted start from the tier a new replica would start from (its warmest cached tier on any node, or on the node
asked about) plus the planner's margins (``PREWARM_PLANNER_LEAD_MARGIN_S`` / ``_FRAC``). A model without
registered sizes is answered from its own observed starts, else ``PREWARM_DEFAULT_COLD_START_S``, as the plan job's
table answers it; ``PredictedHorizon.source`` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pandas as pd
from sqlalchemy import Engine, text

from api.snapshot import HeldLatencyTable, planner_settings_for
from forecaster.coldstart.service import latency_model_at, latency_version
from forecaster.contracts.latency import NodeLatencyTable
from forecaster.contracts.phases import START_STATES
from forecaster.planning.lead_time import start_seconds_by_state
from forecaster.settings import Settings
from forecaster.store.coldstarts import RECENT_COLD_STARTS, recent_cold_start_percentiles
from forecaster.store.nodecache import warmest_cached_states

#: The observed figure's level: the rolling p90 of each model's newest stored cold starts.
OBSERVED_QUANTILE = 0.9


@dataclass(frozen=True)
class PredictedHorizon:
    """Per model (rows of ``predicted_s``): predicted start seconds per tier, the start tier, the lead time.

    Attributes:
        predicted_s: index model id, columns :data:`START_STATES` (seconds; 0 where nothing is known).
        start_state: model id -> the tier a new replica would start from now.
        lead_time_s: model id -> the planner's lead: ``predicted_s[start_state]`` plus its margins.
        latency_model_version: the latency champion (None: the physics prior, nothing trained yet).
        hour_utc: the hour the prediction is for.
        node_id: the node asked about, or None (the fleet's nodes, reduced as the planner does).
        source: model id -> where its figures come from: ``latency_model``; ``observed`` (no registered sizes:
            its own starts, see :meth:`~forecaster.coldstart.model.ColdStartModel.sizeless_fallback`); or
            ``default`` (no sizes and no start of its own: ``PREWARM_DEFAULT_COLD_START_S``).
    """

    predicted_s: pd.DataFrame
    start_state: pd.Series
    lead_time_s: pd.Series
    latency_model_version: str | None
    hour_utc: int
    node_id: str | None = None
    source: pd.Series | None = None


def _sizes(conn, model_ids: list[str]) -> pd.DataFrame:
    """``image_bytes, weights_bytes`` of ``model_ids`` (0 when unregistered sizes), index ``model_id``."""
    rows = conn.execute(text("SELECT id, coalesce(image_size_bytes, 0), coalesce(weights_size_bytes, 0) "
                             "FROM serving_models WHERE id = ANY(:ids)"), {"ids": list(model_ids)}).all()
    found = pd.DataFrame([tuple(r) for r in rows], columns=["model_id", "image_bytes", "weights_bytes"])
    sizes = found.set_index("model_id").reindex(pd.Index(model_ids, name="model_id")).fillna(0.0)
    return sizes.astype("float64")


def predict_horizon(engine: Engine, settings: Settings, now: datetime, model_ids: list[str], *,
                    node: str | None = None, held: HeldLatencyTable | None = None) -> PredictedHorizon | None:
    """The predicted horizon of registered ``model_ids`` at ``now``; None when ``node`` is not in the fleet.

    Args:
        node: None for the fleet (a start on the nodes the planner would use, per tier); a node id for a start on
            that node, from its own history (falling back to the model's and tier's where it has none).
        held: the API snapshot's per-node table of the whole catalogue (:class:`api.snapshot.HeldLatencyTable`):
            where it is for this hour, the champion and the fleet's nodes and holds the models at their current
            sizes, their rows are read from it (a cell does not depend on the other models of a table); else the
            latency model is asked for these models alone. At 1,000 models on 160 nodes asking took 0.6-1.1 s.
    """
    from forecaster.jobs.planning import fleet_from_store  # the plan job's fleet, as the snapshot uses it
    from forecaster.planning.fleet import node_state_ranks

    ids = [str(m) for m in model_ids]
    # the asked models' rows and artefacts, every node: each model as in the whole fleet's state, at the cost of
    # its own rows (the whole fleet took 3 s per call at 100,000 models on 160 nodes, bench/coldstart_reads.py)
    fleet = fleet_from_store(engine, now=now, default_cold_cost=settings.planner_cold_cost, model_ids=ids)
    fleet_nodes = [str(n) for n in fleet.nodes.index]
    if node is not None and node not in set(fleet_nodes):
        return None
    with engine.connect() as conn:
        sizes = _sizes(conn, ids)
        if node is None:
            warmest = warmest_cached_states(conn, ids)
            states = pd.Series({m: warmest.get(m, "none") for m in ids}, dtype=object)
    if node is not None:
        ranks = node_state_ranks(fleet, pd.Index(ids), pd.Index([node]))[:, 0]
        states = pd.Series(np.asarray(START_STATES, dtype=object)[ranks], index=pd.Index(ids), dtype=object)
    hour = now.astimezone(timezone.utc).hour
    nodes = [node] if node is not None else (fleet_nodes or None)
    version = latency_version(engine, settings)
    _, model = latency_model_at(engine, settings, now=now, hour=hour)  # what the plan job's table predicts with
    default_s = float(settings.default_cold_start_s)
    source = model.sizeless_fallback(sizes, default_s)[2].reindex(ids).fillna("latency_model")
    table = None if held is None or not fleet_nodes else _rows_of(held, sizes, hour, version, fleet_nodes, node)
    if table is None:
        table = model.latency_table(sizes, hour=hour, default_s=default_s) if nodes is None else \
            model.node_latency_table(sizes, hour=hour, nodes=nodes, default_s=default_s)
    # on the one node asked about there is nothing to reduce over; over the fleet, the planner's reduction
    predicted = start_seconds_by_state(table, ids, fleet if node is None and nodes else None)
    states = states.reindex(ids).fillna("none")
    start = predicted.to_numpy()[np.arange(len(ids)), [START_STATES.index(s) for s in states]]
    lead = pd.Series(np.asarray(planner_settings_for(settings).lead(start), dtype="float64"), index=predicted.index)
    return PredictedHorizon(predicted_s=predicted, start_state=states, lead_time_s=lead,
                            latency_model_version=version, hour_utc=hour, node_id=node, source=source)


def lead_source(engine: Engine, settings: Settings, now: datetime, model_id: str) -> str:
    """Where the planner's figures for ``model_id`` come from (``PredictedHorizon.source``) without predicting:
    ``latency_model``, ``observed`` or ``default`` (its sizes and, for a model without them, its own starts)."""
    with engine.connect() as conn:
        sizes = _sizes(conn, [model_id])
    _, model = latency_model_at(engine, settings, now=now)
    return str(model.sizeless_fallback(sizes, float(settings.default_cold_start_s))[2].iloc[0])


def _rows_of(held: HeldLatencyTable, sizes: pd.DataFrame, hour: int, version: str | None,
             fleet_nodes: list[str], node: str | None) -> NodeLatencyTable | None:
    """The rows of ``sizes``' models (and the column of ``node``, or every node) of the held table, or None where
    it does not answer for them as they are now: another hour or champion, other nodes, a model missing or of
    other sizes (registered or resized since the snapshot read the catalogue)."""
    table = held.table
    if held.hour_utc != hour or held.latency_model_version != version or sizes.index.has_duplicates \
            or tuple(table.node_ids) != tuple(fleet_nodes):
        return None
    rows = table.model_ids.get_indexer(sizes.index)
    if (rows < 0).any():
        return None
    was = held.sizes.reindex(sizes.index)[["image_bytes", "weights_bytes"]].to_numpy(dtype="float64")
    if not np.array_equal(was, sizes[["image_bytes", "weights_bytes"]].to_numpy(dtype="float64")):
        return None
    cols = np.arange(len(table.node_ids)) if node is None else np.array([table.node_ids.get_loc(node)])
    return NodeLatencyTable(model_ids=pd.Index(sizes.index, name=None), node_ids=table.node_ids[cols],
                            per_node={k: v[rows][:, cols] for k, v in table.per_node.items()},
                            per_model={k: v[rows] for k, v in table.per_model.items()})


def observed_p90(engine: Engine, model_ids: list[str], *, by_cache_state: bool = False) -> pd.DataFrame:
    """The rolling p90 (seconds) of each model's newest :data:`RECENT_COLD_STARTS` stored cold starts."""
    with engine.connect() as conn:
        return recent_cold_start_percentiles(conn, model_ids=model_ids, quantile=OBSERVED_QUANTILE,
                                             last_n=RECENT_COLD_STARTS, by_cache_state=by_cache_state)
