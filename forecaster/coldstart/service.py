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
* Between refits the champion observes the cold starts stored since its
  training (:func:`_observed`, ``ColdStartModel.observe``: history and the
  recent member's drift): those with a higher ``cold_starts.id`` than it was
  trained through, or an id below that its training's snapshot could not see
  (a transaction still open then: identity ids are taken at insert, seen at
  commit; ``ColdStartModel.gap_ids_``, :func:`cold_start_training_watermark`),
  that started before the table's cutoff, the start of the
  table's hour less :data:`PREFETCH_LEAD_MIN` minutes. The cutoff moves once
  an hour, so a new cold start shows in the next hour's table (at most about
  65 minutes later) and the table is still built once an hour (a late-arriving
  start changes the key and rebuilds it). Every process observes the same
  rows in the same order on a copy of the champion as loaded, so the plan
  job, the API and a prefetch child answer alike; the observed rows' count
  and highest id are part of the cache and file keys.
* :func:`latency_table` is the planner's latency input from that model,
  cached per (version, observed rows, hour, catalogue sizes): the same numbers for the plan
  job and the API's lead time. A model without registered sizes is answered
  from its own starts, else ``PREWARM_DEFAULT_COLD_START_S``
  (``ColdStartModel.sizeless_fallback``), never the 0-byte prior. :func:`prefetch_next_hour` builds the next
  hour's table in a background thread in the last minutes of an hour, so the
  first plan of the hour does not pay the build (70 s at 100,000 models).
  Per-node tables of a saved champion are also written as files beside the
  models (:mod:`forecaster.coldstart.table_files`,
  ``PREWARM_LATENCY_TABLE_FILES_KEPT``): a process that misses its own cache
  (just started, another API worker, the API beside the plan job) reads the
  table instead of computing it again.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pandas as pd
from sqlalchemy import Engine

from forecaster.coldstart import table_files
from forecaster.coldstart.model import ColdStartModel, load_cold_starts, with_concurrency
from forecaster.contracts.phases import PHASES
from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.contracts.latency import NodeLatencyTable
from forecaster.settings import Settings
from forecaster.store.files import publish_dir
from forecaster.store.coldstarts import (cold_start_training_watermark, cold_starts_after_summary, count_cold_starts,
                                         read_cold_starts_after)
from forecaster.store.registry import champion_version, insert_version, promote_version
from forecaster.store.transfers import read_transfers

log = logging.getLogger(__name__)

KIND = "latency"
_lock = threading.Lock()
_models: dict[str, tuple[str | None, ColdStartModel]] = {}  # database#models_dir -> (version, model)
#: database#models_dir -> (champion version whose files could not be loaded, monotonic seconds of the attempt):
#: the prior stands in for it until :data:`LOAD_RETRY_S` later, so a damaged version is not re-read every call
_failed_loads: dict[str, tuple[str, float]] = {}
#: seconds before a champion that could not be loaded is read again (a volume mounted late heals; a damaged file
#: is only logged again at debug level)
LOAD_RETRY_S = 600.0
#: (database, version, hour, sizes, nodes) -> table, in use order (least recently used first)
_tables: "OrderedDict[tuple, pd.DataFrame | NodeLatencyTable]" = OrderedDict()
_building: dict[tuple, "_Build"] = {}  # key -> its build in flight (single-flight: callers wait on it)
_prefetches: list[threading.Thread] = []  # prefetch threads started and not yet seen finished
_stats = {"builds": 0, "hits": 0, "waits": 0, "prefetches_started": 0, "prefetch_failures": 0, "files_read": 0,
          "files_written": 0}
_TABLES_KEPT = 8
#: bytes of arrays the per-hour cache may hold beyond its two most recently used tables (a 100,000 x 64 node
#: table is about 110 MB: this hour's and the next hour's of the plan job and of the API's snapshot fit)
_TABLE_BYTES_KEPT = 512 * 2**20
#: minutes before the hour turns in which :func:`prefetch_next_hour` builds the next hour's table (at 100,000
#: models x 64 nodes a build alone takes about 70 s, beside the plans on a loaded 2-core machine 130-160 s:
#: started after the plan of minute :55 it has four minutes and their idle time to finish in before :00)
PREFETCH_LEAD_MIN = 5
#: where a prefetch computes: in a spawned child process at lower CPU priority (True), or in the prefetch thread
#: itself (False). In a thread the build holds the GIL for most of its ~70 s at 100,000 models and slowed the
#: plans of the minutes beside it to 62-81 s (docs/scale.md); a child of its own uses the core the plan job leaves
#: idle, gives way to it when both want the same core (``PREFETCH_NICE``), and sends the arrays back through a pipe
PREFETCH_IN_PROCESS = True
#: how much lower than its parent the prefetch process runs (``os.nice`` increment)
PREFETCH_NICE = 10


def _key(engine: Engine, settings: Settings) -> str:
    return f"{engine.url.render_as_string(hide_password=True)}#{Path(settings.models_dir).resolve()}"


def _code_version() -> str:
    from forecaster import __version__

    return __version__


def train_latency_model(engine: Engine, settings: Settings, now: datetime, *,
                        config: FleetConfig = FleetConfig(), tree_params: dict | None = None) -> str:
    """Fit the latency model on ``cold_starts`` + ``transfers``, save it, make it the latency champion.

    It learns from the ``PREWARM_LATENCY_TRAIN_DAYS`` before the newest stored cold start (and transfer; ``now``
    where that is earlier), at most ``PREWARM_LATENCY_TRAIN_MAX_EVENTS`` of the newest cold starts (and of the
    newest transfers, of which the rates use the last 1,000 of each kind): the fit's time and memory grow with the
    events (about 0.17 ms and 2-3 KB each), and the store's grow every day.

    Args:
        now: data time of the version (its id starts with it).
        config: the fleet physics of the prior.
        tree_params: LightGBM settings of the phase trees (tests pass small ones).

    Returns:
        The new version id (``latency-<YYYYmmddTHHMM>-<6 hex>``).
    """
    started = time.perf_counter()
    # the watermark and the rows in one snapshot: the rows trained on are exactly those with id <= through_id
    # less the gap ids (taken by transactions still open, which may commit later: observed then, see _observed)
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn, conn.begin():
        watermark = cold_start_training_watermark(conn)
        events = load_cold_starts(engine, days=settings.latency_train_days,
                                  max_events=settings.latency_train_max_events, until=now, conn=conn)
    transfers = read_transfers(engine, days=settings.latency_train_days, until=now,
                               max_rows=settings.latency_train_max_events)
    model = ColdStartModel(config=config, tree_params=tree_params).fit(events, transfers)
    model.through_id_ = watermark.through_id
    model.gap_floor_id_ = watermark.floor_id
    model.gap_ids_ = watermark.gap_ids
    if watermark.gap_ids is None:
        log.warning("latency model training: too many cold-start ids below %d not visible (a large rollback or "
                    "deletion); between refits it re-reads the rows above id %d and skips those it holds",
                    watermark.through_id, watermark.floor_id)
    version_id = f"{KIND}-{now.astimezone(timezone.utc):%Y%m%dT%H%M}-{uuid.uuid4().hex[:6]}"
    final = Path(settings.models_dir) / version_id
    staging = Path(settings.models_dir) / f".{version_id}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save(staging)
        publish_dir(staging, final)  # on disk before the row below names it: a power loss leaves no empty booster
    except BaseException:  # a full disk, an interrupt: no staging folder is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    train_start = pd.to_datetime(events["started_at"], utc=True, errors="coerce").min() if len(events) else None
    scores = {"n_events": model.n_events_, "n_transfers": model.n_transfers_, "skipped": model.skipped_,
              "train_days": settings.latency_train_days, "max_events": settings.latency_train_max_events,
              "recent_weight": model.weight_, "node_weight": model.node_weight_, "validation": model.validation_,
              "rates_bytes_per_s": model.rates_.rates_,
              "rate_observations": model.rates_.n_, "fit_s": round(time.perf_counter() - started, 3)}
    members = ["trees", "recent", "node_median", "transfers"] if model.trees_ else ["prior", "transfers"]
    try:
        insert_version(engine, version_id=version_id, path=final, status="challenger",
                       train_start=None if train_start is None or pd.isna(train_start) else train_start.to_pydatetime(),
                       train_end=now, members=members, scores=scores, code_version=_code_version(), kind=KIND)
    except BaseException:  # no row will ever name the folder: it goes now (one a kill leaves, the retention sweep)
        shutil.rmtree(final, ignore_errors=True)
        raise
    promote_version(engine, version_id)
    with _lock:
        _models[_key(engine, settings)] = (version_id, model)
    log.info("latency model %s: %d cold starts (%s skipped), %d transfers", version_id, model.n_events_,
             model.skipped_ or "none", model.n_transfers_)
    return version_id


def ensure_latency_model(engine: Engine, settings: Settings, now: datetime) -> str:
    """The latency champion's id, training the first one when none is saved yet (the first start), and training
    again while the champion is the physics prior alone (fitted on fewer than ``min_events`` cold starts: a fresh
    install's first plan) as soon as the store holds ``min_events`` more cold starts than it was fitted on
    (one ``count(*)`` a plan while there is no fitted champion; nothing once there is one)."""
    info = champion_version(engine, kind=KIND)
    if info is None:
        return train_latency_model(engine, settings, now)
    if "trees" in (info.members or []):
        return info.id
    scores = info.scores or {}
    seen = int(scores.get("n_events", 0)) + sum(int(v) for v in (scores.get("skipped") or {}).values())
    min_events = ColdStartModel().min_events
    stored = count_cold_starts(engine)
    if stored >= seen + min_events:
        log.info("latency champion %s is the prior alone (%d cold starts); %d are stored now: training",
                 info.id, seen, stored)
        return train_latency_model(engine, settings, now)
    return info.id


def load_latency_model(engine: Engine, settings: Settings, *, config: FleetConfig = FleetConfig()
                       ) -> ColdStartModel:
    """The latency champion, loaded once per version; the physics prior when none is saved (or it cannot be read).

    Cheap per call: one index probe on ``model_versions``; the model is read
    from ``models/<version>/`` only when the champion changed. A champion whose
    files cannot be loaded (missing, empty, cut short by a crash, not parseable)
    is answered with the prior; the failure is logged and remembered, and the
    files are read again only :data:`LOAD_RETRY_S` later, not every call.
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
        failed = _failed_loads.get(key)
    if held is not None and held[0] == version:
        return held
    retry = failed is not None and failed[0] == version
    if held is not None and held[0] is None and retry and time.monotonic() - failed[1] < LOAD_RETRY_S:
        return held  # this champion could not be loaded a moment ago: the prior goes on standing in
    model = None
    if info is not None:
        try:
            model = ColdStartModel.load(info.path, config=config)
            log.info("loaded latency model %s from %s", info.id, info.path)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with the files, plan with the prior
            log.log(logging.DEBUG if retry else logging.WARNING,
                    "latency model %s at %s cannot be loaded (%s: %s); using the physics prior, trying again in "
                    "%.0f s", info.id, info.path, type(exc).__name__, exc, LOAD_RETRY_S)
            with _lock:
                _failed_loads[key] = (info.id, time.monotonic())
            version = None
    if model is None:
        model = ColdStartModel(config=config).fit(_no_events())
    with _lock:
        _models[key] = (version, model)
        if version is not None:
            _failed_loads.pop(key, None)
    return version, model


#: (database#models_dir, cutoff) -> (version, count, highest id, the champion having observed those rows), in use
#: order; :data:`_OBSERVED_KEPT` per database: the plan's cutoff (this hour's) and the prefetch's (the next hour's)
#: are both held, so in an hour's last minutes neither evicts the other and re-reads every row since training
_observed_models: "OrderedDict[tuple[str, datetime], tuple]" = OrderedDict()
#: observed copies kept per database (this hour's cutoff and the next hour's)
_OBSERVED_KEPT = 2


def observation_cutoff(now: datetime | None, hour: int) -> datetime:
    """The start time before which stored cold starts are observed for a table of UTC ``hour`` asked at ``now``:
    the start of that hour (this hour's or the next one's) less :data:`PREFETCH_LEAD_MIN` minutes. The plan of
    any minute of an hour and the prefetch for it in the previous hour's last minutes get the same cutoff."""
    now = datetime.now(timezone.utc) if now is None else now.astimezone(timezone.utc)
    start = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=(int(hour) - now.hour) % 24)
    if start > now + timedelta(hours=1):  # an hour already begun (asked for an earlier hour of the day)
        start -= timedelta(hours=24)
    return start - timedelta(minutes=PREFETCH_LEAD_MIN)


def _observed(engine: Engine, settings: Settings, version: str | None, model: ColdStartModel,
              cutoff: datetime) -> tuple[tuple | None, ColdStartModel]:
    """The champion having observed the cold starts stored since its training that started before ``cutoff``.

    Returns ``(observation key, model)``: the key ``(cutoff, count, highest id)`` goes into the table keys, None
    when nothing is observed (the prior, a version saved before training watermarks, nothing new). One
    ``count``/``max`` range scan of the primary key a call; the rows are read and observed (on a copy of the
    champion as loaded, so a process that just started answers as one that has run for hours) only when that
    changed: the cutoff moves once an hour.
    """
    through = getattr(model, "through_id_", None)
    if version is None or through is None:
        return None, model
    # rows stored since the training: a higher id, or an id its snapshot could not see (a gap: committed later)
    gaps = getattr(model, "gap_ids_", ())
    overlap = gaps is None  # too many gaps were recorded: every row above the floor, less those already held
    after = int(getattr(model, "gap_floor_id_", None) or 0) if overlap else through
    also = () if overlap else tuple(gaps)
    count, highest = cold_starts_after_summary(engine, after_id=after, started_before=cutoff, also_ids=also)
    if count == 0:
        return None, model
    database = _key(engine, settings)
    key = (database, cutoff)
    state = (version, count, highest)
    with _lock:
        held = _observed_models.get(key)
        if held is not None and held[:3] == state:
            _observed_models.move_to_end(key)
            return (cutoff.isoformat(), count, highest), held[3]
    started = time.perf_counter()
    events = read_cold_starts_after(engine, after_id=after, started_before=cutoff, also_ids=also)
    if overlap:
        events = _not_held(model, events)
    for column in ("total_seconds", *PHASES, "image_bytes", "weights_bytes", "node_bytes_per_s"):
        events[column] = pd.to_numeric(events[column], errors="coerce").astype("float64")
    observed = model.observed_copy(with_concurrency(events) if len(events) else events)
    with _lock:
        _observed_models[key] = (*state, observed)
        _observed_models.move_to_end(key)
        mine = [k for k in _observed_models if k[0] == database]
        for stale in mine[:max(0, len(mine) - _OBSERVED_KEPT)]:  # least recently used first
            del _observed_models[stale]
    log.info("latency model %s observed %d cold starts stored since its training (before %s) in %.2f s", version,
             count, cutoff.isoformat(), time.perf_counter() - started)
    return (cutoff.isoformat(), count, highest), observed


def _not_held(model: ColdStartModel, events: pd.DataFrame) -> pd.DataFrame:
    """``events`` less those ``model`` already holds in its history, by (model, node, start): the overlap read of a
    training that recorded too many gaps re-reads rows it trained on."""
    from forecaster.coldstart.model import _started_seconds

    if not len(events) or not len(model.history_):
        return events
    held = set(zip(model.history_["model_id"].astype(str), model.history_["node_id"].astype(str),
                   pd.to_numeric(model.history_["started_s"], errors="coerce").round(3)))
    keys = zip(events["model_id"].astype(str), events["node_id"].astype(str),
               pd.Series(_started_seconds(events)).round(3))
    return events[[key not in held for key in keys]].reset_index(drop=True)


def latency_model_at(engine: Engine, settings: Settings, *, now: datetime | None = None, hour: int | None = None
                     ) -> tuple[str | None, ColdStartModel]:
    """(champion version, the champion having observed the cold starts since its training) for a table of
    ``hour`` (default ``now``'s) asked at ``now``: what :func:`latency_table` predicts with."""
    now = datetime.now(timezone.utc) if now is None else now
    hour = now.astimezone(timezone.utc).hour if hour is None else hour
    version, model = _current(engine, settings, FleetConfig())
    return version, _observed(engine, settings, version, model, observation_cutoff(now, hour))[1]


def latency_table(engine: Engine, settings: Settings, models: pd.DataFrame, *, hour: int,
                  nodes=None, now: datetime | None = None) -> "pd.DataFrame | NodeLatencyTable":
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
        once an hour, not every minute, and not even that when :func:`prefetch_next_hour` built the hour's table
        before it began. Single-flight per key: a caller whose table is being built (by a prefetch or another
        caller) waits for that build instead of starting a second one; the build holds no lock while it
        computes. A per-node table of a saved champion is read from its file when another process (or this one
        before a restart) computed it, and written there when computed here; while one process computes it, the
        others wait for its file (:mod:`~forecaster.coldstart.table_files`). The cache holds at most
        ``_TABLES_KEPT`` tables and, beyond the two most recently used (the table in use and the one just built,
        so a prefetch never evicts the table of the hour being planned), ``_TABLE_BYTES_KEPT`` bytes of them
        (least recently used dropped first).
    """
    table = _cached_or_built(_request(engine, settings, models, hour=hour, nodes=nodes, now=now))
    return table if isinstance(table, NodeLatencyTable) else table.copy()


def prefetch_latency_table(engine: Engine, settings: Settings, models: pd.DataFrame, *, hour: int,
                           nodes=None, now: datetime | None = None) -> threading.Thread | None:
    """Start building :func:`latency_table`'s table for ``hour`` in a background daemon thread.

    What the call would build, made ahead so that the first caller of that hour finds it cached (or, still
    being built, waits for it rather than building it again). The champion and the key are read here, in the
    caller's thread; the thread does not touch the database: it has the table computed in a spawned child at lower
    priority (:func:`build_in_child`, :data:`PREFETCH_IN_PROCESS`) and waits for it without holding the GIL, so
    the plans of the minutes beside it keep this process's CPU. Nothing is started (None) when the table is cached
    or being built, or while another prefetch is still running (one at a time: at 100,000 models x 64 nodes a
    build takes about a gigabyte while it runs; see docs/scale.md). A build that fails is logged and dropped; the
    next caller of that key builds it itself.

    Returns:
        The started thread (join it, or :func:`wait_for_prefetches`), or None when nothing was started.
    """
    request = _request(engine, settings, models, hour=hour, nodes=nodes, now=now)
    with _lock:
        if request.key in _tables or request.key in _building or any(t.is_alive() for t in _prefetches):
            return None
        build = _Build()
        _building[request.key] = build
        thread = threading.Thread(target=_run_prefetch, args=(request, build), daemon=True,
                                  name=f"latency-prefetch-{request.hour:02d}h")
        _prefetches[:] = [t for t in _prefetches if t.is_alive()] + [thread]
        _stats["prefetches_started"] += 1
    try:
        thread.start()
    except RuntimeError:  # no thread to be had: release the claim, the hour's first caller builds the table
        with _lock:
            _building.pop(request.key, None)
        build.done.set()
        log.exception("latency table prefetch for hour %02d could not start", request.hour)
        return None
    return thread


def prefetch_next_hour(engine: Engine, settings: Settings, models: pd.DataFrame, *, now: datetime,
                       nodes=None) -> threading.Thread | None:
    """In the last :data:`PREFETCH_LEAD_MIN` minutes of ``now``'s UTC hour, prefetch the next hour's table.

    Called after each plan (and each API lead-time refresh) with that plan's own models and nodes, so that the
    key is the one the first plan of the next hour asks for (if the catalogue or the nodes change in between,
    that plan builds its table itself, as without a prefetch). The first call in the window starts the build;
    the later ones find it cached or in flight. The table is prefetched whether or not it differs from this
    hour's (the prior's peak hours change it at their edges; the key does not know which hours those are).

    Returns:
        The started thread, or None (outside the window, already cached or in flight).
    """
    utc = now.astimezone(timezone.utc)
    if utc.minute < 60 - PREFETCH_LEAD_MIN:
        return None
    return prefetch_latency_table(engine, settings, models, hour=(utc + timedelta(hours=1)).hour, nodes=nodes,
                                  now=now)


def wait_for_prefetches(timeout_s: float | None = None) -> bool:
    """Join the prefetch threads started so far; True when none is still running (tests, benchmarks, shutdown)."""
    with _lock:
        threads = list(_prefetches)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def latency_table_stats() -> dict[str, int]:
    """Counters of the table cache since the process started (observability; tests compare before and after).

    ``builds``: tables computed (by a caller or a prefetch); ``hits``: answered from the cache; ``waits``:
    callers that waited for a build in flight for their key; ``prefetches_started``; ``prefetch_failures``;
    ``files_read``: tables read from the file another process (or this one) wrote instead of computed;
    ``files_written``.
    """
    with _lock:
        return dict(_stats)


@dataclass(frozen=True)
class _TableRequest:
    """One table to answer: its cache key and what building it needs (the champion is resolved already)."""

    key: tuple
    model: ColdStartModel
    sizes: pd.DataFrame
    hour: int
    node_ids: tuple[str, ...] | None
    #: where the table is shared with other processes (:mod:`forecaster.coldstart.table_files`), or None
    models_dir: Path | None = None
    file_key: dict | None = None
    files_kept: int = 0
    #: a model without sizes and without starts of its own is answered with this (``PREWARM_DEFAULT_COLD_START_S``)
    default_s: float | None = None

    def build(self) -> "pd.DataFrame | NodeLatencyTable":
        """The table itself (seconds to a minute at 100,000 models; pure computation, no database)."""
        extra = {} if self.default_s is None else {"default_s": self.default_s}
        if self.node_ids is None:
            return self.model.latency_table(self.sizes, hour=self.hour, **extra)
        return self.model.node_latency_table(self.sizes, hour=self.hour, nodes=list(self.node_ids), **extra)


class _Build:
    """A build in flight: callers of its key wait on ``done``; ``table`` is None after a failure."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.table: "pd.DataFrame | NodeLatencyTable | None" = None


def _request(engine: Engine, settings: Settings, models: pd.DataFrame, *, hour: int, nodes,
             now: datetime | None = None) -> _TableRequest:
    """The champion (one index probe), having observed the cold starts since its training (one range scan; see
    :func:`_observed`), and the cache key of a table request; the sizes copied for the build."""
    version, model = _current(engine, settings, FleetConfig())
    observation, model = _observed(engine, settings, version, model, observation_cutoff(now, hour))
    default_s = float(settings.default_cold_start_s)
    sizes = models[["image_bytes", "weights_bytes"]].astype("float64")
    digest = int(pd.util.hash_pandas_object(sizes, index=True).sum())
    node_ids = None if nodes is None else tuple(str(n) for n in nodes)
    if node_ids is not None and not all(node_ids):
        raise ValueError("node ids must be non-empty strings")
    key = (_key(engine, settings), version, observation, default_s, int(hour), len(sizes), digest, node_ids)
    shared = version is not None and node_ids is not None and settings.latency_table_files_kept > 0
    # the file key's version names what was observed and the default too: another process reads only a table
    # computed from the same champion, the same observed rows and the same default
    shown = version if observation is None else f"{version}+obs-{observation[1]}-{observation[2]}-" \
        f"{observation[0][:16]}"
    shown = f"{shown}+d{default_s:g}" if shown is not None else None
    file_key = table_files.table_key(version=shown, hour=hour, n_models=len(sizes), sizes_digest=digest,
                                     node_ids=node_ids) if shared else None
    return _TableRequest(key=key, model=model, sizes=sizes, hour=int(hour), node_ids=node_ids,
                         models_dir=Path(settings.models_dir) if shared else None, file_key=file_key,
                         files_kept=settings.latency_table_files_kept, default_s=default_s)


def _cached_or_built(request: _TableRequest) -> "pd.DataFrame | NodeLatencyTable":
    """The cached table of ``request.key``; else waits for its build in flight; else builds it here.

    A waiter whose build failed tries again (it then builds itself, and raises if that fails too).
    """
    while True:
        with _lock:
            table = _tables.get(request.key)
            if table is not None:
                _tables.move_to_end(request.key)
                _stats["hits"] += 1
                return table
            build = _building.get(request.key)
            if build is None:
                build = _building[request.key] = _Build()
                break
            _stats["waits"] += 1
        build.done.wait()
        if build.table is not None:
            return build.table
    return _finish(request, build)


def _finish(request: _TableRequest, build: _Build, builder=None) -> "pd.DataFrame | NodeLatencyTable":
    """Read the claimed ``build``'s table from its file where another process (or this one before a restart)
    wrote it, else compute it outside the lock (here, or with ``builder(request)``) and write its file; then cache
    it (or, on failure, release the claim). While computing a shared table this process holds its file lock: a
    process that asks for it meanwhile waits and reads the file instead of computing it too."""
    try:
        table = _read_file(request)
        if table is None:
            with _file_lock(request) as waited:  # another process computing the same table: wait, then read it
                table = _read_file(request) if waited else None
                if table is None:
                    with _lock:
                        _stats["builds"] += 1
                    table = request.build() if builder is None else builder(request)
                    _write_file(request, table)
    except BaseException:
        with _lock:
            _building.pop(request.key, None)
        build.done.set()
        raise
    with _lock:
        _tables[request.key] = table
        _tables.move_to_end(request.key)
        _evict()
        _building.pop(request.key, None)
        build.table = table
    build.done.set()
    return table


def _read_file(request: _TableRequest) -> "NodeLatencyTable | None":
    """The table's file, where the request is shared and one was written (else None: compute it)."""
    if request.file_key is None:
        return None
    started = time.perf_counter()
    try:
        table = table_files.read_table(request.models_dir, request.file_key)
    except Exception:  # noqa: BLE001 - a shared file is an optimisation: whatever is wrong with it, compute
        log.exception("latency table file for hour %02d unreadable; computing the table", request.hour)
        return None
    if table is not None:
        with _lock:
            _stats["files_read"] += 1
        log.info("latency table for hour %02d read from its file in %.2f s (%d models)", request.hour,
                 time.perf_counter() - started, len(request.sizes))
    return table


def _file_lock(request: _TableRequest):
    """The cross-process build lock of a shared request (:func:`table_files.build_lock`); nothing to hold else."""
    if request.file_key is None:
        return contextlib.nullcontext(False)
    return table_files.build_lock(request.models_dir, request.file_key)


def _write_file(request: _TableRequest, table: "pd.DataFrame | NodeLatencyTable") -> None:
    """Share a computed table through its file (where the request is shared; a failure is logged only)."""
    if request.file_key is None or not isinstance(table, NodeLatencyTable):
        return
    try:
        written = table_files.write_table(request.models_dir, request.file_key, table, kept=request.files_kept)
    except Exception:  # noqa: BLE001 - the table is computed and cached here; only its sharing failed
        log.exception("latency table for hour %02d not written to a file", request.hour)
        return
    if written is not None:
        with _lock:
            _stats["files_written"] += 1


def _run_prefetch(request: _TableRequest, build: _Build) -> None:
    """A prefetch thread's body: build (in a child process, :data:`PREFETCH_IN_PROCESS`), and log a failure (the
    plan job then builds the table itself)."""
    started = time.perf_counter()
    try:
        table = _finish(request, build, build_in_child if PREFETCH_IN_PROCESS else None)
    except Exception:  # noqa: BLE001 - a prefetch is an optimisation; its failure must not reach the job
        if not threading.main_thread().is_alive():
            # the process is exiting (its main thread has ended; multiprocessing then terminates the child, as at
            # the end of `prewarm demo`): nothing failed that anyone will wait for
            log.info("latency table prefetch for hour %02d abandoned: the process is exiting", request.hour)
            return
        with _lock:
            _stats["prefetch_failures"] += 1
        log.exception("latency table prefetch for hour %02d failed; the hour's first caller builds it", request.hour)
        return
    log.info("latency table for hour %02d prefetched in %.1f s (%d models, %.0f MB)", request.hour,
             time.perf_counter() - started, len(request.sizes), _nbytes(table) / 2**20)


def build_in_child(request: _TableRequest, *, timeout_s: float = 3600.0) -> "pd.DataFrame | NodeLatencyTable":
    """``request.build()`` in a spawned child process at :data:`PREFETCH_NICE` lower priority, one BLAS/OpenMP
    thread; the table comes back through a pipe.

    Spawned, not forked: the plan job's and the API's processes hold thread pools (LightGBM, BLAS) and locks that
    a forked child could find held. The calling thread waits in ``recv`` (the GIL released), so the parent's
    plans run meanwhile. A failure in the child is raised here with the child's traceback; a child that dies
    (killed for memory, say) or outlives ``timeout_s`` is a clear error, never a hang.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child_build, args=(request, sender, PREFETCH_NICE), daemon=True,
                            name=f"latency-table-{request.hour:02d}h")
    child.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            raise RuntimeError(f"the latency table process gave no answer in {timeout_s:.0f} s")
        kind, payload = receiver.recv()
    except EOFError:
        child.join(timeout=5)
        raise RuntimeError(f"the latency table process ended without a table (exit code {child.exitcode}; "
                           "killed for memory?)") from None
    finally:
        receiver.close()
        if child.is_alive():
            child.join(timeout=5)
        if child.is_alive():
            child.kill()
            child.join()
    if kind == "error":
        raise RuntimeError(f"the latency table build failed in its process:\n{payload}")
    return payload


def _child_build(request: _TableRequest, sender, nice: int) -> None:
    """:func:`build_in_child`'s child: lower priority, one thread per pool, build, send the table (or the error)."""
    import traceback

    try:
        if nice:
            os.nice(nice)
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1):
            table = request.build()
        _send_to_parent(sender, ("table", table))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, which raises it
        _send_to_parent(sender, ("error", traceback.format_exc()))
    finally:
        sender.close()


def _send_to_parent(sender, message: tuple) -> None:
    """Send ``message`` to the waiting parent; a parent that stopped waiting (it timed out, or its process is
    ending, as at the end of ``prewarm demo`` with a prefetch in flight) closed the pipe: there is no one to tell,
    and a traceback from the child about it would only alarm whoever reads the log."""
    try:
        sender.send(message)
    except (BrokenPipeError, ConnectionResetError):
        pass


def _evict() -> None:
    """Drop least recently used tables beyond ``_TABLES_KEPT`` or ``_TABLE_BYTES_KEPT``; the newest two stay.

    The newest two in use order are the table just built and the one used last before it: when a prefetch adds
    the next hour's table, the table the plan job reads every minute of this hour is not the one to go.
    """
    while len(_tables) > 2 and (len(_tables) > _TABLES_KEPT or _cached_bytes() > _TABLE_BYTES_KEPT):
        _tables.popitem(last=False)


def _nbytes(table: "pd.DataFrame | NodeLatencyTable") -> int:
    return table.nbytes if isinstance(table, NodeLatencyTable) else int(table.memory_usage(deep=False).sum())


def _cached_bytes() -> int:
    return sum(_nbytes(t) for t in _tables.values())


def _no_events() -> pd.DataFrame:
    return pd.DataFrame(columns=["model_id", "node_id", "started_at", "total_seconds", "cache_state",
                                 "image_bytes", "weights_bytes"])
