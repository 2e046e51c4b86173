"""The fleet as the store knows it: catalogue, replicas last set, nodes and what they hold (planner input rows).

Returns plain frames for :func:`forecaster.contracts.fleet.build_fleet`, the one builder the simulator feeds
too. Replicas are what the actuator last set for a model (its newest succeeded scale or release); pre-pulls and
pre-loads the actuator reports done within the last day count as held, since with the dry-run backend (or
before an agent's next state report) nothing else says so and the planner would ask for them again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta

import numpy as np
import pandas as pd
from sqlalchemy import Connection, text

from forecaster.store.actions import NEWEST_FIRST, REPLICAS_AFTER, REPLICAS_SET

log = logging.getLogger(__name__)


def _label_numbers(ids: pd.Index, values: pd.Series, label: str) -> list[float]:
    """A numeric label per model: a JSON number, or text holding one (``PUT /v1/models`` stores labels as text);
    NaN (the setting's default) where absent. Text that is no number is logged, once per read, and left out."""
    out, unreadable = [], []
    for model_id, value in zip(ids, values):
        number = np.nan
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                unreadable.append(model_id)
        out.append(number)
    if unreadable:
        log.warning("label %s of %d models is not a number (e.g. model %r): the default applies", label,
                    len(unreadable), unreadable[0])
    return out


def read_fleet_inputs(conn: Connection, *, now: datetime, model_ids: Sequence[str] | None = None
                      ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(models, nodes, artefacts) frames as :func:`~forecaster.contracts.fleet.build_fleet` takes them.

    ``model_ids`` reads only those models, and only the artefacts their images and weights are (every node, as
    before): what :func:`~forecaster.contracts.fleet.build_fleet` makes of a model depends on that model's row,
    the nodes and the artefacts with its references alone, so each model comes out as in the whole fleet's state.
    A per-model answer (``GET /v1/models/{id}/cold-start``) then reads one catalogue row, not the fleet.

    ``models`` carries the raw catalogue values (the builder fills defaults and refuses unusable ones);
    ``cold_cost`` comes from the model's label of that name when it holds a number (JSON, or text as ``PUT
    /v1/models`` stores labels); ``burst_factor`` from the
    catalogue (declared, or measured from an ingested per-request trace; missing: the builder's 1, even arrivals).

    The action history is read through two partial indexes (migration 0015): each model's newest succeeded scale
    or release, and the last day's succeeded pre-pulls and pre-loads, so the read does not grow with the history.
    """
    rows = conn.execute(text(
        "SELECT m.id, m.image_ref, m.image_size_bytes, m.weights_uri, m.weights_size_bytes, m.gpus_per_replica, "
        "m.replica_rps, m.cold_start_slo_s, m.labels->'cold_cost', m.burst_factor, "
        f"(SELECT a.replicas FROM (SELECT {REPLICAS_AFTER} AS replicas, updated_at FROM actions "
        f"   WHERE model_id = m.id AND {REPLICAS_SET} ORDER BY {NEWEST_FIRST} LIMIT 1) a) AS replicas "
        "FROM serving_models m" + (" WHERE m.id = ANY(:ids)" if model_ids is not None else "") + " ORDER BY m.id"),
        {"ids": list(model_ids or ())}).all()
    # plain tuples: pandas probes each SQLAlchemy Row for attributes (1.2 s at 100,000 models, 0.05 s as tuples)
    models = pd.DataFrame([tuple(row) for row in rows], columns=["model_id", "image_ref", "image_bytes", "weights_uri", "weights_bytes",
                                         "gpus", "replica_rps", "slo_s", "cold_cost", "burst_factor", "replicas"]).set_index("model_id")
    rps = pd.to_numeric(models.pop("replica_rps"), errors="coerce")
    models["replica_rpm"] = rps * 60.0
    models["cold_cost"] = _label_numbers(models.index, models["cold_cost"], "cold_cost")
    nodes = pd.DataFrame([tuple(row) for row in conn.execute(text(
        "SELECT id, gpus_free, host_memory_free_bytes, disk_free_bytes FROM nodes ORDER BY id"))],
        columns=["node_id", "gpus_free", "host_free_bytes", "disk_free_bytes"]).set_index("node_id")
    of_refs, refs = "", []
    if model_ids is not None:  # only the artefacts of the models read: an image counts for every model using it
        of_refs = " AND {} = ANY(:refs)"
        refs = sorted({r for r in (*models["image_ref"], *models["weights_uri"]) if isinstance(r, str)})
    held = conn.execute(text("SELECT node_id, artefact_kind, ref, tier FROM node_cache WHERE true"
                             + of_refs.format("ref")), {"refs": refs}).all()
    held += conn.execute(text(
        "SELECT DISTINCT node_id, CASE kind WHEN 'prepull' THEN 'image' ELSE 'weights' END, target, "
        "CASE kind WHEN 'prepull' THEN 'image' ELSE spec->>'tier' END FROM actions "
        "WHERE kind IN ('prepull', 'preload') AND status = 'succeeded' AND node_id IS NOT NULL "
        "AND updated_at >= :since" + of_refs.format("target")), {"since": now - timedelta(days=1), "refs": refs}).all()
    artefacts = pd.DataFrame([tuple(row) for row in held], columns=["node_id", "kind", "ref", "tier"])
    return models, nodes, artefacts
