"""What the planner reads besides forecasts: the fleet as it stands, predicted latencies, costs.

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
  :data:`forecaster.ingest.coldstarts.PHASES`: the predicted cold start of a
  new replica started from each cache ``state`` in :data:`START_STATES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np
import pandas as pd

from forecaster.ingest.coldstarts import PHASES

#: Cache states a replica can start from, coldest first.
START_STATES = ("none", "image", "disk", "host")
STATE_RANK = {s: i for i, s in enumerate(START_STATES)}

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


def latency_table(latency: pd.DataFrame, model_ids: pd.Index) -> dict[str, np.ndarray]:
    """Per start state, (N,) predicted totals and phases aligned to ``model_ids`` (NaN where missing)."""
    missing = [c for c in ("model_id", "state", "total_s") if c not in latency.columns]
    if missing:
        raise ValueError(f"latency lacks columns {missing}")
    out: dict[str, np.ndarray] = {}
    for state in START_STATES:
        rows = latency[latency["state"] == state].drop_duplicates("model_id").set_index("model_id")
        aligned = rows.reindex(model_ids)
        out[state] = aligned["total_s"].to_numpy(dtype="float64")
        for phase in PHASES:
            if phase in aligned.columns:
                out[f"{state}:{phase}"] = aligned[phase].to_numpy(dtype="float64")
    # a state missing from the table costs what the next colder state costs
    for colder, warmer in zip(START_STATES, START_STATES[1:]):
        out[warmer] = np.where(np.isnan(out[warmer]), out[colder], out[warmer])
    return out
