"""The scheduler's heartbeat: when its loop last woke, whether it still runs, the last error it survived.

The scheduler's loop (:mod:`forecaster.jobs.scheduler`) wakes at least every :data:`HEARTBEAT_EVERY_S`, due job or
not, and beats. ``/healthz`` of a process that runs the scheduler reads it and fails when the loop's thread has
ended or it has not woken for :data:`HEARTBEAT_STALE_S` (stuck, e.g. in a database call that never returns), so
that the pod's liveness probe restarts a process whose API still answers but whose jobs no longer run.

With a ``path`` every beat is also written there (JSON, replaced atomically): ``prewarm serve`` with several API
worker processes runs the scheduler in the parent, and the workers, which answer ``/healthz``, read the file whose
path :data:`HEARTBEAT_FILE_ENV` names.

No APScheduler here: the API imports this module.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

#: The scheduler's loop wakes at least this often (seconds), so that its heartbeat shows it turning.
HEARTBEAT_EVERY_S = 30.0
#: ``/healthz`` fails when the loop has not woken for this long (seconds).
HEARTBEAT_STALE_S = 300.0
#: Names the heartbeat file to ``prewarm serve``'s API worker processes (set by the parent for its workers).
HEARTBEAT_FILE_ENV = "PREWARM_SCHEDULER_HEARTBEAT_FILE"


class SchedulerHeartbeat:
    """The state of one scheduler loop, updated by the loop's thread and read by health checks."""

    def __init__(self, path: Path | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running = False
        self._last_wakeup: float | None = None
        self._errors = 0
        self._last_error: str | None = None
        self._write_failed = False

    def loop_started(self) -> None:
        with self._lock:
            self._thread = threading.current_thread()
            self._running = True
            self._last_wakeup = self.clock()
        self._write()

    def beat(self) -> None:
        with self._lock:
            self._last_wakeup = self.clock()
        self._write()

    def failed(self, error: BaseException) -> None:
        """The loop survived ``error`` (it tries again after the job store's retry interval)."""
        with self._lock:
            self._errors += 1
            self._last_error = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        self._write()

    def loop_ended(self) -> None:
        with self._lock:
            self._running = False
        self._write()

    def state(self) -> dict:
        """``running`` (the loop was entered, not left, and its thread is alive), ``last_wakeup`` (epoch seconds),
        ``errors`` survived and the ``last_error``."""
        with self._lock:
            thread = self._thread
            return {"running": self._running and thread is not None and thread.is_alive(),
                    "last_wakeup": self._last_wakeup, "errors": self._errors, "last_error": self._last_error}

    def health(self, stale_s: float = HEARTBEAT_STALE_S) -> tuple[bool, dict]:
        return heartbeat_health(self.state(), now=self.clock(), stale_s=stale_s)

    def _write(self) -> None:
        """Write the state to ``path``; a failure is logged (once until a write succeeds) and never raised: the
        loop that beats must not die of its heartbeat."""
        if self.path is None:
            return
        try:
            partial = self.path.with_name(self.path.name + ".part")
            partial.write_text(json.dumps(self.state()))
            os.replace(partial, self.path)
            self._write_failed = False
        except Exception:  # noqa: BLE001 - a full or read-only disk leaves the file stale; /healthz then says so
            if not self._write_failed:
                log.warning("scheduler heartbeat: cannot write %s", self.path, exc_info=True)
            self._write_failed = True


def read_heartbeat(path: Path) -> dict | None:
    """The state a :class:`SchedulerHeartbeat` wrote to ``path``; None when there is none (yet) or it is unreadable."""
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def file_health(path: Path, *, clock: Callable[[], float] = time.time,
                stale_s: float = HEARTBEAT_STALE_S) -> tuple[bool, dict]:
    """:func:`heartbeat_health` of the heartbeat file ``path`` (another process's scheduler)."""
    return heartbeat_health(read_heartbeat(path), now=clock(), stale_s=stale_s)


def heartbeat_health(state: dict | None, *, now: float, stale_s: float = HEARTBEAT_STALE_S) -> tuple[bool, dict]:
    """``(healthy, detail)``: healthy when the loop runs and woke within ``stale_s`` seconds of ``now``."""
    if not state:
        return False, {"status": "no heartbeat"}
    last = state.get("last_wakeup")
    age = None if last is None else round(now - float(last), 1)
    if not state.get("running"):
        status = "stopped: the scheduler's loop has ended"
    elif age is None or age > stale_s:
        status = f"stuck: no wakeup for more than {stale_s:g} s"
    else:
        status = "ok"
    detail: dict = {"status": status, "last_wakeup_age_s": age, "errors": int(state.get("errors") or 0)}
    if state.get("last_error"):
        detail["last_error"] = state["last_error"]
    return status == "ok", detail
