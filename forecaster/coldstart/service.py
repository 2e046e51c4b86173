"""The one latency model: trained nightly (and at first start), saved in the model registry, loaded cheaply.

* :func:`train_latency_model` fits :class:`~forecaster.coldstart.model.ColdStartModel`
  on every stored cold start plus the transfers the node agents carried out
  (they teach it the image pull and weight fetch rates), saves it under
  ``models/<version>/`` (fixed file names, see ``ColdStartModel.save``) and
  makes it the ``latency`` champion in ``model_versions``.
* :func:`load_latency_model` is what the plan job and the API call, every
  minute or every refresh: one index probe for the champion's id, the model
  itself loaded once per version. With no version saved yet it answers with
  the physics prior (no data yet is a normal answer, not an error).
* :func:`latency_table` is the planner's latency input from that model,
  cached per (version, hour, catalogue sizes): the same numbers for the plan
  job and the API's lead time.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from sqlalchemy import Engine

from forecaster.coldstart.model import ColdStartModel, load_cold_starts
from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.contracts.latency import NodeLatencyTable
from forecaster.settings import Settings
from forecaster.store.registry import champion_version, insert_version, promote_version
from forecaster.store.transfers import read_transfers

log = logging.getLogger(__name__)

KIND = "latency"
_lock = threading.Lock()
_models: dict[str, tuple[str | None, ColdStartModel]] = {}  # database#models_dir -> (version, model)
_tables: dict[tuple, "pd.DataFrame | NodeLatencyTable"] = {}  # (database, version, hour, sizes, nodes) -> table
_TABLES_KEPT = 8
#: bytes of arrays the per-hour cache may hold (a 100,000 x 64 node table is about 110 MB); the oldest go first
_TABLE_BYTES_KEPT = 512 * 2**20


def _key(engine: Engine, settings: Settings) -> str:
    return f"{engine.url.render_as_string(hide_password=True)}#{Path(settings.models_dir).resolve()}"


def _code_version() -> str:
    from forecaster import __version__

    return __version__


def train_latency_model(engine: Engine, settings: Settings, now: datetime, *,
                        config: FleetConfig = FleetConfig(), tree_params: dict | None = None) -> str:
    """Fit the latency model on ``cold_starts`` + ``transfers``, save it, make it the latency champion.

    Args:
        now: data time of the version (its id starts with it).
        config: the fleet physics of the prior.
        tree_params: LightGBM settings of the phase trees (tests pass small ones).

    Returns:
        The new version id (``latency-<YYYYmmddTHHMM>-<6 hex>``).
    """
    started = time.perf_counter()
    events = load_cold_starts(engine)
    transfers = read_transfers(engine)
    model = ColdStartModel(config=config, tree_params=tree_params).fit(events, transfers)
    version_id = f"{KIND}-{now.astimezone(timezone.utc):%Y%m%dT%H%M}-{uuid.uuid4().hex[:6]}"
    final = Path(settings.models_dir) / version_id
    staging = Path(settings.models_dir) / f".{version_id}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    model.save(staging)
    staging.rename(final)
    train_start = pd.to_datetime(events["started_at"], utc=True, errors="coerce").min() if len(events) else None
    scores = {"n_events": model.n_events_, "n_transfers": model.n_transfers_, "skipped": model.skipped_,
              "recent_weight": model.weight_, "node_weight": model.node_weight_, "validation": model.validation_,
              "rates_bytes_per_s": model.rates_.rates_,
              "rate_observations": model.rates_.n_, "fit_s": round(time.perf_counter() - started, 3)}
    insert_version(engine, version_id=version_id, path=final, status="challenger",
                   train_start=None if train_start is None or pd.isna(train_start) else train_start.to_pydatetime(),
                   train_end=now, members=["trees", "recent", "node_median", "transfers"] if model.trees_ else ["prior", "transfers"],
                   scores=scores, code_version=_code_version(), kind=KIND)
    promote_version(engine, version_id)
    with _lock:
        _models[_key(engine, settings)] = (version_id, model)
    log.info("latency model %s: %d cold starts (%s skipped), %d transfers", version_id, model.n_events_,
             model.skipped_ or "none", model.n_transfers_)
    return version_id


def ensure_latency_model(engine: Engine, settings: Settings, now: datetime) -> str:
    """The latency champion's id, training the first one when none is saved yet (the first start)."""
    info = champion_version(engine, kind=KIND)
    return info.id if info is not None else train_latency_model(engine, settings, now)


def load_latency_model(engine: Engine, settings: Settings, *, config: FleetConfig = FleetConfig()
                       ) -> ColdStartModel:
    """The latency champion, loaded once per version; the physics prior when none is saved (or it cannot be read).

    Cheap per call: one index probe on ``model_versions``; the model is read
    from ``models/<version>/`` only when the champion changed.
    """
    return _current(engine, settings, config)[1]


def latency_version(engine: Engine, settings: Settings) -> str | None:
    """The version :func:`load_latency_model` answers with (None: the prior)."""
    return _current(engine, settings, FleetConfig())[0]


def _current(engine: Engine, settings: Settings, config: FleetConfig) -> tuple[str | None, ColdStartModel]:
    info = champion_version(engine, kind=KIND)
    key = _key(engine, settings)
    version = None if info is None else info.id
    with _lock:
        held = _models.get(key)
    if held is not None and held[0] == version:
        return held
    model = None
    if info is not None:
        try:
            model = ColdStartModel.load(info.path, config=config)
            log.info("loaded latency model %s from %s", info.id, info.path)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("latency model %s at %s cannot be read (%s); using the physics prior", info.id, info.path,
                        exc)
            version = None
    if model is None:
        model = ColdStartModel(config=config).fit(_no_events())
    with _lock:
        _models[key] = (version, model)
    return version, model


def latency_table(engine: Engine, settings: Settings, models: pd.DataFrame, *, hour: int,
                  nodes=None) -> "pd.DataFrame | NodeLatencyTable":
    """Predicted seconds per model and start state (the planner's latency input) from the latency champion.

    Args:
        models: one row per model (index ``model_id``) with ``image_bytes`` and ``weights_bytes``.
        hour: UTC hour of the planned starts.
        nodes: None (one row per model and state), or the node ids to answer for (per model, node and
            state, from each node's own history; a node without history falls back to the model's and
            tier's, then the global; see :meth:`ColdStartModel.node_latency_table`).

    Returns:
        Without ``nodes``: a frame ``model_id, state, total_s`` and the phases (a copy). With ``nodes``: a
        :class:`~forecaster.contracts.latency.NodeLatencyTable` (float32 arrays, read-only, shared by every
        caller). Cached per (version, hour, the models' sizes, the nodes), so the plan job pays the prediction
        once an hour, not every minute; the cache holds at most ``_TABLES_KEPT`` tables and, beyond the newest,
        ``_TABLE_BYTES_KEPT`` bytes of them (oldest dropped first).
    """
    version, model = _current(engine, settings, FleetConfig())
    sizes = models[["image_bytes", "weights_bytes"]].astype("float64")
    digest = int(pd.util.hash_pandas_object(sizes, index=True).sum())
    node_ids = None if nodes is None else tuple(str(n) for n in nodes)
    if node_ids is not None and not all(node_ids):
        raise ValueError("node ids must be non-empty strings")
    key = (_key(engine, settings), version, int(hour), len(sizes), digest, node_ids)
    with _lock:
        table = _tables.get(key)
    if table is None:
        if node_ids is None:
            table = model.latency_table(sizes, hour=int(hour))
        else:
            table = model.node_latency_table(sizes, hour=int(hour), nodes=list(node_ids))
        with _lock:
            _tables[key] = table
            while len(_tables) > 1 and (len(_tables) > _TABLES_KEPT or _cached_bytes() > _TABLE_BYTES_KEPT):
                _tables.pop(next(iter(_tables)))
    return table if isinstance(table, NodeLatencyTable) else table.copy()


def _cached_bytes() -> int:
    return sum(t.nbytes if isinstance(t, NodeLatencyTable) else int(t.memory_usage(deep=False).sum())
               for t in _tables.values())


def _no_events() -> pd.DataFrame:
    return pd.DataFrame(columns=["model_id", "node_id", "started_at", "total_seconds", "cache_state",
                                 "image_bytes", "weights_bytes"])
