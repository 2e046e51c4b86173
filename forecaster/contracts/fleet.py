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
    if not isinstance(ref, str) or not ref:  # None, NaN from a frame, or empty: no source to share
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
    #: models left out because a value was unusable: model id -> why (reported by the plan step)
    skipped: dict = field(default_factory=dict)

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


# --------------------------------------------------------------------------- the one builder

ARTEFACT_COLUMNS = ("node_id", "kind", "ref", "tier")
MODEL_DEFAULTS = {"image_ref": None, "image_bytes": 0.0, "weights_uri": None, "weights_bytes": 0.0, "gpus": 1.0,
                  "replica_rpm": 60.0, "cold_cost": 1.0, "slo_s": np.nan, "replicas": 0}
#: bounds beyond which a catalogue value is a mistake, not a model (the model is skipped and reported)
MAX_ARTEFACT_BYTES = 2.0**50  # what the catalogue accepts (forecaster.store.fields.MAX_SIZE_BYTES): a model it
# stores is never skipped for its sizes
MAX_GPUS_PER_REPLICA = 1e6
MAX_COLD_COST = 1e9  # as PREWARM_PLANNER_COLD_COST: beyond it the planner's wait arithmetic overflows


def _text(values: pd.Series) -> np.ndarray:
    """Strings, with None for missing (NaN, None, empty)."""
    out = values.astype(object).to_numpy()
    return np.array([v if isinstance(v, str) and v else None for v in out], dtype=object)


def _floats(values: np.ndarray) -> np.ndarray:
    """``pd.to_numeric(values, errors="coerce")`` as a float64 copy; numbers skip pandas (no parsing to do)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "fiub":
        return values.astype("float64", copy=True)
    return pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(dtype="float64", copy=True)


def build_fleet(models: pd.DataFrame, nodes: pd.DataFrame, artefacts: pd.DataFrame | None = None,
                transfers: pd.DataFrame | None = None) -> FleetState:
    """The fleet state every driver plans with: the plan job (fed by the store) and the simulator alike.

    Args:
        models: one row per serving model, index ``model_id``; any of :data:`MODEL_COLUMNS` (missing columns and
            missing values take :data:`MODEL_DEFAULTS`) plus optional ``burst_factor``. A model whose sizes, GPUs,
            rate or replicas are negative, infinite or absurd is left out and named in ``skipped``.
        nodes: one row per node, index ``node_id``: ``gpus_free``, ``host_free_bytes``, ``disk_free_bytes``
            (missing values count as 0). An empty frame plans on no node.
        artefacts: what each node holds: ``node_id, kind, ref, tier`` with ``kind`` ``image`` (``ref`` an image
            reference) or ``weights`` (``ref`` a weights URI, ``tier`` ``disk``, ``host`` or ``gpu``). Weights
            count as a start state for every model with that weights URI, on nodes that also hold the model's
            image (a replica elsewhere still pulls it); ``gpu`` counts as ``host``.
        transfers: pulls and fetches running: ``node_id, registry, model_id, kind, ends_at``.
    """
    # numpy throughout: the plan job and every replayed minute build this, and per-column pandas calls cost ms each
    index = pd.Index(models.index.astype(str), name="model_id")
    columns = {c: models[c].to_numpy() for c in models.columns}
    for column, default in MODEL_DEFAULTS.items():
        if column not in columns:
            columns[column] = np.full(len(index), default, dtype=object if default is None else None)
    columns["image_ref"] = _text(pd.Series(columns["image_ref"]))
    columns["weights_uri"] = _text(pd.Series(columns["weights_uri"]))
    skipped: dict[str, str] = {}
    numeric = {}
    for column in ("image_bytes", "weights_bytes", "gpus", "replica_rpm", "cold_cost", "slo_s", "replicas"):
        numeric[column] = _floats(columns[column])
    for column, default in (("image_bytes", 0.0), ("weights_bytes", 0.0), ("gpus", 1.0), ("replica_rpm", 60.0),
                            ("cold_cost", 1.0), ("replicas", 0.0)):
        values = numeric[column]
        values[np.isnan(values)] = default
        bad = ~np.isfinite(values) | (values < 0)
        if column in ("image_bytes", "weights_bytes"):
            bad |= values > MAX_ARTEFACT_BYTES
        if column == "gpus":
            bad |= values > MAX_GPUS_PER_REPLICA
        if column == "cold_cost":
            bad |= values > MAX_COLD_COST
        if column == "replica_rpm":
            bad |= values <= 0
        for position in np.flatnonzero(bad):
            skipped.setdefault(index[position], f"{column} {columns[column][position]!r} is not usable")
        columns[column] = values
    columns["gpus"] = np.where(columns["gpus"] == 0, 1.0, columns["gpus"])
    columns["replicas"] = columns["replicas"].astype(np.int64)
    slo = numeric["slo_s"]
    columns["slo_s"] = np.where(np.isfinite(slo) & (slo > 0), slo, np.nan)
    if "burst_factor" in columns:
        burst = _floats(columns["burst_factor"])
        columns["burst_factor"] = np.where(np.isfinite(burst) & (burst >= 1.0), burst, 1.0)
    m = pd.DataFrame(columns, index=index)
    if skipped:
        m = m.drop(index=list(skipped))
    n = _node_frame(nodes)
    cache = pd.DataFrame(columns=list(CACHE_COLUMNS))
    images = pd.DataFrame(columns=list(IMAGE_COLUMNS))
    if artefacts is not None and len(artefacts):
        images, cache = _held(artefacts, m)
    t = (pd.DataFrame(columns=list(TRANSFER_COLUMNS)) if transfers is None or not len(transfers)
         else transfers[list(TRANSFER_COLUMNS)].reset_index(drop=True))
    return FleetState(models=m, nodes=n, cache=cache, transfers=t, images=images, skipped=skipped)


def _node_frame(nodes: pd.DataFrame) -> pd.DataFrame:
    """The nodes' :data:`NODE_COLUMNS` as numbers, missing values 0, index ``node_id`` as text.

    When every such column is already a plain numpy number column (the simulator's, the store's) the frame is built
    from them directly (NaN as 0): the same frame as a copy and ``to_numeric`` per column, at a fraction of the cost.
    """
    data: dict[str, object] = {}
    if not nodes.attrs and nodes.columns.is_unique:
        for column in NODE_COLUMNS:
            if column not in nodes.columns:
                data[column] = 0.0
                continue
            values = nodes[column].to_numpy()
            if not (isinstance(values, np.ndarray) and nodes[column].dtype == values.dtype
                    and values.dtype.kind in "fiub"):
                break
            data[column] = (np.where(np.isnan(values), 0.0, values).astype(values.dtype) if values.dtype.kind == "f"
                            else values.copy())
        else:
            return pd.DataFrame(data, index=nodes.index.astype(str).rename("node_id"))
    n = nodes.copy()
    n.index = n.index.astype(str)
    n.index.name = "node_id"
    for column in NODE_COLUMNS:
        n[column] = pd.to_numeric(n[column], errors="coerce").fillna(0.0) if column in n.columns else 0.0
    return n[list(NODE_COLUMNS)]


def _held(artefacts: pd.DataFrame, m: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(images, cache)`` frames from the artefacts rows (see :func:`build_fleet`), in plain Python and numpy.

    Images: one row per (node, image), first occurrence order. Cache: weights rows joined to every model with
    that weights URI whose image the node holds, ``gpu`` counted as ``host``, then one row per (node, model):
    the warmest tier (rows ordered by state rank, the last of equal pairs kept).
    """
    node = [str(v) for v in artefacts["node_id"].to_numpy()]
    kind = artefacts["kind"].to_numpy()
    ref = artefacts["ref"].to_numpy()
    tier = artefacts["tier"].to_numpy()
    pairs = dict.fromkeys((node[i], str(ref[i])) for i in range(len(node)) if kind[i] == "image")
    images = pd.DataFrame({"node_id": [p[0] for p in pairs], "image_ref": [p[1] for p in pairs]},
                          columns=list(IMAGE_COLUMNS))
    if not len(m):
        return images, pd.DataFrame(columns=list(CACHE_COLUMNS))
    by_uri: dict[object, list[tuple[str, object]]] = {}
    for model_id, uri, image in zip(m.index, m["weights_uri"].to_numpy(), m["image_ref"].to_numpy()):
        if uri is not None:
            by_uri.setdefault(uri, []).append((model_id, image))
    held = set(pairs)
    rows: list[tuple[str, str, str]] = []
    for i in range(len(node)):
        if kind[i] != "weights" or tier[i] not in ("disk", "host", "gpu"):
            continue
        for model_id, image in by_uri.get(ref[i], ()):
            if (node[i], image) in held:
                rows.append((node[i], model_id, "host" if tier[i] == "gpu" else tier[i]))
    if not rows:
        return images, pd.DataFrame(columns=list(CACHE_COLUMNS))
    rank = np.array([STATE_RANK[r[2]] for r in rows])
    ordered = [rows[k] for k in rank.argsort(kind="quicksort")]  # as pandas' sort_values orders them
    kept, seen = [], set()
    for row in reversed(ordered):
        if (row[0], row[1]) not in seen:
            seen.add((row[0], row[1]))
            kept.append(row)
    kept.reverse()
    return images, pd.DataFrame(kept, columns=list(CACHE_COLUMNS))
