"""A catalogue of real open models and serving images, and the mapping of trace series onto it.

``catalog.csv`` (next to this file) lists ten open-weight models, each with
the serving image it would run in, both sizes in bytes, GPUs per replica, and
the sustained requests per second of one replica (``replica_rps``) and typical
request duration (``request_s``). Every size names its source in the
``weights_source`` / ``image_source`` columns:

* weights: the ``metadata.total_size`` of the model's
  ``model.safetensors.index.json`` on the Hugging Face Hub (bytes of all
  shards), or, where marked ``derived``, parameters x bytes per parameter;
* images: sizes reported in the serving projects' own issue trackers (vLLM
  #7609 and #27154, Triton #7335, SGLang #3673, text-embeddings-inference #252).

``replica_rps`` and ``request_s`` are planning assumptions for a single
A100/H100-class GPU replica, not measurements: the simulator uses them for
capacity (a replica serves up to ``replica_rps`` requests per second) and the
reactive autoscaler for its concurrency target.

Trace series carry no model names, so :func:`assign_models` maps them onto the
catalogue. For the Azure Functions day the function's memory
(``AverageAllocatedMb``) orders the functions and the catalogue's model sizes
are handed out in that order with fixed shares (:data:`AZURE_SHARES`): the
functions that use the most memory get the biggest models.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pandas as pd

CATALOG_PATH = Path(__file__).with_name("catalog.csv")

#: Share of the Azure functions mapped to each catalogue entry, smallest memory first.
AZURE_SHARES = {
    "bge-large-en-v1.5": 0.20,
    "qwen2.5-0.5b-instruct": 0.15,
    "qwen2.5-1.5b-instruct": 0.15,
    "qwen2.5-3b-instruct": 0.12,
    "llama-2-7b-chat": 0.075,
    "mistral-7b-instruct-v0.2": 0.075,
    "llama-3-8b-instruct": 0.075,
    "qwen2.5-7b-instruct": 0.075,
    "mixtral-8x7b-instruct": 0.04,
    "llama-3-70b-instruct": 0.04,
}


def load_catalog(path: str | Path = CATALOG_PATH) -> pd.DataFrame:
    """The catalogue, indexed by ``name``; checks that sizes and capacities are positive."""
    frame = pd.read_csv(path).set_index("name")
    for column in ("image_bytes", "weights_bytes", "gpus", "replica_rps", "request_s"):
        if (frame[column] <= 0).any():
            raise ValueError(f"{path}: {column} must be > 0 for every model")
    return frame


@functools.lru_cache(maxsize=1)
def catalog_names() -> tuple[str, ...]:
    """The entries of the shipped catalogue (``catalog.csv``), sorted."""
    return tuple(sorted(load_catalog().index.astype(str)))


def catalog_label_problem(labels: dict) -> str | None:
    """Why the label ``catalog`` of ``labels`` names no entry of the shipped catalogue (which ``prewarm report``
    reads a model's request duration from, when it has no label ``request_s``), or None (also when absent)."""
    value = labels.get("catalog") if isinstance(labels, dict) else None
    if value is None or value in catalog_names():
        return None
    return f"label 'catalog' must name an entry of the simulator's catalogue: {', '.join(catalog_names())}"


def assign_models(ids: np.ndarray, *, catalog: pd.DataFrame | None = None, order_by: np.ndarray | None = None,
                  entry: str | None = None, shares: dict[str, float] | None = None) -> pd.DataFrame:
    """Map trace series to catalogue entries: the simulator's per-model table.

    Args:
        ids: (N,) series ids.
        catalog: the catalogue (default: :func:`load_catalog`).
        order_by: (N,) a size proxy (e.g. memory MB); bigger values get bigger models.
        entry: map every series to this one entry (single-service traces).
        shares: entry -> share of the series, in the order to hand them out
            (default :data:`AZURE_SHARES`).

    Returns:
        One row per series (index ``model_id``) with the catalogue columns plus ``catalog_name``.
    """
    catalog = load_catalog() if catalog is None else catalog
    ids = np.asarray(ids).astype(str)
    if entry is not None:
        names = np.full(len(ids), entry, dtype=object)
    else:
        shares = shares or AZURE_SHARES
        order = np.argsort(order_by if order_by is not None else np.arange(len(ids)), kind="stable")
        bounds = np.cumsum([0.0, *shares.values()])
        bounds = np.round(bounds / bounds[-1] * len(ids)).astype(int)
        names = np.empty(len(ids), dtype=object)
        for (lo, hi), name in zip(zip(bounds[:-1], bounds[1:]), shares):
            names[order[lo:hi]] = name
    table = catalog.loc[names].reset_index().rename(columns={"name": "catalog_name"})
    table.insert(0, "model_id", ids)
    # one weights object per series (each deployment has its own copy to fetch), one image per entry
    table["weights_uri"] = table["weights_uri"] + "#" + table["model_id"]
    return table.set_index("model_id")
