"""The node agent's logic, without HTTP: pre-pull images, pre-load weights, report state, evict.

Every request is idempotent (an image already present or weights already
cached and unchanged in S3 since is a no-op that says so), has a deadline, and fails with a reason from
:class:`~forecaster.contracts.actions.FailureReason`. Requests for the same image,
or the same weights, while one is in flight join it instead of starting a
second transfer; a later joiner's deadline extends the transfer's. At most
``max_concurrent_pulls`` pulls and ``max_concurrent_preloads`` pre-loads run at
once on the node; the rest wait for a slot within their deadline.

Each transfer actually performed is kept as an observation (kind, ref, tier,
bytes, phase timings: ``image_pull_s``, ``weight_fetch_s``, ``weight_load_s``)
in a bounded buffer and returned in the result, which is how the actuator
feeds them back to the ``transfers`` table (never to ``cold_starts``: no
replica waited on them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import logging
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psutil

from forecaster.agent.cache import WeightsCache, entry_key
from forecaster.agent.cri import CriImageService, registry_auth
from forecaster.agent.errors import AgentError
from forecaster.agent.weights import S3WeightsSource, classify_s3_error
from forecaster.contracts.actions import FailureReason, Tier

log = logging.getLogger(__name__)

OBSERVATIONS_KEPT = 1000


@dataclass
class WorkResult:
    """The answer to one pre-pull or pre-load request."""

    kind: str  # prepull | preload
    ref: str  # image reference or weights URI
    status: str  # succeeded | failed
    node: str
    reason: str | None = None
    message: str = ""
    temporary: bool = False
    already_present: bool = False  # nothing had to be transferred
    deduplicated: bool = False  # joined a transfer another request started
    tier: str | None = None
    size_bytes: int | None = None
    timings: dict = field(default_factory=dict)  # seconds per phase
    detail: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Unit:
    key: str
    kind: str
    ref: str
    started: float  # monotonic
    deadline: float  # monotonic, extended by joiners
    future: Future = field(default_factory=Future)
    waiters: int = 1
    bytes_done: int = 0
    bytes_total: int | None = None
    phase: str = "queued"


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    for name in ("munmap", "mlock", "munlock"):
        getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_MAP_FAILED = ctypes.c_void_p(-1).value


class _HostPin:
    """Weights kept in host memory: the file's page cache, mapped and locked (``mlock``), or at least read in.

    The mapping is shared and read-only (``PROT_READ``, ``MAP_SHARED``): its pages *are* the file's page cache,
    the pages a replica reads when it loads the weights. Python's ``mmap`` gives a ctypes address only for a
    writable mapping, and locking a private writable one (``ACCESS_COPY``) makes the kernel fault every page in
    for write, so it locked an anonymous copy of the file in the agent's own memory (counted against its cgroup)
    and left the page cache evictable. Hence the mapping through libc.
    """

    def __init__(self, path: Path, size: int) -> None:
        self.size = size
        self.mode = "page_cache"
        self._address: int | None = None
        self._locked = False
        if size == 0:
            return
        self._libc = libc = _libc()
        with open(path, "rb") as handle:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, handle.fileno(), 0)
        if address in (None, _MAP_FAILED):
            errno = ctypes.get_errno()
            raise OSError(errno, f"mmap {path}: {os.strerror(errno)}")
        self._address = address
        if libc.mlock(address, size) == 0:
            self._locked = True
            self.mode = "pinned"
        else:
            # Not allowed to lock (RLIMIT_MEMLOCK without CAP_IPC_LOCK): read it through once so that it sits
            # in page cache, and ask the kernel to keep it there.
            libc.madvise(address, size, mmap.MADV_WILLNEED)
            for offset in range(0, size, mmap.PAGESIZE * 256):
                ctypes.c_char.from_address(address + offset).value

    def release(self) -> None:
        if self._address is None:
            return
        if self._locked:
            self._libc.munlock(self._address, self.size)
        self._libc.munmap(self._address, self.size)
        self._address = None


class NodeAgent:
    """One node's agent.

    Args:
        node_name: the node id reported in results and observations.
        cache: the weights cache.
        cri: the container runtime's image service, or a factory (None: pre-pull is unavailable).
        s3: the weights source (None: pre-load is unavailable).
        registry_auth_file: Docker config JSON with registry credentials.
        max_concurrent_pulls, max_concurrent_preloads: per-node limits.
        host_max_bytes: budget of weights held in host memory (tier ``host``).
        default_deadline_s: deadline of a request that names none.
        clock: wall-clock time for observations (UTC).
    """

    def __init__(self, *, node_name: str, cache: WeightsCache,
                 cri: CriImageService | Callable[[], CriImageService] | None, s3: S3WeightsSource | None,
                 registry_auth_file: Path | None = None, max_concurrent_pulls: int = 2,
                 max_concurrent_preloads: int = 2, host_max_bytes: int = 16 << 30,
                 default_deadline_s: float = 600.0,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.node_name = node_name
        self.cache = cache
        self._cri_source = cri
        self._cri: CriImageService | None = None
        self.s3 = s3
        self.registry_auth_file = registry_auth_file
        self.max_concurrent_pulls = max_concurrent_pulls
        self.max_concurrent_preloads = max_concurrent_preloads
        self.host_max_bytes = host_max_bytes
        self.default_deadline_s = default_deadline_s
        self.clock = clock
        self._slots = {"prepull": threading.BoundedSemaphore(max_concurrent_pulls),
                       "preload": threading.BoundedSemaphore(max_concurrent_preloads)}
        self._lock = threading.Lock()
        self._inflight: dict[str, _Unit] = {}
        self._executor = ThreadPoolExecutor(max_workers=2 * (max_concurrent_pulls + max_concurrent_preloads) + 4,
                                            thread_name_prefix="agent-work")
        self._host: dict[str, _HostPin] = {}  # entry key -> pin
        self._gpu: dict[str, tuple[object, str, int]] = {}  # entry key -> (tensor, device, bytes)
        self._observations: deque[dict] = deque(maxlen=OBSERVATIONS_KEPT)
        self._uri_locks: dict[str, list] = {}  # uri -> [lock, holders and waiters]
        self._seq = itertools.count(1)

    @classmethod
    def from_settings(cls, settings) -> "NodeAgent":
        """Build the agent from :class:`~forecaster.settings.Settings` (``agent_*``)."""
        import socket

        cache = WeightsCache(settings.weights_cache_dir, max_bytes=settings.agent_cache_max_bytes,
                             reserve_bytes=settings.agent_disk_reserve_bytes)
        secret = settings.agent_s3_secret_access_key
        s3 = S3WeightsSource(endpoint_url=settings.agent_s3_endpoint_url, region=settings.agent_s3_region,
                             access_key_id=settings.agent_s3_access_key_id,
                             secret_access_key=None if secret is None else secret.get_secret_value(),
                             streams=settings.agent_preload_streams, part_bytes=settings.agent_preload_part_bytes,
                             buffer_bytes=settings.agent_preload_buffer_bytes)
        socket_path = settings.agent_containerd_socket
        return cls(node_name=settings.agent_node_name or socket.gethostname(), cache=cache,
                   cri=lambda: CriImageService(socket_path), s3=s3,
                   registry_auth_file=settings.agent_registry_auth_file,
                   max_concurrent_pulls=settings.agent_max_concurrent_pulls,
                   max_concurrent_preloads=settings.agent_max_concurrent_preloads,
                   host_max_bytes=settings.agent_host_max_bytes,
                   default_deadline_s=settings.agent_default_deadline_s)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for pin in self._host.values():
            pin.release()
        self._host.clear()
        if self._gpu:
            self._gpu.clear()
            _return_gpu_memory()
        if self._cri is not None:
            self._cri.close()

    # --- public operations -----------------------------------------------------------------------------------

    def prepull(self, image: str, *, deadline_s: float | None = None, model_id: str | None = None) -> WorkResult:
        """Pull ``image`` into the runtime through CRI ``PullImage`` unless it is already there."""
        image = image.strip()
        return self._submit(f"prepull:{image}", "prepull", image, deadline_s,
                            lambda unit: self._do_prepull(unit, image, model_id))

    def preload(self, uri: str, *, tier: Tier | str = Tier.DISK, deadline_s: float | None = None,
                sha256: str | None = None, model_id: str | None = None) -> WorkResult:
        """Fetch weights into the cache (and, for tier host/gpu, into memory) unless already there."""
        tier = Tier(tier)
        uri = uri.strip()
        # Same weights, any tier: one transfer; the tier step is cheap and done by each request's own unit.
        return self._submit(f"preload:{uri}:{tier}", "preload", uri, deadline_s,
                            lambda unit: self._do_preload(unit, uri, tier, sha256.lower() if sha256 else None,
                                                          model_id))

    def evict(self, uri: str, *, tier: Tier | str | None = None, force: bool = False) -> dict:
        """Drop weights from ``tier`` (None: every tier, disk included).

        Disk entries used by another process (a running replica) are kept unless ``force``.
        """
        key = entry_key(uri)
        tier = None if tier is None else Tier(tier)
        dropped: list[str] = []
        with self._lock:
            if tier in (None, Tier.GPU) and self._gpu.pop(key, None) is not None:
                dropped.append("gpu")
            if tier in (None, Tier.HOST) and key in self._host:
                self._host.pop(key).release()
                dropped.append("host")
            if key not in self._host and key not in self._gpu:
                self.cache.protected.discard(key)
        if "gpu" in dropped:
            _return_gpu_memory()
        in_use: list[int] = []
        if tier in (None, Tier.DISK):
            removed, in_use = self.cache.evict(uri, force=force)
            if removed:
                dropped.append("disk")
        return {"uri": uri, "evicted_tiers": dropped, "in_use_by": in_use,
                "kept_because_in_use": bool(in_use) and not force}

    def observations(self, since: int = 0) -> list[dict]:
        with self._lock:
            return [o for o in self._observations if o["seq"] > since]

    def state(self) -> dict:
        """Images present, weights cached per tier, free disk and memory, GPUs, work in flight."""
        images: list[dict] = []
        images_error = None
        try:
            images = [{"ref": tag, "id": i.id, "size_bytes": i.size_bytes}
                      for i in self._runtime().list_images() for tag in (i.repo_tags or (i.id,))]
        except AgentError as exc:
            images_error = exc.as_dict()
        in_use = self.cache.in_use()
        weights = []
        for entry in self.cache.entries():
            tiers = ["disk"]
            row = {"uri": entry.uri, "size_bytes": entry.size_bytes, "sha256": entry.sha256,
                   "fetched_at": entry.fetched_at,
                   "last_used": datetime.fromtimestamp(entry.last_used, timezone.utc).isoformat(),
                   "in_use_by": in_use.get(entry.key, [])}
            if entry.key in self._host:
                tiers.append("host")
                row["host_residency"] = self._host[entry.key].mode
            if entry.key in self._gpu:
                tiers.append("gpu")
                row["gpu_device"] = self._gpu[entry.key][1]
            row["tiers"] = tiers
            weights.append(row)
        disk = shutil.disk_usage(self.cache.root)
        memory = psutil.virtual_memory()
        now = time.monotonic()
        with self._lock:
            in_flight = [{"kind": u.kind, "ref": u.ref, "phase": u.phase, "running_s": round(now - u.started, 3),
                          "deadline_in_s": round(u.deadline - now, 3), "waiters": u.waiters,
                          "bytes_done": u.bytes_done, "bytes_total": u.bytes_total}
                         for u in self._inflight.values()]
        return {
            "node": self.node_name,
            "time": self.clock().isoformat(),
            "images": images,
            "images_error": images_error,
            "weights": weights,
            "cache": {"dir": str(self.cache.root), "used_bytes": sum(w["size_bytes"] for w in weights),
                      "max_bytes": self.cache.max_bytes, "reserve_bytes": self.cache.reserve_bytes},
            "disk": {"free_bytes": disk.free, "total_bytes": disk.total},
            "memory": {"available_bytes": memory.available, "total_bytes": memory.total,
                       "host_resident_bytes": sum(p.size for p in self._host.values()),
                       "host_max_bytes": self.host_max_bytes,
                       "agent_rss_bytes": psutil.Process().memory_info().rss},
            "gpus": gpus(),
            "in_flight": in_flight,
            "limits": {"max_concurrent_pulls": self.max_concurrent_pulls,
                       "max_concurrent_preloads": self.max_concurrent_preloads},
        }

    # --- the work --------------------------------------------------------------------------------------------

    def _runtime(self) -> CriImageService:
        if self._cri is None:
            if self._cri_source is None:
                raise AgentError(FailureReason.RUNTIME_UNAVAILABLE, "no container runtime configured",
                                 temporary=False)
            self._cri = self._cri_source() if callable(self._cri_source) else self._cri_source
        return self._cri

    def _submit(self, key: str, kind: str, ref: str, deadline_s: float | None,
                work: Callable[[_Unit], WorkResult]) -> WorkResult:
        deadline_s = self.default_deadline_s if deadline_s is None else deadline_s
        deadline = time.monotonic() + max(0.0, deadline_s)
        with self._lock:
            unit = self._inflight.get(key)
            deduplicated = unit is not None
            if unit is not None:
                unit.deadline = max(unit.deadline, deadline)
                unit.waiters += 1
            else:
                unit = _Unit(key=key, kind=kind, ref=ref, started=time.monotonic(), deadline=deadline)
                self._inflight[key] = unit
                self._executor.submit(self._execute, unit, work)
        try:
            result = unit.future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            return WorkResult(kind=kind, ref=ref, status="failed", node=self.node_name,
                              reason=str(FailureReason.TIMEOUT), temporary=True, deduplicated=deduplicated,
                              message=f"{kind} of {ref} not finished within {deadline_s:g} s "
                                      f"(phase {unit.phase}, {unit.bytes_done} bytes done)")
        finally:
            with self._lock:
                unit.waiters -= 1
        if deduplicated:
            result = WorkResult(**{**result.as_dict(), "deduplicated": True})
        return result

    def _execute(self, unit: _Unit, work: Callable[[_Unit], WorkResult]) -> None:
        slot = self._slots[unit.kind]
        acquired = False
        try:
            while not acquired:
                remaining = unit.deadline - time.monotonic()
                if remaining <= 0:
                    raise AgentError(FailureReason.TIMEOUT,
                                     f"no free {unit.kind} slot on {self.node_name} before the deadline")
                acquired = slot.acquire(timeout=min(1.0, remaining))
            unit.phase = "running"
            result = work(unit)
        except AgentError as exc:
            result = WorkResult(kind=unit.kind, ref=unit.ref, status="failed", node=self.node_name, **exc.as_dict())
        except Exception as exc:  # noqa: BLE001 - a bug must still answer the request
            log.exception("%s of %s failed", unit.kind, unit.ref)
            result = WorkResult(kind=unit.kind, ref=unit.ref, status="failed", node=self.node_name,
                                reason=str(FailureReason.INTERNAL), message=f"{type(exc).__name__}: {exc}")
        finally:
            if acquired:
                slot.release()
            with self._lock:
                self._inflight.pop(unit.key, None)
        unit.future.set_result(result)

    def _observe(self, *, kind: str, ref: str, model_id: str | None, started_at: datetime, timings: dict,
                 size_bytes: int | None, cache_state: str, tier: str = "image") -> dict:
        observation = {"seq": next(self._seq), "kind": kind, "ref": ref, "model_id": model_id, "tier": tier,
                       "node_id": self.node_name, "started_at": started_at.isoformat(),
                       "size_bytes": size_bytes, "cache_state": cache_state, **timings}
        with self._lock:
            self._observations.append(observation)
        return observation

    def _do_prepull(self, unit: _Unit, image: str, model_id: str | None) -> WorkResult:
        cri = self._runtime()
        present = cri.image_status(image)
        if present is not None:
            return WorkResult(kind="prepull", ref=image, status="succeeded", node=self.node_name,
                              already_present=True, size_bytes=present.size_bytes,
                              message=f"{image} already present", detail={"image_id": present.id})
        auth = registry_auth(self.registry_auth_file, image)
        unit.phase = "pulling"
        started_at = self.clock()
        t0 = time.monotonic()
        image_id = cri.pull_image(image, auth=auth, deadline=unit.deadline, still_wanted=lambda: unit.deadline)
        pull_s = time.monotonic() - t0
        info = cri.image_status(image)
        size = None if info is None else info.size_bytes
        timings = {"image_pull_s": round(pull_s, 4)}
        observation = self._observe(kind="prepull", ref=image, model_id=model_id, started_at=started_at,
                                    timings=timings, size_bytes=size, cache_state="none")
        return WorkResult(kind="prepull", ref=image, status="succeeded", node=self.node_name, size_bytes=size,
                          timings=timings, message=f"pulled {image} in {pull_s:.2f} s",
                          detail={"image_id": image_id, "observation": observation})

    def _do_preload(self, unit: _Unit, uri: str, tier: Tier, sha256: str | None, model_id: str | None) -> WorkResult:
        started_at = self.clock()
        timings: dict[str, float] = {}
        entry = self.cache.get(uri)
        detail: dict = {}
        if entry is not None and sha256 and entry.sha256 and entry.sha256 != sha256:
            entry = None  # a different content is asked for under the same URI: fetch it again
        stale_etag = None
        if entry is not None and not sha256 and (changed := self._changed_upstream(entry)):
            # The object was overwritten under the same key: what the node holds is no longer those weights.
            stale_etag, detail["replaced_stale"] = entry.etag, changed
            self.evict(uri, tier=Tier.HOST)
            self.evict(uri, tier=Tier.GPU)
            entry = None
        fetched = False
        if entry is None:
            # One transfer per URI, whatever tiers the concurrent requests ask for.
            with self._uri_locked(uri, unit):
                entry = self.cache.get(uri)
                if entry is not None and sha256 and entry.sha256 and entry.sha256 != sha256:
                    entry = None
                if entry is not None and stale_etag is not None and entry.etag == stale_etag:
                    entry = None
                if entry is None:
                    unit.phase = "fetching"
                    entry, fetch_detail = self._fetch(unit, uri, sha256)
                    timings["weight_fetch_s"] = fetch_detail.pop("fetch_s")
                    detail.update(fetch_detail)
                    fetched = True
                else:
                    detail["joined_concurrent_fetch"] = True
        if not fetched:
            self.cache.touch(entry)
        loaded = False
        if tier is Tier.HOST and entry.key not in self._host:
            unit.phase = "loading"
            t0 = time.monotonic()
            self._pin_host(entry)
            timings["weight_load_s"] = round(time.monotonic() - t0, 4)
            loaded = True
        elif tier is Tier.GPU and entry.key not in self._gpu:
            unit.phase = "loading"
            t0 = time.monotonic()
            detail["gpu_device"] = self._load_gpu(unit, entry)
            timings["weight_load_s"] = round(time.monotonic() - t0, 4)
            loaded = True
        if tier is Tier.HOST:
            detail["host_residency"] = self._host[entry.key].mode
        if fetched or loaded:
            cache_state = "none" if fetched else "disk"
            detail["observation"] = self._observe(kind="preload", ref=uri, model_id=model_id, started_at=started_at,
                                                  timings=timings, size_bytes=entry.size_bytes,
                                                  cache_state=cache_state, tier=str(tier))
        verb = "fetched" if fetched else ("loaded" if loaded else "already cached")
        return WorkResult(kind="preload", ref=uri, status="succeeded", node=self.node_name, tier=str(tier),
                          already_present=not fetched and not loaded, size_bytes=entry.size_bytes, timings=timings,
                          message=f"{uri} {verb} ({tier})", detail={"sha256": entry.sha256, **detail})

    def _changed_upstream(self, entry) -> str | None:
        """Why a cached entry no longer holds its object (its ETag changed in S3), or None.

        An entry fetched before the cache kept ETags, or one whose HEAD fails (S3 unreachable, the object deleted),
        is served as it is: the node holds what it held, and the warning says so.
        """
        if self.s3 is None or entry.etag is None:
            return None
        try:
            info = self.s3.head(entry.uri)
        except AgentError as exc:
            log.warning("could not check cached %s against S3 (%s); serving the cached copy", entry.uri, exc)
            return None
        if info.etag == entry.etag:
            return None
        return f"{entry.uri} changed in S3 since it was cached (ETag {entry.etag} -> {info.etag})"

    @contextmanager
    def _uri_locked(self, uri: str, unit: _Unit) -> Iterator[None]:
        """Hold ``uri``'s lock (one transfer per URI, whatever tiers ask) until the block ends, waiting for it
        within ``unit``'s deadline. A URI's lock exists while someone holds or waits for it, so the table stays
        small and no waiter's lock is ever dropped from under it (two locks would mean two transfers)."""
        with self._lock:
            held = self._uri_locks.setdefault(uri, [threading.Lock(), 0])
            held[1] += 1
        try:
            if not held[0].acquire(timeout=max(0.0, unit.deadline - time.monotonic())):
                raise AgentError(FailureReason.TIMEOUT, f"{uri}: another pre-load of it did not finish in time")
            try:
                yield
            finally:
                held[0].release()
        finally:
            with self._lock:
                held[1] -= 1
                if held[1] == 0:
                    del self._uri_locks[uri]

    def _fetch(self, unit: _Unit, uri: str, sha256: str | None):
        if self.s3 is None:
            raise AgentError(FailureReason.RUNTIME_UNAVAILABLE, "no S3 endpoint configured", temporary=False)
        t0 = time.monotonic()
        info = self.s3.head(uri)
        unit.bytes_total = info.size_bytes
        expected = sha256 or info.sha256
        algorithms = ("sha256",) if expected or not info.md5 else ("sha256", "md5")
        self.cache.reserve(uri, info.size_bytes)
        staging = None
        try:
            staging = self.cache.staging_dir(uri)
            fd = os.open(staging / "data", os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                         0o644)
            # pread by the hasher needs read access too
            os.close(fd)
            fd = os.open(staging / "data", os.O_RDWR)
            try:
                if info.size_bytes:
                    try:
                        os.posix_fallocate(fd, 0, info.size_bytes)
                    except OSError as exc:
                        raise classify_s3_error(exc, f"allocate {info.size_bytes} bytes for {uri}") from None
                self.cache.allocated(uri)

                def progress(n: int) -> None:
                    unit.bytes_done = n

                digests = self.s3.fetch_into(uri, info, fd, deadline=lambda: unit.deadline, algorithms=algorithms,
                                             on_progress=progress)
            finally:
                os.close(fd)
            if expected and digests["sha256"] != expected:
                raise AgentError(FailureReason.CHECKSUM_MISMATCH,
                                 f"{uri}: sha256 {digests['sha256']} != expected {expected}", temporary=False)
            if not expected and info.md5 and digests.get("md5") != info.md5:
                raise AgentError(FailureReason.CHECKSUM_MISMATCH,
                                 f"{uri}: md5 {digests.get('md5')} != ETag {info.md5}", temporary=False)
            if time.monotonic() > unit.deadline:  # its last part landed after the caller was told "timeout"
                raise AgentError(FailureReason.TIMEOUT, f"pre-load of {uri} finished after its deadline; not cached")
            entry = self.cache.commit(staging, uri=uri, size=info.size_bytes, sha256=digests["sha256"],
                                      fetched_at=self.clock().isoformat(), etag=info.etag)
            staging = None
        finally:
            self.cache.release(uri)
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        fetch_s = time.monotonic() - t0
        verified = "sha256" if expected else ("md5-etag" if info.md5 else "none")
        return entry, {"fetch_s": round(fetch_s, 4), "verified_by": verified,
                       "mb_per_s": round(info.size_bytes / 1e6 / fetch_s, 1) if fetch_s > 0 else None,
                       "evicted": list(getattr(self.cache, "last_evicted", []))}

    def _pin_host(self, entry) -> None:
        with self._lock:
            resident = sum(p.size for p in self._host.values())
            if entry.size_bytes > self.host_max_bytes:
                raise AgentError(FailureReason.NO_SPACE, f"{entry.uri}: {entry.size_bytes} bytes exceed the host "
                                 f"memory budget of {self.host_max_bytes}", temporary=False)
            # Oldest pins go first when the budget is full.
            for key in list(self._host):
                if resident + entry.size_bytes <= self.host_max_bytes:
                    break
                pin = self._host.pop(key)
                resident -= pin.size
                pin.release()
                if key not in self._gpu:
                    self.cache.protected.discard(key)
        pin = _HostPin(entry.path, entry.size_bytes)
        with self._lock:
            self._host[entry.key] = pin
            self.cache.protected.add(entry.key)

    def _load_gpu(self, unit: _Unit, entry) -> str:
        try:
            import torch
        except ImportError:
            raise AgentError(FailureReason.NO_GPU, f"node {self.node_name}: torch is not installed, cannot load "
                             "weights into GPU memory", temporary=False) from None
        if not torch.cuda.is_available():
            raise AgentError(FailureReason.NO_GPU,
                             f"node {self.node_name} has no usable GPU (torch {torch.__version__}, CUDA build "
                             f"{torch.version.cuda}, torch.cuda.is_available() is False): tier gpu cannot be "
                             "served here; the weights stay cached on disk", temporary=False)
        free = [(torch.cuda.mem_get_info(i)[0], i) for i in range(torch.cuda.device_count())]
        free_bytes, index = max(free)
        if entry.size_bytes > free_bytes:
            raise AgentError(FailureReason.NO_SPACE, f"{entry.uri}: {entry.size_bytes} bytes, largest free GPU "
                             f"memory {free_bytes} bytes (cuda:{index})", temporary=False)
        device = f"cuda:{index}"
        tensor = torch.empty(entry.size_bytes, dtype=torch.uint8, device=device)
        try:
            _copy_file_to_gpu(torch, entry.path, tensor, index, unit, entry.uri)
        except BaseException as exc:
            # a failed load holds no GPU memory: the traceback's finished frames would keep the tensor alive
            traceback.clear_frames(exc.__traceback__)
            del tensor
            _return_gpu_memory()
            raise
        with self._lock:
            self._gpu[entry.key] = (tensor, device, entry.size_bytes)
            self.cache.protected.add(entry.key)
        return device


#: bytes per pinned staging buffer of a GPU load; two alternate, so reading one chunk overlaps copying the last
GPU_STAGING_BYTES = 64 << 20


def _copy_file_to_gpu(torch, path: Path, tensor, index: int, unit: _Unit, uri: str) -> None:
    """Fill ``tensor`` (uint8 on ``cuda:index``) with the file's bytes: the file is read into two pinned buffers in
    turn, each copied to the GPU without waiting, so the disk read of one chunk overlaps the copy of the one before
    (a buffer is refilled only after its last copy finished). Checks ``unit``'s deadline per chunk."""
    size = tensor.numel()
    chunk = min(GPU_STAGING_BYTES, max(size, 1))
    staging = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    views = [memoryview(b.numpy()) for b in staging]
    copied: list = [None, None]
    with torch.cuda.device(index), open(path, "rb", buffering=0) as handle:
        pos, k = 0, 0
        while pos < size:
            if time.monotonic() > unit.deadline:
                raise AgentError(FailureReason.TIMEOUT, f"GPU load of {uri} passed its deadline")
            slot = k % 2
            if copied[slot] is not None:
                copied[slot].synchronize()
            n = handle.readinto(views[slot][: min(chunk, size - pos)])
            if not n:
                raise AgentError(FailureReason.INTERNAL, f"{path}: short read at {pos}")
            tensor[pos:pos + n].copy_(staging[slot][:n], non_blocking=True)
            copied[slot] = torch.cuda.Event()
            copied[slot].record()
            pos += n
            k += 1
            unit.bytes_done = pos
        torch.cuda.synchronize(index)


def _return_gpu_memory() -> None:
    """Hand GPU memory this process no longer uses back to the device. PyTorch keeps freed blocks for reuse, so
    without this an evicted GPU-tier copy still reads as used in ``nvidia-smi``: for the planner (the node's free
    memory, :func:`gpus`) and for a replica starting on that GPU."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def gpus() -> list[dict]:
    """GPUs of this node from ``nvidia-smi`` (no torch import); [] when there are none."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return []
    try:
        out = subprocess.run([binary, "--query-gpu=index,name,memory.total,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            found.append({"index": int(parts[0]), "name": parts[1], "memory_total_bytes": int(parts[2]) << 20,
                          "memory_free_bytes": int(parts[3]) << 20})
    return found
