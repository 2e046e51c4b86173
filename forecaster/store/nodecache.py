"""What the nodes hold warm, per model: the warmest state a new replica could start from."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, text

from forecaster.contracts.phases import START_STATES

# image on a node -> "image"; weights on local disk -> "disk"; in host memory -> "host" (as the plan job's fleet
# reads node_cache: GPU-tier entries are not a start state of START_STATES)
_WARMEST = (
    "SELECT model_id, max(rank) FROM ("
    "  SELECT m.id AS model_id, 1 AS rank FROM serving_models m "
    "  JOIN node_cache c ON c.artefact_kind = 'image' AND c.ref = m.image_ref {models}"
    "  UNION ALL "
    "  SELECT m.id, CASE c.tier WHEN 'host' THEN 3 ELSE 2 END FROM serving_models m "
    "  JOIN node_cache c ON c.artefact_kind = 'weights' AND c.ref = m.weights_uri AND c.tier IN ('disk', 'host') "
    "  {models}"
    ") AS warm GROUP BY model_id")
_WARMEST_ALL = text(_WARMEST.format(models=""))
_WARMEST_OF = text(_WARMEST.format(models="WHERE m.id = ANY(:ids)"))


def warmest_cached_states(conn: Connection, model_ids: Sequence[str] | None = None) -> dict[str, str]:
    """Per model with anything cached, its warmest start state on any node (``image``, ``disk``, ``host``).

    Models absent from the answer have nothing cached anywhere (state ``none``). ``model_ids``: only those models.
    """
    rows = conn.execute(_WARMEST_ALL) if model_ids is None else conn.execute(_WARMEST_OF, {"ids": list(model_ids)})
    return {model_id: START_STATES[int(rank)] for model_id, rank in rows}
