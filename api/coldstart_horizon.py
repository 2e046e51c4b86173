"""The cold-start horizon of a model: the latency model's predicted start per cache tier, the lead time prewarm
acts on, and the observed rolling p90, for ``GET /v1/models/{id}/cold-start`` and the ``/metrics`` gauges.

Predicted seconds are the planner's numbers (the same path as :class:`api.snapshot.ForecastSnapshot`'s lead times):
the latency champion's per-node prediction for the plan job's fleet
(:meth:`forecaster.coldstart.model.ColdStartModel.latency_table`), reduced per start tier the way the planner
reduces it (:func:`forecaster.planning.lead_time.start_seconds_by_state`), for the UTC hour of ``now``. The
latency model is called directly for the models asked about (not through the service's per-fleet table cache, which
the plan job and the snapshot share and a per-model answer would evict). The lead time is the predicted start
from the tier a new replica would start from (its warmest cached tier on any node, or on the node asked about)
plus the planner's margins (``PREWARM_PLANNER_LEAD_MARGIN_S`` / ``_FRAC``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pandas as pd
from sqlalchemy import Engine, text

from api.snapshot import planner_settings_for
from forecaster.coldstart.service import latency_version, load_latency_model
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
    """

    predicted_s: pd.DataFrame
    start_state: pd.Series
    lead_time_s: pd.Series
    latency_model_version: str | None
    hour_utc: int
    node_id: str | None = None


def _sizes(conn, model_ids: list[str]) -> pd.DataFrame:
    """``image_bytes, weights_bytes`` of ``model_ids`` (0 when unregistered sizes), index ``model_id``."""
    rows = conn.execute(text("SELECT id, coalesce(image_size_bytes, 0), coalesce(weights_size_bytes, 0) "
                             "FROM serving_models WHERE id = ANY(:ids)"), {"ids": list(model_ids)}).all()
    found = pd.DataFrame([tuple(r) for r in rows], columns=["model_id", "image_bytes", "weights_bytes"])
    sizes = found.set_index("model_id").reindex(pd.Index(model_ids, name="model_id")).fillna(0.0)
    return sizes.astype("float64")


def predict_horizon(engine: Engine, settings: Settings, now: datetime, model_ids: list[str], *,
                    node: str | None = None) -> PredictedHorizon | None:
    """The predicted horizon of registered ``model_ids`` at ``now``; None when ``node`` is not in the fleet.

    Args:
        node: None for the fleet (a start on the nodes the planner would use, per tier); a node id for a start on
            that node, from its own history (falling back to the model's and tier's where it has none).
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
        held = node_state_ranks(fleet, pd.Index(ids), pd.Index([node]))[:, 0]
        states = pd.Series(np.asarray(START_STATES, dtype=object)[held], index=pd.Index(ids), dtype=object)
    hour = now.astimezone(timezone.utc).hour
    nodes = [node] if node is not None else (fleet_nodes or None)
    model = load_latency_model(engine, settings)
    table = model.latency_table(sizes, hour=hour) if nodes is None else \
        model.node_latency_table(sizes, hour=hour, nodes=nodes)
    # on the one node asked about there is nothing to reduce over; over the fleet, the planner's reduction
    predicted = start_seconds_by_state(table, ids, fleet if node is None and nodes else None)
    states = states.reindex(ids).fillna("none")
    start = predicted.to_numpy()[np.arange(len(ids)), [START_STATES.index(s) for s in states]]
    lead = pd.Series(np.asarray(planner_settings_for(settings).lead(start), dtype="float64"), index=predicted.index)
    return PredictedHorizon(predicted_s=predicted, start_state=states, lead_time_s=lead,
                            latency_model_version=latency_version(engine, settings), hour_utc=hour, node_id=node)


def observed_p90(engine: Engine, model_ids: list[str], *, by_cache_state: bool = False) -> pd.DataFrame:
    """The rolling p90 (seconds) of each model's newest :data:`RECENT_COLD_STARTS` stored cold starts."""
    with engine.connect() as conn:
        return recent_cold_start_percentiles(conn, model_ids=model_ids, quantile=OBSERVED_QUANTILE,
                                             last_n=RECENT_COLD_STARTS, by_cache_state=by_cache_state)
