"""Run one function over many shards: on Dask, on a local process pool, or in this process.

The retrain, the backtests and the forecast job split their series into shards
(:mod:`forecaster.forecast.sharded`) and hand every shard to an executor:

* :class:`DaskExecutor` when ``PREWARM_DASK_SCHEDULER_ADDRESS`` names a
  ``dask.distributed`` scheduler (one task per shard; Dask moves the task to
  another worker when a worker dies);
* :class:`PoolExecutor` otherwise, with ``PREWARM_SHARD_WORKERS`` processes
  (``spawn``ed: the scheduler process has threads, and torch does not survive
  ``fork`` well);
* :class:`InlineExecutor` when ``PREWARM_SHARD_WORKERS=1``: the same function,
  shard after shard, in this process.

Whatever the backend, a shard that raises (or whose worker dies) is tried
again up to ``retries`` more times; a shard that still fails is reported in
:attr:`ShardRun.failures` and never costs the other shards their results.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import uuid
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class ShardRun:
    """Outcome of running one function over shards.

    Attributes:
        results: shard key -> the function's return value, for shards that succeeded.
        failures: shard key -> the last error (``Type: message``), for shards that
            failed on every attempt.
        attempts: shard key -> attempts made (1 = first try succeeded).
        seconds: wall time of the whole run.
        backend: ``dask``, ``pool`` or ``inline``.
        workers: workers the backend had when the run started.
    """

    results: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    backend: str = ""
    workers: int = 0

    def summary(self) -> dict:
        return {"backend": self.backend, "workers": self.workers, "shards": len(self.results) + len(self.failures),
                "failed_shards": dict(self.failures),
                "retried_shards": sorted(k for k, n in self.attempts.items() if n > 1),
                "seconds": round(self.seconds, 3)}


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Executor(ABC):
    """Runs ``fn(*args)`` once per shard with per-shard retries."""

    backend = ""

    def __init__(self, retries: int = 2):
        self.retries = retries

    @property
    @abstractmethod
    def workers(self) -> int:
        """Workers available now."""

    def run(self, fn: Callable[..., Any], tasks: Mapping[str, tuple], *, name: str | None = None) -> ShardRun:
        """Run ``fn(*tasks[key])`` for every shard key; see the module docstring for failures."""
        started = time.perf_counter()
        run = ShardRun(backend=self.backend, workers=self.workers)
        pending = dict(tasks)
        for attempt in range(1, self.retries + 2):
            if not pending:
                break
            for key in pending:
                run.attempts[key] = attempt
            errors = self._run_round(fn, pending, run.results, name or getattr(fn, "__name__", "task"))
            for key, error in errors.items():
                log.warning("shard %s failed on attempt %d of %d: %s", key, attempt, self.retries + 1, error)
            pending = {key: pending[key] for key in errors}
            run.failures = errors
        run.seconds = time.perf_counter() - started
        return run

    @abstractmethod
    def _run_round(self, fn, tasks: Mapping[str, tuple], results: dict, name: str) -> dict[str, str]:
        """Run every task once, store successes in ``results``; return key -> error for the rest."""

    def close(self) -> None:
        """Release workers / connections (idempotent)."""


class InlineExecutor(Executor):
    """Shard after shard in this process: the reference the other backends must match."""

    backend = "inline"

    @property
    def workers(self) -> int:
        return 1

    def _run_round(self, fn, tasks, results, name):
        errors = {}
        for key, args in tasks.items():
            try:
                results[key] = fn(*args)
            except Exception as error:  # one shard's failure is reported, the others go on
                errors[key] = _describe(error)
        return errors


NATIVE_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def native_threads_per_worker(workers: int) -> int:
    """Native threads each of ``workers`` processes may use: this process's cores shared out, at least one."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers))


def limit_native_threads(threads: int) -> None:
    """Cap this process's BLAS and OpenMP thread pools at ``threads`` (a pool worker's initializer).

    The pool's parallelism is across shards. A BLAS or OpenMP pool sized for the whole machine in every worker
    starts threads that spin waiting for cores the sibling workers hold (the report's processes lost half their
    CPU to that, docs/report.md); Dask's nanny sets the same variables to 1 in its workers. The variables reach the
    libraries this worker loads from now on, threadpoolctl those already loaded (numpy's, with the main module).
    The members' own thread settings (``n_jobs`` of the trees and the LSTM, 1 by default) are explicit and stay.
    On 2 cores the cap did not measurably change the 100,000-model forecast job (docs/scale.md: 0.81x of Dask's
    time with it, 0.77x without, within run-to-run noise); it is for machines with many cores, where N workers
    each starting an N-thread pool is the oversubscription joblib's loky backend prevents the same way.
    """
    for name in NATIVE_THREAD_VARIABLES:
        os.environ[name] = str(threads)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads)


class PoolExecutor(Executor):
    """A persistent pool of ``workers`` spawned processes (kept between runs: models stay cached there).

    Each worker's BLAS and OpenMP pools get the cores divided by the workers (:func:`limit_native_threads`).
    """

    backend = "pool"

    def __init__(self, workers: int, retries: int = 2):
        super().__init__(retries)
        self._workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def workers(self) -> int:
        return self._workers

    def _get_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=limit_native_threads,
                                                 initargs=(native_threads_per_worker(self._workers),))
            return self._pool

    def _reset_pool(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    def _run_round(self, fn, tasks, results, name):
        pool = self._get_pool()
        futures = {pool.submit(fn, *args): key for key, args in tasks.items()}
        errors = {}
        broken = False
        remaining = set(futures)
        while remaining:
            done, remaining = wait(remaining, return_when=FIRST_COMPLETED)
            for future in done:
                key = futures[future]
                try:
                    results[key] = future.result()
                except BrokenProcessPool as error:  # a worker died: every unfinished task is lost with it
                    broken = True
                    errors[key] = _describe(error) or "a worker process died"
                except Exception as error:
                    errors[key] = _describe(error)
        if broken:
            self._reset_pool()  # the next round starts fresh processes
        return errors

    def close(self) -> None:
        self._reset_pool()


class DaskExecutor(Executor):
    """One ``dask.distributed`` task per shard on the scheduler at ``address``.

    The shard's inputs travel inside the task, so when a worker dies the
    scheduler can run the task again elsewhere without this process sending
    anything; a task that raises, or that Dask gives up on (``KilledWorker``
    after ``distributed.scheduler.allowed-failures`` deaths), is retried by
    :meth:`Executor.run` like on the other backends.
    """

    backend = "dask"

    def __init__(self, address: str, retries: int = 2, timeout_s: float = 30.0):
        super().__init__(retries)
        from distributed import Client

        self.address = address
        self.client = Client(address, timeout=timeout_s, set_as_default=False)

    @property
    def workers(self) -> int:
        return len(self.client.scheduler_info(n_workers=-1).get("workers", {}))

    def _run_round(self, fn, tasks, results, name):
        with warnings.catch_warnings():
            # shards of history are large task arguments on purpose (see the class docstring)
            warnings.filterwarnings("ignore", message=".*[Ll]arge.*")
            futures = {
                self.client.submit(fn, *args, key=f"{name}-{key}-{uuid.uuid4().hex[:8]}", pure=False): key
                for key, args in tasks.items()
            }
        errors = {}
        for future, key in futures.items():  # all run in parallel; collecting in order costs no wall time
            key = futures[future]
            try:
                results[key] = future.result()
            except Exception as error:
                errors[key] = _describe(error)
            finally:
                future.release()
        return errors

    def close(self) -> None:
        self.client.close()


_cache: dict[tuple, Executor] = {}
_cache_lock = threading.Lock()


def executor_for(settings) -> Executor:
    """The executor the settings ask for, created once per process and reused."""
    if settings.dask_scheduler_address:
        key = ("dask", settings.dask_scheduler_address, settings.shard_retries)
    elif settings.shard_workers > 1:
        key = ("pool", settings.shard_workers, settings.shard_retries)
    else:
        key = ("inline", settings.shard_retries)
    with _cache_lock:
        executor = _cache.get(key)
        if executor is None:
            if key[0] == "dask":
                executor = DaskExecutor(settings.dask_scheduler_address, settings.shard_retries,
                                        settings.dask_connect_timeout_s)
            elif key[0] == "pool":
                executor = PoolExecutor(settings.shard_workers, settings.shard_retries)
            else:
                executor = InlineExecutor(settings.shard_retries)
            _cache[key] = executor
        return executor


def close_executors() -> None:
    """Close every cached executor (end of a CLI command or a test)."""
    with _cache_lock:
        for executor in _cache.values():
            executor.close()
        _cache.clear()
