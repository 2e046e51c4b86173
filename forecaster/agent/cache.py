"""The node's weights cache on local disk: atomic entries, an LRU disk budget, in-use protection.

Layout under ``root``::

    weights/<entry>/data        the weights file (entry = first 32 hex of sha256(uri))
    weights/<entry>/meta.json   uri, size, sha256, fetched_at; its mtime is the entry's last use
    tmp/<entry>.<random>/       a download in progress (removed at start-up)

A download is written and verified under ``tmp/`` and becomes visible by one
``rename`` of its directory into ``weights/``, so a half-written file is never
seen as cached, whatever kills the agent. An entry counts as *in use* when a
process other than the agent has its file open or mapped (a running replica
loading or serving it); in-use entries are never evicted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from forecaster.agent.errors import AgentError
from forecaster.contracts.actions import FailureReason
from forecaster.store.files import fsync_path


def entry_key(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CacheEntry:
    key: str
    uri: str
    path: Path  # the data file
    size_bytes: int
    sha256: str | None
    fetched_at: str
    last_used: float  # Unix seconds
    etag: str | None = None  # the object's ETag when fetched (None: cached before the agent kept it)


def pids_using(paths: set[str], *, exclude_pid: int | None = None) -> dict[str, list[int]]:
    """Which processes have each of ``paths`` open or memory-mapped (from ``/proc``)."""
    found: dict[str, list[int]] = {}
    if not paths:
        return found
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == exclude_pid:
            continue
        pid = int(proc.name)
        seen: set[str] = set()
        try:
            for fd in (proc / "fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target in paths:
                    seen.add(target)
            with open(proc / "maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    target = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                    if target in paths:
                        seen.add(target)
        except (OSError, PermissionError):
            continue
        for target in seen:
            found.setdefault(target, []).append(pid)
    return found


class WeightsCache:
    """The cache directory with its budget.

    Args:
        root: cache directory (created).
        max_bytes: LRU budget for all entries; None = only free disk limits it.
        reserve_bytes: free disk space the cache never uses.
    """

    def __init__(self, root: Path, *, max_bytes: int | None = None, reserve_bytes: int = 0) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.reserve_bytes = reserve_bytes
        self.weights_dir = self.root / "weights"
        self.tmp_dir = self.root / "tmp"
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)  # downloads a previous run left half-done
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._reserved: dict[str, int] = {}  # space promised to downloads in flight
        self._allocated: set[str] = set()  # of those, the ones whose file already holds its blocks (fallocate)
        self.protected: set[str] = set()  # keys held warm in host/GPU memory: not evicted by LRU

    # --- reading ---------------------------------------------------------------------------------------------

    def get(self, uri: str) -> CacheEntry | None:
        return self._load(entry_key(uri))

    def _load(self, key: str) -> CacheEntry | None:
        entry_dir = self.weights_dir / key
        meta_path = entry_dir / "meta.json"
        try:
            meta = json.loads(meta_path.read_text())
            last_used = meta_path.stat().st_mtime
        except (OSError, ValueError):
            return None
        return CacheEntry(key=key, uri=meta["uri"], path=entry_dir / "data", size_bytes=int(meta["size_bytes"]),
                          sha256=meta.get("sha256"), fetched_at=meta.get("fetched_at", ""), last_used=last_used,
                          etag=meta.get("etag"))

    def entries(self) -> list[CacheEntry]:
        found = (self._load(p.name) for p in self.weights_dir.iterdir() if p.is_dir())
        return sorted((e for e in found if e is not None), key=lambda e: e.last_used)

    def touch(self, entry: CacheEntry) -> None:
        """Mark an entry used now (its LRU position)."""
        try:
            os.utime(self.weights_dir / entry.key / "meta.json")
        except OSError:
            pass

    def used_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries())

    def in_use(self) -> dict[str, list[int]]:
        """Entry key -> PIDs of other processes that have its data open or mapped."""
        paths = {str(e.path): e.key for e in self.entries()}
        return {paths[p]: pids for p, pids in pids_using(set(paths), exclude_pid=os.getpid()).items()}

    # --- writing ---------------------------------------------------------------------------------------------

    def reserve(self, uri: str, size: int) -> None:
        """Make room for ``size`` bytes (evicting least recently used entries) and hold it for this download.

        Raises:
            AgentError(no_space): when eviction of everything evictable is not enough.
        """
        with self._lock:
            key = entry_key(uri)
            in_flight = sum(self._reserved.values())
            # The free disk already excludes what in-flight downloads have allocated: only the rest is owed.
            unallocated = sum(n for k, n in self._reserved.items() if k not in self._allocated)
            busy = self.in_use()
            victims = [e for e in self.entries() if e.key not in busy and e.key not in self.protected
                       and e.key != key]

            def short() -> int:
                free = shutil.disk_usage(self.root).free - self.reserve_bytes - unallocated
                need = size - free
                if self.max_bytes is not None:
                    need = max(need, self.used_bytes() + in_flight + size - self.max_bytes)
                return need

            evicted = []
            while short() > 0 and victims:
                victim = victims.pop(0)
                self._remove(victim.key)
                evicted.append(victim.uri)
            if short() > 0:
                budget = "" if self.max_bytes is None else f", cache budget {self.max_bytes} bytes"
                raise AgentError(FailureReason.NO_SPACE,
                                 f"{size} bytes do not fit in {self.root} (free disk "
                                 f"{shutil.disk_usage(self.root).free} bytes, reserve {self.reserve_bytes}"
                                 f"{budget}; {len(busy)} entries in use)", temporary=False)
            self._reserved[key] = size
            self.last_evicted = evicted

    def allocated(self, uri: str) -> None:
        """The download of ``uri`` has allocated its reserved bytes on disk (``posix_fallocate``): the file system's
        free space counts them from now on, so :meth:`reserve` stops subtracting them a second time."""
        with self._lock:
            if entry_key(uri) in self._reserved:
                self._allocated.add(entry_key(uri))

    def release(self, uri: str) -> None:
        with self._lock:
            self._reserved.pop(entry_key(uri), None)
            self._allocated.discard(entry_key(uri))

    def staging_dir(self, uri: str) -> Path:
        path = self.tmp_dir / f"{entry_key(uri)}.{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return path

    def commit(self, staging: Path, *, uri: str, size: int, sha256: str | None, fetched_at: str,
               etag: str | None = None) -> CacheEntry:
        """Publish a verified download: fsync, then one rename makes it visible."""
        (staging / "meta.json").write_text(json.dumps({"uri": uri, "size_bytes": size, "sha256": sha256,
                                                       "fetched_at": fetched_at, "etag": etag}))
        for name in ("data", "meta.json"):
            fsync_path(staging / name)
        fsync_path(staging)
        key = entry_key(uri)
        target = self.weights_dir / key
        with self._lock:
            if target.exists():  # replaced (a DELETE and a new pre-load raced): the new bytes win
                shutil.rmtree(target)
            os.rename(staging, target)
            fsync_path(self.weights_dir)
        entry = self._load(key)
        assert entry is not None
        return entry

    def evict(self, uri: str, *, force: bool = False) -> tuple[bool, list[int]]:
        """Remove an entry unless another process uses it (or ``force``).

        Returns:
            (removed, pids using it).
        """
        with self._lock:
            key = entry_key(uri)
            if not (self.weights_dir / key).exists():
                return False, []
            users = self.in_use().get(key, [])
            if users and not force:
                return False, users
            self._remove(key)
            return True, users

    def _remove(self, key: str) -> None:
        entry_dir = self.weights_dir / key
        # Rename first so the entry disappears in one step, then delete at leisure.
        doomed = self.tmp_dir / f"evict-{key}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(entry_dir, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)
        self.protected.discard(key)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
