"""The fleet as it stands, as the planner reads it: models, nodes, caches, transfers (and the latency frame's columns).

All inputs are plain frames so that 1,350 models plan in milliseconds:

* ``FleetState.models``: one row per serving model (index ``model_id``):
  ``image_ref``, ``image_bytes``, ``weights_uri``, ``weights_bytes``,
  ``gpus`` (GPUs per replica; may be fractional, e.g. GB of memory in the
  minute-level protocol), ``replica_rpm`` (requests per minute one replica
  sustains), optional ``burst_factor`` (peak sub-minute request rate over the
  minute's mean, as the serving layer measures it; 1 when absent: a minute
  forecast alone would size replicas for the mean rate), ``cold_cost`` (value of one second of cold-start wait, in
  GPU-seconds: the per-model SLO weight), ``slo_s`` (cold-start SLO, seconds,
  NaN = none), ``replicas`` (ready + starting now).
* ``FleetState.nodes``: one row per node (index ``node_id``): ``gpus_free``,
  ``host_free_bytes``, ``disk_free_bytes``.
* ``FleetState.cache``: ``node_id, model_id, state`` where ``state`` is where
  the node holds the model's weights: ``disk`` (local disk) or ``host`` (host
  memory); a row with ``image`` says the node holds the model's image.
* ``FleetState.images``: ``node_id, image_ref``: images pulled on each node
  (one image serves many models, so it is listed once per node).
* ``FleetState.transfers``: pulls and fetches already running: ``node_id,
  registry, model_id, kind (prepull|preload), ends_at``.
* latency: ``model_id, state, total_s`` plus the phase columns of
  :data:`forecaster.contracts.phases.PHASES`: the predicted cold start of a
  new replica started from each cache ``state`` in :data:`START_STATES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np
import pandas as pd

from forecaster.contracts.phases import PHASES, START_STATES, STATE_RANK  # noqa: F401 - re-exported vocabulary

MODEL_COLUMNS = ("image_ref", "image_bytes", "weights_uri", "weights_bytes", "gpus", "replica_rpm", "cold_cost",
                 "slo_s", "replicas")
NODE_COLUMNS = ("gpus_free", "host_free_bytes", "disk_free_bytes")
CACHE_COLUMNS = ("node_id", "model_id", "state")
IMAGE_COLUMNS = ("node_id", "image_ref")
TRANSFER_COLUMNS = ("node_id", "registry", "model_id", "kind", "ends_at")
LATENCY_COLUMNS = ("model_id", "state", "total_s", *PHASES)


def registry_of(ref: str | None) -> str:
    """The shared source a pull hits: an image's registry host, or a weights URI's bucket.

    ``vllm/vllm-openai:v0.6.3`` -> ``docker.io``; ``nvcr.io/nvidia/tritonserver:24.08-py3`` -> ``nvcr.io``;
    ``s3://models/llama`` -> ``s3://models``; ``hf://meta-llama/...`` -> ``hf://meta-llama``.
    """
    if not ref:
        return "-"
    if "://" in ref:
        parsed = urlparse(ref)
        return f"{parsed.scheme}://{parsed.netloc}"
    first = ref.split("/", 1)[0]
    return first if ("." in first or ":" in first or first == "localhost") and "/" in ref else "docker.io"


@dataclass(frozen=True)
class FleetState:
    """A snapshot of the fleet for one planning run (see the module docstring for the columns)."""

    models: pd.DataFrame
    nodes: pd.DataFrame
    cache: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(CACHE_COLUMNS)))
    transfers: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(TRANSFER_COLUMNS)))
    images: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(IMAGE_COLUMNS)))

    def __post_init__(self) -> None:
        missing = [c for c in MODEL_COLUMNS if c not in self.models.columns]
        if missing:
            raise ValueError(f"FleetState.models lacks columns {missing}")
        missing = [c for c in NODE_COLUMNS if c not in self.nodes.columns]
        if missing:
            raise ValueError(f"FleetState.nodes lacks columns {missing}")

    @classmethod
    def build(cls, models: list[dict], nodes: list[dict], cache: list[dict] | None = None,
              transfers: list[dict] | None = None, images: list[dict] | None = None) -> "FleetState":
        """From lists of dicts; model defaults: 1 GPU, 60 requests/min, cold_cost 1, no SLO, 0 replicas."""
        defaults = {"image_ref": None, "image_bytes": 0, "weights_uri": None, "weights_bytes": 0, "gpus": 1.0,
                    "replica_rpm": 60.0, "cold_cost": 1.0, "slo_s": np.nan, "replicas": 0}
        m = pd.DataFrame([{**defaults, **row} for row in models]).set_index("model_id")
        node_defaults = {"gpus_free": 8, "host_free_bytes": 10**12, "disk_free_bytes": 4 * 10**12}
        n = pd.DataFrame([{**node_defaults, **row} for row in nodes]).set_index("node_id")
        c = pd.DataFrame(cache or [], columns=list(CACHE_COLUMNS))
        t = pd.DataFrame(transfers or [], columns=list(TRANSFER_COLUMNS))
        i = pd.DataFrame(images or [], columns=list(IMAGE_COLUMNS))
        return cls(models=m, nodes=n, cache=c, transfers=t, images=i)
