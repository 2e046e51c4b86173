"""The trace-driven fleet simulator.

Time advances in ticks of ``config.tick_s`` seconds. Per tick, for all models
at once (numpy over models): requests arrive, queue FIFO while no capacity is
ready, and are served at up to ``replica_rps`` per ready replica (a fluid
server: a backlog of ``B`` requests drains at ``n * mu - lambda`` per second).
Replica start-ups, transfers and planned actions are events on a heap:

* a replica is placed on the node holding the warmest copy of its model
  (weights in host memory > on disk > image only > nothing), then the node
  with most free GPUs; it reserves its GPUs from placement to release;
* it pulls the image (registry), fetches the weights (object store), loads
  them into GPU memory, starts the runtime and registers (see
  :mod:`forecaster.contracts.fleetconfig`); transfers share the node's NIC and the
  registry's or bucket's egress equally among those running (processor
  sharing, recomputed whenever a transfer starts or ends);
* pre-pulls and pre-loads requested by a policy are the same transfers, kept
  in the node's cache (LRU within disk and host-memory capacity).

Waits are exact for the fluid FIFO queue: the simulator records, for every
tick where a model had a backlog, how many of its requests had been served,
and a request's service start is interpolated inside the tick that reached it.

Accounting (from ``config.score_from_s`` on): a request is a *cold start* when
it arrives while its model has no ready replica; GPU-seconds *allocated* run
from placement to release; *busy* GPU-seconds are requests served x GPUs /
``replica_rps``; *wasted* = allocated - busy.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from forecaster.contracts.fleet import registry_of
from forecaster.contracts.actions import Action, ActionKind, Tier
from forecaster.contracts.bursts import BURST_BUCKET_S, update_burst_factor
from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.simulation.workload import Workload

log = logging.getLogger(__name__)

STATE_NAMES = ("none", "image", "disk", "host")
RATE_TAU_S = 10.0  # memory of the serving layer's request-rate estimate


# --------------------------------------------------------------------------- records


@dataclass
class Replica:
    rid: int
    model: int
    node: int
    started_at: float
    cache_state: str
    contention: int
    registry_pulls: int
    phase: str = "image"
    phase_started: float = 0.0
    phases: dict = field(default_factory=dict)
    waiting_on: int | None = None  # transfer id
    ready_at: float | None = None
    cancelled: bool = False


@dataclass
class Transfer:
    tid: int
    node: int
    kind: str  # image | weights | copy
    key: str  # image ref, or model index as str
    source: str | None  # registry or bucket; None for a local copy
    total: float
    left: float
    started_at: float
    model: int | None = None
    target_tier: str = "disk"  # for weights: disk | host
    pinned: bool = False  # pre-loaded by a policy: survives replica release
    waiters: list[int] = field(default_factory=list)
    rate: float = 0.0


@dataclass
class SimResult:
    """What one simulated run measured (scored window only)."""

    policy: str
    model_ids: np.ndarray
    requests: np.ndarray  # (N,) requests scored
    cold_requests: np.ndarray  # (N,) arrived with no ready replica
    waits: np.ndarray  # (R_scored,) seconds before service
    wait_model: np.ndarray  # (R_scored,) model index of each wait
    gpu_seconds: float
    busy_gpu_seconds: float
    bytes_registry: float
    bytes_object_store: float
    peak_concurrent_pulls: int
    replica_starts: int
    gpu_unavailable: int
    events: pd.DataFrame  # one row per replica start (cold start record)
    wall_s: float
    wait_slo_s: float
    extra: dict = field(default_factory=dict)
    #: per model: GPU-seconds allocated, bytes pulled from registries and fetched from object stores (scored window)
    gpu_seconds_by_model: np.ndarray | None = None
    bytes_registry_by_model: np.ndarray | None = None
    bytes_object_store_by_model: np.ndarray | None = None
    #: with ``record_minutes``: (N, T) cold-start requests and (T,) GPU-seconds allocated per simulated minute
    cold_by_minute: np.ndarray | None = None
    gpu_seconds_by_minute: np.ndarray | None = None
    #: (R_scored,) simulated minute each scored request arrived in, aligned with ``waits``
    wait_minute: np.ndarray | None = None

    @property
    def wasted_gpu_seconds(self) -> float:
        return self.gpu_seconds - self.busy_gpu_seconds

    def summary(self) -> dict:
        """The headline figures: cold-start %, waits, SLO attainment, GPU-seconds, bytes, pulls."""
        active = self.requests > 0
        pct = np.where(active, self.cold_requests / np.maximum(self.requests, 1) * 100.0, np.nan)
        total = float(self.requests.sum())
        return {
            "requests": int(total),
            "cold_pct_overall": float(self.cold_requests.sum() / total * 100.0) if total else 0.0,
            "cold_pct_p75": float(np.nanpercentile(pct, 75)) if active.any() else 0.0,
            "wait_p50_s": float(np.percentile(self.waits, 50)) if len(self.waits) else 0.0,
            "wait_p99_s": float(np.percentile(self.waits, 99)) if len(self.waits) else 0.0,
            "wait_max_s": float(self.waits.max()) if len(self.waits) else 0.0,
            **(wait_tail(self.waits, self.wait_minute) if self.wait_minute is not None else {}),
            "slo_attainment": float((self.waits <= self.wait_slo_s).mean()) if len(self.waits) else 1.0,
            "gpu_seconds": self.gpu_seconds,
            "wasted_gpu_seconds": self.wasted_gpu_seconds,
            "bytes_registry": self.bytes_registry,
            "bytes_object_store": self.bytes_object_store,
            "peak_concurrent_pulls": self.peak_concurrent_pulls,
            "replica_starts": self.replica_starts,
            "gpu_unavailable": self.gpu_unavailable,
            "wall_s": self.wall_s,
        }


def wait_tail(waits: np.ndarray, minute: np.ndarray) -> dict:
    """How many minutes the 99th percentile wait rests on.

    A p99 over a few thousand requests is the wait of the ``1 %`` slowest; when one burst queues more requests than
    that, the p99 is that burst's drain time and says nothing about the rest of the run. Returns the share of the
    requests at or above the percentile that arrived in the single minute holding most of them
    (``wait_p99_top_minute_share``, 0 when no request waited) and the percentile with that minute's requests left
    out (``wait_p99_without_top_minute_s``).
    """
    if not len(waits):
        return {"wait_p99_top_minute_share": 0.0, "wait_p99_without_top_minute_s": 0.0}
    cut = float(np.percentile(waits, 99))
    tail = waits >= cut
    if cut <= 0.0:
        return {"wait_p99_top_minute_share": 0.0, "wait_p99_without_top_minute_s": cut}
    minutes, counts = np.unique(minute[tail], return_counts=True)
    top = minutes[np.argmax(counts)]
    rest = waits[minute != top]
    return {"wait_p99_top_minute_share": float(counts.max() / tail.sum()),
            "wait_p99_without_top_minute_s": float(np.percentile(rest, 99)) if len(rest) else 0.0}


# --------------------------------------------------------------------------- the view policies get


class SimView:
    """Read-only window on the simulator for policies (counts before ``minute`` only, by contract)."""

    def __init__(self, sim: "FleetSimulator"):
        self._sim = sim

    @property
    def now_s(self) -> float:
        return self._sim.now

    @property
    def start(self) -> pd.Timestamp:
        """UTC time of simulated second 0."""
        return self._sim.workload.start

    @property
    def minute(self) -> int:
        """Index of the current minute; ``counts[:, :minute]`` are complete."""
        return int(self._sim.now // 60)

    @property
    def counts(self) -> np.ndarray:
        return self._sim.workload.panel.counts

    @property
    def current_minute_arrivals(self) -> np.ndarray:
        return self._sim.minute_arrivals

    @property
    def last_arrival_s(self) -> np.ndarray:
        """Per model, the arrival time of its latest request so far (-inf before the first)."""
        return self._sim.last_arrival

    @property
    def burst_factor(self) -> np.ndarray:
        """Per model, the peak 10-second request rate over the minute's mean (smoothed over busy minutes; 1 = even)."""
        return self._sim.burst

    @property
    def ready(self) -> np.ndarray:
        return self._sim.ready

    @property
    def starting(self) -> np.ndarray:
        return self._sim.starting

    @property
    def queue(self) -> np.ndarray:
        return self._sim.queue

    @property
    def served_last_tick(self) -> np.ndarray:
        return self._sim.served_last

    @property
    def models(self) -> pd.DataFrame:
        return self._sim.models

    @property
    def config(self) -> FleetConfig:
        return self._sim.config

    def fleet_frames(self) -> dict[str, pd.DataFrame]:
        return self._sim.fleet_frames()

    def fleet_inputs(self) -> dict[str, pd.DataFrame]:
        return self._sim.fleet_inputs()


@dataclass
class Decision:
    """A policy's output: replicas wanted per model (None: unchanged) and actions to schedule."""

    floor: np.ndarray | None = None
    actions: tuple[Action, ...] = ()


# --------------------------------------------------------------------------- the simulator


class FleetSimulator:
    """Replays a workload against a fleet under one policy (see the module docstring).

    Args:
        workload: requests per model.
        models: per-model table (index aligned with ``workload.ids``): ``image_ref``,
            ``image_bytes``, ``weights_uri``, ``weights_bytes``, ``gpus``, ``replica_rps``,
            ``request_s``.
        policy: an object with ``name``, ``decide_every_s``, ``idle_grace_s``,
            ``reactive_overload`` and ``decide(view) -> Decision | None``
            (see :mod:`forecaster.simulation.policies`).
        config: fleet settings.
        progress: called with the fraction done about every 5%.
        record_minutes: also keep cold-start requests per model and minute and GPU-seconds per minute (the
            advisory report's time series; ``N x T`` floats, so off by default).
    """

    def __init__(self, workload: Workload, models: pd.DataFrame, policy, config: FleetConfig = FleetConfig(),
                 progress: Callable[[float], None] | None = None, record_minutes: bool = False):
        self.workload = workload
        self.models = models.loc[list(workload.ids)] if list(models.index) != list(workload.ids) else models
        self.policy = policy
        self.config = config
        self.progress = progress
        self.rng = np.random.default_rng(config.seed)
        n = workload.n_models
        m = self.models
        self.gpus = m["gpus"].to_numpy(dtype="float64")
        self.rps = m["replica_rps"].to_numpy(dtype="float64")
        self.image_bytes = m["image_bytes"].to_numpy(dtype="float64")
        self.weights_bytes = m["weights_bytes"].to_numpy(dtype="float64")
        self.image_ref = m["image_ref"].astype(str).to_numpy()
        self.weights_uri = m["weights_uri"].astype(str).to_numpy()
        self.registry = np.array([registry_of(r) for r in self.image_ref], dtype=object)
        self.bucket = np.array([registry_of(u.split("#")[0]) for u in self.weights_uri], dtype=object)
        # per-model serving state
        self.ready = np.zeros(n, dtype=np.int64)
        self.starting = np.zeros(n, dtype=np.int64)
        self.floor = np.zeros(n, dtype=np.int64)
        self.reactive_ask = np.zeros(n, dtype=np.int64)  # what the serving layer's reactive path wants now
        self.queue = np.zeros(n)
        self.cum_served = np.zeros(n)
        self.served_last = np.zeros(n)
        self.last_served_at = np.full(n, -1e18)
        self.minute_arrivals = np.zeros(n)
        self.last_arrival = np.full(n, -np.inf)
        self.burst = np.ones(n)  # see SimView.burst_factor
        self._bucket = np.zeros(n)
        self._minute_peak = np.zeros(n)
        self.replicas_of: dict[int, list[int]] = defaultdict(list)
        # nodes and caches
        k = config.n_nodes
        self.gpus_free = np.full(k, float(config.gpus_per_node))
        self.images: list[OrderedDict[str, float]] = [OrderedDict() for _ in range(k)]  # ref -> bytes (LRU order)
        self.weights: list[OrderedDict[int, list]] = [OrderedDict() for _ in range(k)]  # model -> [tier, pinned]
        self.disk_used = np.zeros(k)
        self.host_used = np.zeros(k)
        self.running_on: list[dict[int, int]] = [defaultdict(int) for _ in range(k)]  # model -> replicas on node
        self.state = np.zeros((k, n), dtype=np.int8)  # node_state() of every (node, model), kept up to date
        self.models_of_image = {ref: np.flatnonzero(self.image_ref == ref) for ref in np.unique(self.image_ref)}
        self._per_node: dict[int, int] = {}
        self._per_source: dict[str, int] = {}
        # events, transfers
        self.now = 0.0
        self._heap: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._rid = itertools.count()
        self._tid = itertools.count()
        self.replicas: dict[int, Replica] = {}
        self.transfers: dict[int, Transfer] = {}
        self._transfer_version = 0
        self._last_rate_update = 0.0
        self.in_flight: dict[tuple[int, str, str], int] = {}  # (node, kind, key) -> transfer id
        # accounting
        self.scored = lambda t: t >= config.score_from_s  # noqa: E731
        self.gpu_seconds = 0.0
        self.busy_gpu_seconds = 0.0
        self.bytes_registry = 0.0
        self.bytes_object_store = 0.0
        self.peak_pulls = 0
        self.replica_starts = 0
        self.gpu_unavailable = 0
        self.cold = np.zeros(n)
        self.requests = np.zeros(n)
        self.gpu_seconds_model = np.zeros(n)
        self.bytes_registry_model = np.zeros(n)
        self.bytes_object_store_model = np.zeros(n)
        n_minutes = int(math.ceil(workload.duration_s / 60.0))
        self.cold_minute = np.zeros((n, n_minutes), dtype=np.float32) if record_minutes else None
        self.gpu_minute = np.zeros(n_minutes) if record_minutes else None
        self._backlog: list[tuple[float, np.ndarray, np.ndarray, np.ndarray]] = []
        self.events: list[dict] = []
        self.view = SimView(self)

    # ------------------------------------------------------------------ heap
    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, payload))

    def schedule(self, action: Action, at_s: float) -> None:
        """Carry out a planned action at ``at_s`` seconds (its ``not_before``)."""
        self._push(max(at_s, self.now), "action", action)

    # ------------------------------------------------------------------ caches
    def node_state(self, node: int, model: int) -> int:
        """0 none, 1 image, 2 weights on disk, 3 weights in host memory."""
        return int(self.state[node, model])

    def _refresh_state(self, node: int, models) -> None:
        """Recompute :meth:`node_state` after a cache change (weights without the image count as cold)."""
        for model in np.atleast_1d(models):
            model = int(model)
            if self.image_ref[model] not in self.images[node]:
                self.state[node, model] = 0
                continue
            entry = self.weights[node].get(model)
            self.state[node, model] = 1 if entry is None else (3 if entry[0] == "host" else 2)

    def _touch(self, node: int, model: int) -> None:
        if self.image_ref[model] in self.images[node]:
            self.images[node].move_to_end(self.image_ref[model])
        if model in self.weights[node]:
            self.weights[node].move_to_end(model)

    def _make_room(self, node: int, disk: float = 0.0, host: float = 0.0) -> bool:
        """Evict least recently used entries not in use on ``node`` until ``disk``/``host`` bytes fit."""
        cfg = self.config
        if host > 0:
            for model in list(self.weights[node]):
                if self.host_used[node] + host <= cfg.host_bytes:
                    break
                tier, _ = self.weights[node][model]
                if tier == "host" and not self.running_on[node].get(model):
                    self.weights[node][model][0] = "disk"
                    self.host_used[node] -= self.weights_bytes[model]
                    self._refresh_state(node, model)
            if self.host_used[node] + host > cfg.host_bytes:
                return False
        if disk > 0:
            for model in list(self.weights[node]):
                if self.disk_used[node] + disk <= cfg.disk_bytes:
                    break
                if not self.running_on[node].get(model):
                    self._drop_weights(node, model)
            for ref in list(self.images[node]):
                if self.disk_used[node] + disk <= cfg.disk_bytes:
                    break
                in_use = any(self.image_ref[m] == ref and c for m, c in self.running_on[node].items())
                if not in_use:
                    self.disk_used[node] -= self.images[node].pop(ref)
                    self.state[node, self.models_of_image[ref]] = 0
            if self.disk_used[node] + disk > cfg.disk_bytes:
                return False
        return True

    def _drop_weights(self, node: int, model: int) -> None:
        entry = self.weights[node].pop(model, None)
        if entry is None:
            return
        self.disk_used[node] -= self.weights_bytes[model]
        if entry[0] == "host":
            self.host_used[node] -= self.weights_bytes[model]
        self._refresh_state(node, model)

    def _add_image(self, node: int, model: int) -> None:
        ref = self.image_ref[model]
        if ref not in self.images[node]:
            self._make_room(node, disk=self.image_bytes[model])
            self.images[node][ref] = self.image_bytes[model]
            self.disk_used[node] += self.image_bytes[model]
            rows = self.models_of_image[ref]
            with_weights = [m for m in rows if m in self.weights[node]]
            self.state[node, rows] = np.maximum(self.state[node, rows], 1)
            if with_weights:
                self._refresh_state(node, with_weights)

    def _add_weights(self, node: int, model: int, tier: str, pinned: bool) -> None:
        entry = self.weights[node].get(model)
        size = self.weights_bytes[model]
        if entry is None:
            self._make_room(node, disk=size)
            self.weights[node][model] = ["disk", pinned]
            self.disk_used[node] += size
            entry = self.weights[node][model]
        entry[1] = entry[1] or pinned
        if tier == "host" and entry[0] != "host" and self._make_room(node, host=size):
            entry[0] = "host"
            self.host_used[node] += size
        self._refresh_state(node, model)

    def warm_cache(self, node: int, model: int, state: str) -> None:
        """Seed a node's cache before the run: ``image``, ``disk`` or ``host`` (pinned, like a pre-load)."""
        self._add_image(node, model)
        if state in ("disk", "host"):
            self._add_weights(node, model, state, pinned=True)

    # ------------------------------------------------------------------ transfers
    def _hour_at(self, seconds: float) -> int:
        """Hour of day of ``workload.start + seconds`` (as ``Timestamp.hour``), from the start's offset into its day:
        a pandas Timestamp + Timedelta per transfer event and replica start cost more than the bookkeeping around it."""
        start_s = getattr(self, "_start_of_day_s", None)
        if start_s is None:
            start = self.workload.start
            start_s = self._start_of_day_s = (start - start.normalize()).total_seconds()
        return int((start_s + seconds) // 3600.0) % 24

    def _transfer_rate_factor(self) -> float:
        lo, hi = self.config.peak_hours_utc
        hour = self._hour_at(self.now)
        return 1.0 / self.config.peak_slowdown if lo <= hour < hi else 1.0

    def _settle_transfers(self) -> None:
        """Advance every running transfer to ``now`` at its current rate."""
        elapsed = self.now - self._last_rate_update
        if elapsed > 0:
            for t in self.transfers.values():
                t.left = max(0.0, t.left - t.rate * elapsed)
            self._last_rate_update = self.now

    def _recompute_rates(self) -> None:
        """Processor sharing of NICs, registries, buckets and local disks; schedule the next completion."""
        cfg = self.config
        per_node = defaultdict(int)
        per_source = defaultdict(int)
        local = defaultdict(int)
        for t in self.transfers.values():
            if t.source is None:
                local[t.node] += 1
            else:
                per_node[t.node] += 1
                per_source[t.source] += 1
        factor = self._transfer_rate_factor()
        for t in self.transfers.values():
            if t.source is None:
                t.rate = cfg.disk_read_bytes_per_s / local[t.node]
                continue
            source_bw = (cfg.registry_bytes_per_s if t.kind == "image" else cfg.bucket_bytes_per_s) * factor
            cap = cfg.image_pull_bytes_per_s if t.kind == "image" else cfg.weight_fetch_bytes_per_s
            t.rate = min(cap * factor, cfg.node_nic_bytes_per_s / per_node[t.node], source_bw / per_source[t.source])
        self.peak_pulls = max(self.peak_pulls, sum(per_node.values()))
        self._per_node, self._per_source = dict(per_node), dict(per_source)
        self._transfer_version += 1
        if self.transfers:
            soonest = min(self.now + t.left / max(t.rate, 1e-9) for t in self.transfers.values())
            self._push(soonest, "transfers", self._transfer_version)

    def _start_transfer(self, node: int, kind: str, model: int, *, target_tier: str = "disk",
                        pinned: bool = False) -> Transfer:
        key = self.image_ref[model] if kind == "image" else str(model)
        existing = self.in_flight.get((node, kind, key))
        if existing is not None:
            t = self.transfers[existing]
            t.pinned = t.pinned or pinned
            if target_tier == "host":
                t.target_tier = "host"
            return t
        self._settle_transfers()
        if kind == "image":
            source, size = self.registry[model], self.image_bytes[model]
            if self.scored(self.now):
                self.bytes_registry += size
                self.bytes_registry_model[model] += size
        elif kind == "weights":
            source, size = self.bucket[model], self.weights_bytes[model]
            if self.scored(self.now):
                self.bytes_object_store += size
                self.bytes_object_store_model[model] += size
        else:
            source, size = None, self.weights_bytes[model]
        t = Transfer(tid=next(self._tid), node=node, kind=kind, key=key, source=source, total=size, left=size,
                     started_at=self.now, model=model, target_tier=target_tier, pinned=pinned)
        self.transfers[t.tid] = t
        self.in_flight[(node, kind, key)] = t.tid
        self._recompute_rates()
        return t

    def _on_transfers(self, version: int) -> None:
        if version != self._transfer_version:
            return
        self._settle_transfers()
        done = [t for t in self.transfers.values() if t.left <= 1e-6 * max(t.total, 1.0)]
        for t in done:
            del self.transfers[t.tid]
            del self.in_flight[(t.node, t.kind, t.key)]
        for t in done:
            self._finish_transfer(t)
        self._recompute_rates()

    def _finish_transfer(self, t: Transfer) -> None:
        if t.kind == "image":
            self._add_image(t.node, t.model)
        elif t.kind == "weights":
            self._add_weights(t.node, t.model, "disk", t.pinned)
            if t.target_tier == "host":
                self._start_transfer(t.node, "copy", t.model, target_tier="host", pinned=t.pinned)
        else:
            self._add_weights(t.node, t.model, "host", t.pinned)
        for rid in t.waiters:
            replica = self.replicas.get(rid)
            if replica is not None and not replica.cancelled and replica.waiting_on == t.tid:
                replica.waiting_on = None
                self._advance_replica(replica)

    # ------------------------------------------------------------------ replicas
    def _noisy(self, seconds: float) -> float:
        sigma = self.config.phase_noise_sigma
        return float(seconds * math.exp(self.rng.normal(0.0, sigma) - sigma * sigma / 2)) if sigma > 0 else seconds

    def _place(self, model: int) -> int | None:
        room = np.flatnonzero(self.gpus_free >= self.gpus[model])
        if not len(room):
            return None
        warmth = self.state[room, model]
        best = np.lexsort((-self.gpus_free[room], -warmth))[0]
        return int(room[best])

    def start_replica(self, model: int) -> bool:
        node = self._place(model)
        if node is None:
            if self.scored(self.now):
                self.gpu_unavailable += 1
            return False
        self.gpus_free[node] -= self.gpus[model]
        state = self.node_state(node, model)
        network = self._per_node.get(node, 0)
        registry_pulls = self._per_source.get(self.registry[model], 0)
        r = Replica(rid=next(self._rid), model=model, node=node, started_at=self.now, cache_state=STATE_NAMES[state],
                    contention=network, registry_pulls=registry_pulls, phase="image", phase_started=self.now)
        self.replicas[r.rid] = r
        self.replicas_of[model].append(r.rid)
        self.running_on[node][model] += 1
        self.starting[model] += 1
        self.replica_starts += 1
        self._touch(node, model)
        self._advance_replica(r)
        return True

    def _enter(self, r: Replica, phase: str) -> None:
        r.phases[r.phase] = r.phases.get(r.phase, 0.0) + (self.now - r.phase_started)
        r.phase = phase
        r.phase_started = self.now

    def _advance_replica(self, r: Replica) -> None:
        """Move a starting replica through its phases as far as it can go now."""
        cfg = self.config
        m, node = r.model, r.node
        if r.phase == "image":
            if self.image_ref[m] not in self.images[node]:
                t = self._start_transfer(node, "image", m)
                t.waiters.append(r.rid)
                r.waiting_on = t.tid
                return
            self._enter(r, "fetch")
        if r.phase == "fetch":
            if m not in self.weights[node]:
                t = self._start_transfer(node, "weights", m)
                t.waiters.append(r.rid)
                r.waiting_on = t.tid
                return
            self._enter(r, "load")
            tier = self.weights[node][m][0]
            bw = cfg.host_to_gpu_bytes_per_s if tier == "host" else cfg.disk_read_bytes_per_s
            self._push(self.now + self._noisy(self.weights_bytes[m] / bw), "phase", r.rid)
            return
        if r.phase == "load":
            self._enter(r, "init")
            self._push(self.now + self._noisy(cfg.runtime_init_s), "phase", r.rid)
            return
        if r.phase == "init":
            self._enter(r, "register")
            self._push(self.now + self._noisy(cfg.registration_s), "phase", r.rid)
            return
        if r.phase == "register":
            self._enter(r, "ready")
            r.ready_at = self.now
            self.starting[m] -= 1
            self.ready[m] += 1
            self._record_event(r)

    def _record_event(self, r: Replica) -> None:
        p = r.phases
        self.events.append({
            "model_id": str(self.workload.ids[r.model]), "node_id": f"node-{r.node}",
            "started_s": r.started_at, "total_seconds": r.ready_at - r.started_at,
            "image_pull_s": p.get("image", 0.0), "weight_fetch_s": p.get("fetch", 0.0),
            "weight_load_s": p.get("load", 0.0), "runtime_init_s": p.get("init", 0.0),
            "registration_s": p.get("register", 0.0), "cache_state": r.cache_state,
            "concurrent_node_transfers": r.contention, "concurrent_registry_pulls": r.registry_pulls,
            "image_bytes": self.image_bytes[r.model], "weights_bytes": self.weights_bytes[r.model],
            "hour": self._hour_at(r.started_at),
        })

    def stop_replica(self, model: int) -> bool:
        """Release one replica of ``model``: a starting one first, else a ready one."""
        rids = self.replicas_of[model]
        if not rids:
            return False
        chosen = None
        for rid in reversed(rids):
            if self.replicas[rid].ready_at is None:
                chosen = rid
                break
        chosen = rids[-1] if chosen is None else chosen
        r = self.replicas.pop(chosen)
        rids.remove(chosen)
        r.cancelled = True
        if r.ready_at is None:
            self.starting[model] -= 1
        else:
            self.ready[model] -= 1
        self.gpus_free[r.node] += self.gpus[model]
        self.running_on[r.node][model] -= 1
        if self.running_on[r.node][model] <= 0:
            del self.running_on[r.node][model]
            entry = self.weights[r.node].get(model)
            if entry is not None and not entry[1] and not self.config.keep_weights_after_release:
                self._drop_weights(r.node, model)
        return True

    # ------------------------------------------------------------------ actions
    def model_index(self, model_id: str) -> int | None:
        return self._model_index.get(model_id)

    def apply_action(self, action: Action, replicas: int | None = None) -> str | None:
        """Carry out one action now; ``replicas`` is the actuator's bounded absolute target for scale/release.

        Returns None when done, else why not (``unknown_model``, ``unknown_node``).
        """
        index = self._model_index.get(action.model_id)
        if index is None:
            return "unknown_model"
        if action.kind is ActionKind.SCALE:
            self.floor[index] = int(action.replicas or 0) if replicas is None else int(replicas)
        elif action.kind is ActionKind.RELEASE:
            if replicas is None:
                current = self.ready[index] + self.starting[index]
                replicas = max(0, int(current) - int(action.replicas or 0))
            self.floor[index] = int(replicas)
        elif action.kind in (ActionKind.PREPULL, ActionKind.PRELOAD):
            node = self._node_index.get(action.node_id or "")
            if node is None:
                return "unknown_node"
            if action.kind is ActionKind.PREPULL:
                if self.image_ref[index] not in self.images[node]:
                    self._start_transfer(node, "image", index, pinned=True)
                else:
                    self.images[node].move_to_end(self.image_ref[index])
                return None
            tier = "host" if action.tier in (Tier.HOST, Tier.GPU) else "disk"
            entry = self.weights[node].get(index)
            if entry is None:
                self._start_transfer(node, "weights", index, target_tier=tier, pinned=True)
            elif tier == "host" and entry[0] != "host":
                entry[1] = True
                self._start_transfer(node, "copy", index, target_tier="host", pinned=True)
            else:
                entry[1] = True
                self.weights[node].move_to_end(index)
        return None

    # ------------------------------------------------------------------ fleet snapshot
    def fleet_inputs(self) -> dict[str, pd.DataFrame]:
        """The simulated cluster as :func:`~forecaster.contracts.fleet.build_fleet` takes it (what the store gives
        the plan job): nodes, the artefacts each node holds (``node_id, kind, ref, tier``) and running transfers
        (``ends_at_s`` in simulated seconds)."""
        # built from the caches directly (no weights-cache frame, no frame walked row by row): every replayed
        # minute of a planner policy asks for this
        node_ids = self._node_ids()
        k_range = range(self.config.n_nodes)
        images = [(node_ids[k], "image", ref, "image") for k in k_range for ref in self.images[k]]
        weights = [(node_ids[k], "weights", self.weights_uri[m], entry[0]) for k in k_range
                   for m, entry in self.weights[k].items()]
        artefacts = pd.DataFrame(images + weights, columns=["node_id", "kind", "ref", "tier"])
        return {"nodes": self._nodes_frame(node_ids), "artefacts": artefacts,
                "transfers": self._transfers_frame(node_ids)}

    def fleet_frames(self) -> dict[str, pd.DataFrame]:
        """Nodes, weights cache, images and running transfers as planner input frames."""
        node_ids = self._node_ids()
        rows = [(node_ids[k], str(self.workload.ids[m]), entry[0]) for k in range(self.config.n_nodes)
                for m, entry in self.weights[k].items() if self.image_ref[m] in self.images[k]]
        cache = pd.DataFrame(rows, columns=["node_id", "model_id", "state"])
        images = pd.DataFrame([(node_ids[k], ref) for k in range(self.config.n_nodes) for ref in self.images[k]],
                              columns=["node_id", "image_ref"])
        return {"nodes": self._nodes_frame(node_ids), "cache": cache, "images": images,
                "transfers": self._transfers_frame(node_ids)}

    def _node_ids(self) -> list[str]:
        if len(getattr(self, "_node_id_list", ())) != self.config.n_nodes:
            self._node_id_list = [f"node-{k}" for k in range(self.config.n_nodes)]
        return self._node_id_list

    def _nodes_frame(self, node_ids: list[str]) -> pd.DataFrame:
        return pd.DataFrame({"gpus_free": self.gpus_free,
                             "host_free_bytes": self.config.host_bytes - self.host_used,
                             "disk_free_bytes": self.config.disk_bytes - self.disk_used},
                            index=pd.Index(node_ids, name="node_id"))

    def _transfers_frame(self, node_ids: list[str]) -> pd.DataFrame:
        return pd.DataFrame(
            [(node_ids[t.node], t.source or "-", str(self.workload.ids[t.model]),
              "prepull" if t.kind == "image" else "preload", t.left / max(t.rate, 1e-9) + self.now)
             for t in self.transfers.values()],
            columns=["node_id", "registry", "model_id", "kind", "ends_at_s"])

    # ------------------------------------------------------------------ the run
    def run(self) -> SimResult:
        """Replay the whole workload and return what was measured (:meth:`begin`, :meth:`advance`, :meth:`result`)."""
        self.begin()
        self.advance(self.workload.duration_s)
        return self.result()

    def begin(self) -> None:
        """Prepare a run: index models and nodes, bin the arrivals by tick, bind the policy (once)."""
        if getattr(self, "_tick", None) is not None:
            return
        cfg = self.config
        wl = self.workload
        dt = cfg.tick_s
        self._n_ticks = int(math.ceil(wl.duration_s / dt))
        self._model_index = {str(mid): i for i, mid in enumerate(wl.ids)}
        self._node_index = {f"node-{k}": k for k in range(cfg.n_nodes)}
        self._started = time.perf_counter()
        tick_of = np.floor(wl.times / dt).astype(np.int64)
        self._bounds = np.searchsorted(tick_of, np.arange(self._n_ticks + 1))
        bind = getattr(self.policy, "bind", None)
        if bind is not None:  # policies that act through an actuator get the simulated cluster behind it
            bind(self)
        self._rate = np.zeros(wl.n_models)
        self._next_report = 0.05
        self._tick = 0

    def advance(self, until_s: float) -> None:
        """Run every tick that starts before ``until_s`` simulated seconds (resumable: the next call goes on).

        Afterwards ``now`` is the start of the next tick to run (``until_s`` when it is a whole tick), so an
        action applied between two calls takes effect at that moment, as one arriving from outside would.
        """
        self.begin()
        cfg = self.config
        wl = self.workload
        n = wl.n_models
        dt = cfg.tick_s
        n_ticks = self._n_ticks
        bounds = self._bounds
        decide_every = max(1, int(round(self.policy.decide_every_s / dt)))
        grace = float(getattr(self.policy, "idle_grace_s", 0.0))
        overload = bool(getattr(self.policy, "reactive_overload", True))
        rate = self._rate
        decay = math.exp(-dt / RATE_TAU_S)
        next_report = self._next_report
        last = min(n_ticks, int(math.ceil(until_s / dt - 1e-9)))
        # per-tick constants: the loop runs once a simulated second, so every array operation saved counts (a
        # tick of 100 models is ~100 small numpy calls); each shortcut below gives the same numbers as the plain
        # form it replaces (adding an all-zero arrivals vector changes nothing, so a tick without arrivals skips it)
        bucket_every = max(1, int(round(BURST_BUCKET_S / dt)))
        minute_every = int(round(60 / dt))
        score_from_s = cfg.score_from_s
        no_arrivals = np.zeros(n)
        no_replicas = np.zeros(n, dtype=np.int64)
        for tick in range(self._tick, last):
            now = tick * dt
            self.now = now
            if tick > 0 and tick % bucket_every == 0:
                self._minute_peak = np.maximum(self._minute_peak, self._bucket)
                self._bucket[:] = 0.0
            if tick > 0 and tick % minute_every == 0:
                self.burst = update_burst_factor(self.burst, self.minute_arrivals, self._minute_peak)
                self._minute_peak[:] = 0.0
                self.minute_arrivals[:] = 0.0
            while self._heap and self._heap[0][0] <= now + 1e-9:
                at, _, kind, payload = heapq.heappop(self._heap)
                self.now = max(at, now - dt)
                if kind == "phase":
                    r = self.replicas.get(payload)
                    if r is not None and not r.cancelled:
                        self._advance_replica(r)
                elif kind == "transfers":
                    self._on_transfers(payload)
                elif kind == "action":
                    self.apply_action(payload)
                self.now = now
            # arrivals
            lo, hi = bounds[tick], bounds[tick + 1]
            arrived = hi > lo
            if arrived:
                arrivals = np.bincount(wl.model[lo:hi], minlength=n).astype("float64")
                self.minute_arrivals += arrivals
                self._bucket += arrivals
                np.maximum.at(self.last_arrival, wl.model[lo:hi], wl.times[lo:hi])
            else:
                arrivals = no_arrivals  # never written to
            # policy
            if tick % decide_every == 0:
                decision = self.policy.decide(self.view)
                if decision is not None:
                    if decision.floor is not None:
                        self.floor = np.asarray(decision.floor, dtype=np.int64).copy()
                    for action in decision.actions:
                        offset = (pd.Timestamp(action.not_before) - wl.start).total_seconds()
                        if offset <= now + 1e-9:
                            self.apply_action(action)
                        else:
                            self.schedule(action, offset)
            # reactive path: a request with nothing starting starts a replica; sustained overload adds more
            queued = self.queue + arrivals
            total = self.ready + self.starting
            rate = rate * decay + arrivals / RATE_TAU_S  # requests per second, ~10 s memory
            waiting = queued > 0
            lonely = waiting & (total == 0)  # requests and no replica at all
            need = np.maximum(self.floor, lonely)
            if overload:
                in_use = np.where(rate * RATE_TAU_S >= 0.5, np.ceil(rate / self.rps - 1e-9), 0).astype(np.int64)
                over = waiting & (queued > self.ready * self.rps * dt)
                need = np.where(over, np.maximum(need, in_use), need)
                self.reactive_ask = np.maximum(in_use, lonely)
            else:
                in_use = no_replicas
                self.reactive_ask = lonely.astype(np.int64)
            for m in np.flatnonzero(need > total):
                for _ in range(int(need[m] - total[m])):
                    if not self.start_replica(int(m)):
                        break
            # scale down: above the floor and what recent traffic uses, nothing queued; the policy's grace keeps
            # a model's last replica that long after it served (an on-demand start waits for the next plan), as
            # Knative's scale-to-zero grace does: replicas beyond it stop as soon as they are surplus
            keep = np.maximum(self.floor, in_use)
            if grace > 0:
                keep = np.where(now - self.last_served_at < grace, np.maximum(keep, 1), keep)
            surplus = (self.ready + self.starting) - keep
            idle = queued <= 0
            for m in np.flatnonzero((surplus > 0) & idle):
                for _ in range(int(surplus[m])):
                    self.stop_replica(int(m))
            # serve
            before = self.queue
            capacity = self.ready * self.rps * dt
            served = np.minimum(queued, capacity)
            self.queue = queued - served
            backlog = (self.queue > 1e-9) | (before > 1e-9)
            if backlog.any():
                idx = np.flatnonzero(backlog)
                self._backlog.append((now, idx, self.cum_served[idx].copy(), served[idx].copy()))
            self.cum_served += served
            self.served_last = served
            self.last_served_at = np.where(served > 0, now, self.last_served_at)
            if now >= score_from_s:
                minute = int(now // 60)
                if arrived:
                    self.requests += arrivals
                    cold = np.where(self.ready == 0, arrivals, 0.0)
                    self.cold += cold
                    if self.cold_minute is not None:
                        self.cold_minute[:, minute] += cold
                held = (self.ready + self.starting) * self.gpus
                held_gpu_s = float(held.sum()) * dt
                self.gpu_seconds += held_gpu_s
                self.gpu_seconds_model += held * dt
                self.busy_gpu_seconds += float((served * self.gpus / self.rps).sum())
                if self.gpu_minute is not None:
                    self.gpu_minute[minute] += held_gpu_s
            if self.progress is not None and (tick + 1) / n_ticks >= next_report:
                self.progress((tick + 1) / n_ticks)
                next_report += 0.05
        self._tick = max(self._tick, last)
        self._rate = rate
        self._next_report = next_report
        self.now = self._tick * dt

    def result(self) -> SimResult:
        """What was measured up to ``now`` (the whole run after :meth:`run`; a snapshot between advances, where a
        request still queued counts its wait so far and one not yet arrived counts nothing)."""
        waits, wait_model, wait_minute = self._waits()
        wl = self.workload
        events = pd.DataFrame(self.events)
        return SimResult(policy=self.policy.name, model_ids=wl.ids, requests=self.requests.copy(),
                         cold_requests=self.cold.copy(), waits=waits, wait_model=wait_model,
                         gpu_seconds=self.gpu_seconds, busy_gpu_seconds=self.busy_gpu_seconds,
                         bytes_registry=self.bytes_registry, bytes_object_store=self.bytes_object_store,
                         peak_concurrent_pulls=self.peak_pulls, replica_starts=self.replica_starts,
                         gpu_unavailable=self.gpu_unavailable, events=events,
                         wall_s=time.perf_counter() - self._started, wait_slo_s=self.config.wait_slo_s,
                         gpu_seconds_by_model=self.gpu_seconds_model.copy(),
                         bytes_registry_by_model=self.bytes_registry_model.copy(),
                         bytes_object_store_by_model=self.bytes_object_store_model.copy(),
                         cold_by_minute=None if self.cold_minute is None else self.cold_minute.copy(),
                         gpu_seconds_by_minute=None if self.gpu_minute is None else self.gpu_minute.copy(),
                         wait_minute=wait_minute)

    def _waits(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per scored request, seconds from arrival to service start (FIFO per model, fluid within a tick), its
        model and the simulated minute it arrived in."""
        wl = self.workload
        dt = self.config.tick_s
        n = wl.n_models
        # k-th request of its model (1-based), in arrival order
        order = np.lexsort((wl.times, wl.model))
        model_sorted = wl.model[order]
        counts = np.bincount(model_sorted, minlength=n)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        k_sorted = np.arange(len(order)) - first[model_sorted] + 1
        k = np.empty(len(order), dtype=np.int64)
        k[order] = k_sorted
        start = wl.times.copy()  # served on arrival unless a backlog record says otherwise
        if self._backlog:
            tick_t = np.concatenate([np.full(len(i), t) for t, i, _, _ in self._backlog])
            rec_model = np.concatenate([i for _, i, _, _ in self._backlog])
            rec_before = np.concatenate([b for _, _, b, _ in self._backlog])
            rec_served = np.concatenate([s for _, _, _, s in self._backlog])
            keep = rec_served > 0
            tick_t, rec_model, rec_before, rec_served = tick_t[keep], rec_model[keep], rec_before[keep], \
                rec_served[keep]
            rec_after = rec_before + rec_served
            # records sorted by (model, cumulative served): find the first record whose range covers k
            big = float(len(wl.times) + 10)
            rec_key = rec_model * big + rec_after
            sort = np.argsort(rec_key, kind="stable")
            rec_key, tick_t, rec_model, rec_before, rec_served = (rec_key[sort], tick_t[sort], rec_model[sort],
                                                                  rec_before[sort], rec_served[sort])
            req_key = wl.model * big + k - 1e-9
            pos = np.searchsorted(rec_key, req_key, side="left")
            ok = pos < len(rec_key)
            pos_ok = np.minimum(pos, len(rec_key) - 1)
            covers = ok & (rec_model[pos_ok] == wl.model) & (rec_before[pos_ok] < k - 1e-9)
            frac = (k - rec_before[pos_ok]) / np.maximum(rec_served[pos_ok], 1e-12)
            service = tick_t[pos_ok] + np.clip(frac, 0.0, 1.0) * dt
            start = np.where(covers, np.maximum(service, wl.times), start)
        # never served: still queued at the end
        unserved = k > np.floor(self.cum_served[wl.model] + 1e-9)
        start = np.where(unserved, np.maximum(self.now, wl.times), start)
        waits = np.maximum(start - wl.times, 0.0)
        scored = wl.times >= self.config.score_from_s
        return waits[scored], wl.model[scored], (wl.times[scored] // 60).astype(np.int64)
