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
  shard after shard, in this process; except for the forecast job, whose shards
  then run on a :class:`PoolExecutor` of one worker (shard after shard in one
  child process) so that its deadline can kill a hung shard; in this process
  only with ``PREWARM_FORECAST_IN_PROCESS=true``, where the deadline cannot.

Whatever the backend, a shard that raises (or whose worker dies) is tried
again up to ``retries`` more times; a shard that still fails is reported in
:attr:`ShardRun.failures` and never costs the other shards their results:

* a shard's exception travels back as a :class:`ShardError` holding its type and
  message, so an exception that pickles but cannot be unpickled (a two-argument
  ``__init__``) neither breaks the pool nor loses its text;
* when a pool worker dies, the pool fails every shard it had not finished,
  whichever one killed it; those shards run again at once: the ones that were
  running (one of them killed it) each alone in a fresh process, at most
  ``workers`` at a time, then the rest together on a fresh pool, so the dead
  worker's own shard fails alone and the others finish;
* a run with a deadline (``deadline_s``; the forecast job's executor has one,
  :func:`executor_for`) stops waiting when it passes: the pool's workers are
  killed (a fresh pool serves the next run), Dask's futures cancelled, and every
  shard not finished by then is reported failed, so its caller falls back
  instead of waiting on a hung worker forever. Neither this process nor Dask can
  stop a running shard: in this process the run waits for it (the deadline only
  stops the retries), and on Dask a hung task keeps its worker thread after the
  run has returned, until it ends or the worker is restarted.

The forecast job gets executors of its own (``purpose="forecast"``): its own
pool, so its shards never queue behind the nightly retrain's fits, whose pool
workers run at a lower CPU priority (``nice``), and on Dask a higher task
priority than the retrain's and the backtests' tasks.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from abc import ABC, abstractmethod
from contextlib import contextmanager
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

BATCH = "batch"
FORECAST = "forecast"
PURPOSES = (BATCH, FORECAST)
BATCH_NICENESS = 10  # added to a batch pool worker's nice value: the forecast pool's workers get the cores first
FORECAST_DASK_PRIORITY = 10  # Dask runs queued tasks of higher priority first (the retrain's are 0)


@dataclass
class ShardRun:
    """Outcome of running one function over shards.

    Attributes:
        results: shard key -> the function's return value, for shards that succeeded.
        failures: shard key -> the last error (``Type: message``), for shards that
            failed on every attempt or were not finished by the run's deadline.
        attempts: shard key -> times the shard was sent to a worker (1 = the first try succeeded; the
            run again after a worker death broke the pool counts).
        seconds: wall time of the whole run.
        backend: ``dask``, ``pool`` or ``inline``.
        workers: workers the backend had when the run started.
        timed_out: the shards that the deadline cut off (also in ``failures``).
    """

    results: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    backend: str = ""
    workers: int = 0
    timed_out: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"backend": self.backend, "workers": self.workers, "shards": len(self.results) + len(self.failures),
                "failed_shards": dict(self.failures),
                "retried_shards": sorted(k for k, n in self.attempts.items() if n > 1),
                "timed_out_shards": sorted(self.timed_out),
                "seconds": round(self.seconds, 3)}


class ShardError(Exception):
    """A shard's exception as text (``Type: message``), raised in the worker in place of the original.

    It always pickles and unpickles (one string argument): an exception whose ``__init__`` takes other
    arguments than its ``args`` pickles in the worker but fails to unpickle in the caller, which breaks a
    process pool (every unfinished shard fails with it) and loses the message.
    """

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _describe(error: BaseException) -> str:
    if isinstance(error, ShardError):
        return error.text
    return f"{type(error).__name__}: {error}"


def _guarded(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a worker, its exception (if any) turned into a :class:`ShardError`."""
    try:
        return fn(*args)
    except Exception as error:
        raise ShardError(_describe(error)) from None


def _tracked(token: str, fn: Callable[..., Any], *args: Any) -> Any:
    """:func:`_guarded` in a pool worker, with the file ``token`` present while it runs.

    A token left behind by a broken pool names a shard that was running when a worker died: one of those
    killed it. The file is written and removed synchronously (a dying process flushes nothing later).
    """
    with open(token, "wb"):
        pass
    try:
        return _guarded(fn, *args)
    finally:
        os.unlink(token)


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic()``), at least 0; None without a deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Executor(ABC):
    """Runs ``fn(*args)`` once per shard with per-shard retries.

    Args:
        retries: extra attempts of a shard that fails.
        deadline_s: the most seconds a :meth:`run` may take; shards not finished by then are stopped
            (where the backend can: not in this process) and reported failed. None: no deadline.
    """

    backend = ""

    def __init__(self, retries: int = 2, *, deadline_s: float | None = None):
        self.retries = retries
        self.deadline_s = deadline_s

    @property
    @abstractmethod
    def workers(self) -> int:
        """Workers available now."""

    def _late(self) -> str:
        return f"TimeoutError: not finished within the run's deadline of {self.deadline_s:g} s"

    def run(self, fn: Callable[..., Any], tasks: Mapping[str, tuple], *, name: str | None = None) -> ShardRun:
        """Run ``fn(*tasks[key])`` for every shard key; see the module docstring for failures."""
        started = time.perf_counter()
        deadline = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        run = ShardRun(backend=self.backend, workers=self.workers)
        pending = dict(tasks)
        for attempt in range(1, self.retries + 2):
            if not pending:
                break
            if attempt > 1 and _left(deadline) == 0:  # no retry after the deadline: the caller falls back
                for key in pending:
                    run.failures[key] = f"{run.failures[key]}; no retry: {self._late()}"
                break
            for key in pending:
                run.attempts[key] = run.attempts.get(key, 0) + 1
            timed_out: list[str] = []
            try:
                errors = self._run_round(fn, pending, run, name or getattr(fn, "__name__", "task"), deadline,
                                         timed_out)
            except ExecutorUnavailable:
                raise
            except Exception as error:  # each backend catches its shards' own errors: this is the backend's
                raise ExecutorUnavailable(f"the {self.backend} executor could not run the shards: "
                                          f"{_describe(error)}") from error
            for key, error in errors.items():
                log.warning("shard %s failed on attempt %d of %d: %s", key, attempt, self.retries + 1, error)
            run.failures = errors
            if timed_out:
                run.timed_out = sorted(timed_out)
                break
            pending = {key: pending[key] for key in errors}
        run.seconds = time.perf_counter() - started
        return run

    @abstractmethod
    def _run_round(self, fn, tasks: Mapping[str, tuple], run: ShardRun, name: str, deadline: float | None,
                   timed_out: list[str]) -> dict[str, str]:
        """Run every task once, store successes in ``run.results``; return key -> error for the rest.

        Shards still running at ``deadline`` are stopped where the backend can, reported with
        :meth:`_late` and listed in ``timed_out``.
        """

    def close(self) -> None:
        """Release workers / connections (idempotent)."""


class ExecutorUnavailable(RuntimeError):
    """The executor itself could not run shards (no worker process could start, its temporary folder could not be
    made, the Dask scheduler is gone...): a fault of where the shards run, not of the model they run."""


class InlineExecutor(Executor):
    """Shard after shard in this process: the reference the other backends must match.

    A deadline cannot stop a shard here; it only stops the retries once it has passed. The forecast job runs
    here only with ``forecast_in_process`` (:func:`executor_for`).
    """

    backend = "inline"

    @property
    def workers(self) -> int:
        return 1

    def _run_round(self, fn, tasks, run, name, deadline, timed_out):
        errors = {}
        for key, args in tasks.items():
            try:
                run.results[key] = fn(*args)
            except Exception as error:  # one shard's failure is reported, the others go on
                errors[key] = _describe(error)
        return errors


NATIVE_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def native_threads_per_worker(workers: int) -> int:
    """Native threads each of ``workers`` processes may use: this process's cores shared out, at least one."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers))


def limit_native_threads(threads: int, niceness: int = 0) -> None:
    """Cap this process's BLAS and OpenMP thread pools at ``threads`` (a pool worker's initializer).

    The pool's parallelism is across shards. A BLAS or OpenMP pool sized for the whole machine in every worker
    starts threads that spin waiting for cores the sibling workers hold (the report's processes lost half their
    CPU to that, docs/report.md); Dask's nanny sets the same variables to 1 in its workers. The variables reach the
    libraries this worker loads from now on, threadpoolctl those already loaded (numpy's, with the main module).
    The members' own thread settings (``n_jobs`` of the trees and the LSTM, 1 by default) are explicit and stay.
    On 2 cores the cap did not measurably change the 100,000-model forecast job (docs/scale.md: 0.81x of Dask's
    time with it, 0.77x without, within run-to-run noise); it is for machines with many cores, where N workers
    each starting an N-thread pool is the oversubscription joblib's loky backend prevents the same way.

    ``niceness`` is added to the worker's nice value first (a batch pool's workers: the threads they start
    inherit it), so that on a busy machine the forecast pool's workers get the cores before the retrain's.
    """
    if niceness:
        os.nice(niceness)
    for name in NATIVE_THREAD_VARIABLES:
        os.environ[name] = str(threads)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads)


def _kill(pool: ProcessPoolExecutor) -> None:
    """Kill ``pool``'s worker processes (SIGKILL: a hung native call ignores anything milder) and shut it down."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            process.kill()
        except (OSError, ValueError, AttributeError):  # already gone, or closed
            pass
    pool.shutdown(wait=False, cancel_futures=True)


class PoolExecutor(Executor):
    """A persistent pool of ``workers`` spawned processes (kept between runs: models stay cached there).

    Each worker's BLAS and OpenMP pools get the cores divided by the workers (:func:`limit_native_threads`),
    and its nice value is raised by ``niceness``. A run that reaches its deadline kills the pool's workers
    (the next run starts fresh ones). When a worker dies, the shards the broken pool failed run again at once:
    those that were running then (:func:`_tracked`) each alone in a fresh process, the others together on a
    fresh pool, so that only the dead worker's own shard is charged with the death.
    """

    backend = "pool"

    def __init__(self, workers: int, retries: int = 2, *, deadline_s: float | None = None, niceness: int = 0):
        super().__init__(retries, deadline_s=deadline_s)
        self._workers = workers
        self.niceness = niceness
        self._pool: ProcessPoolExecutor | None = None
        self._token_dir: str | None = None  # files naming the shards running now (see _tracked)
        self._token_dir_cleanup: weakref.finalize | None = None  # removes it on close, collection or exit
        self._lock = threading.Lock()

    @property
    def workers(self) -> int:
        return self._workers

    def _new_pool(self, workers: int) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=limit_native_threads,
                                   initargs=(native_threads_per_worker(self._workers), self.niceness))

    def _get_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None or getattr(self._pool, "_broken", False):
                if self._pool is not None:  # broken by another run's dead worker
                    self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool(self._workers)
            return self._pool

    def _drop(self, pool: ProcessPoolExecutor, *, kill: bool) -> None:
        """Stop using ``pool`` (the next run starts a fresh one); ``kill``: kill its workers too."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
        if kill:
            _kill(pool)
        else:
            pool.shutdown(wait=False, cancel_futures=True)

    def _reset_pool(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _tokens(self) -> str:
        with self._lock:
            if self._token_dir is None:
                self._token_dir = tempfile.mkdtemp(prefix="prewarm-shards-")
                self._token_dir_cleanup = weakref.finalize(self, shutil.rmtree, self._token_dir, True)
            return self._token_dir

    def _run_round(self, fn, tasks, run, name, deadline, timed_out):
        pool = self._get_pool()
        folder = self._tokens()
        tokens = {key: os.path.join(folder, uuid.uuid4().hex) for key in tasks}
        futures = {}
        lost: list[str] = []  # failed by a broken pool: whose worker died is not known yet
        errors: dict[str, str] = {}
        try:
            for key, args in tasks.items():
                try:
                    futures[pool.submit(_tracked, tokens[key], fn, *args)] = key
                except BrokenProcessPool:  # broken while we submitted (an earlier task of this round died already)
                    lost.append(key)
            remaining = set(futures)
            while remaining:
                done, remaining = wait(remaining, timeout=_left(deadline), return_when=FIRST_COMPLETED)
                if not done:  # the deadline passed: stop the hung or slow workers, report what is left
                    self._drop(pool, kill=True)
                    for future in remaining:
                        errors[futures[future]] = self._late()
                        timed_out.append(futures[future])
                    break
                for future in done:
                    key = futures[future]
                    try:
                        run.results[key] = future.result()
                    except BrokenProcessPool:  # a worker died: every unfinished task of the pool failed with it
                        lost.append(key)
                    except Exception as error:
                        errors[key] = _describe(error)
            if lost:
                self._drop(pool, kill=False)  # the next round (or run) starts fresh processes
                # the shards running when the worker died (their token is left): one of them killed it
                running = [key for key in lost if os.path.exists(tokens[key])]
                if len(tasks) == 1:  # it ran alone: its own worker died
                    errors[lost[0]] = "BrokenProcessPool: the worker process running this shard died"
                    return errors
                suspects = running or lost  # none seen running (it died before its token): all are suspects
                others = {key: tasks[key] for key in lost if key not in suspects}
                log.warning("a pool worker died; the shard(s) running then again, each alone: %s%s",
                            ", ".join(sorted(suspects)),
                            f"; the {len(others)} not started yet again together" if others else "")
                errors.update(self._run_alone(fn, {key: tasks[key] for key in suspects}, run, deadline, timed_out))
                if others and not timed_out:
                    for key in others:
                        run.attempts[key] = run.attempts.get(key, 0) + 1
                    errors.update(self._run_round(fn, others, run, name, deadline, timed_out))
                elif others:
                    for key in others:
                        errors[key] = self._late()
                        timed_out.append(key)
            return errors
        finally:
            for token in tokens.values():
                try:
                    os.unlink(token)
                except FileNotFoundError:
                    pass

    def _run_alone(self, fn, tasks, run, deadline, timed_out) -> dict[str, str]:
        """Each task in a fresh one-process pool, at most ``workers`` at a time: a death is its own task's."""
        errors: dict[str, str] = {}
        waiting = list(tasks)
        running: dict = {}  # future -> (key, pool, process)
        try:
            while waiting or running:
                while waiting and len(running) < self._workers:
                    key = waiting.pop(0)
                    run.attempts[key] = run.attempts.get(key, 0) + 1
                    pool = self._new_pool(1)
                    future = pool.submit(_guarded, fn, *tasks[key])
                    process = next(iter((getattr(pool, "_processes", None) or {}).values()), None)
                    running[future] = (key, pool, process)
                done, _ = wait(running, timeout=_left(deadline), return_when=FIRST_COMPLETED)
                if not done:  # the deadline passed
                    break
                for future in done:
                    key, pool, process = running.pop(future)
                    try:
                        run.results[key] = future.result()
                    except BrokenProcessPool:
                        code = process.exitcode if process is not None else None
                        if process is not None and code is None:
                            process.join(1.0)
                            code = process.exitcode
                        errors[key] = ("BrokenProcessPool: the worker process running this shard alone died"
                                       + (f" (exit code {code})" if code is not None else ""))
                    except Exception as error:
                        errors[key] = _describe(error)
                    pool.shutdown(wait=False)
        finally:
            for key, pool, _ in running.values():  # still running at the deadline (or an error above)
                _kill(pool)
                errors[key] = self._late()
                timed_out.append(key)
            for key in waiting:
                errors[key] = self._late()
                timed_out.append(key)
        return errors

    def close(self) -> None:
        self._reset_pool()
        with self._lock:
            cleanup, self._token_dir, self._token_dir_cleanup = self._token_dir_cleanup, None, None
        if cleanup is not None:
            cleanup()  # removes the folder (once)


class DaskExecutor(Executor):
    """One ``dask.distributed`` task per shard on the scheduler at ``address``.

    The shard's inputs travel inside the task, so when a worker dies the
    scheduler can run the task again elsewhere without this process sending
    anything; a task that raises, or that Dask gives up on (``KilledWorker``
    after ``distributed.scheduler.allowed-failures`` deaths), is retried by
    :meth:`Executor.run` like on the other backends. Results are collected as
    tasks finish; at the run's deadline the unfinished tasks are cancelled and
    reported failed (Dask cannot stop a task's thread: a hung task keeps its
    worker thread until it returns, or until the worker is restarted).
    ``priority`` is Dask's task priority (higher runs first among queued tasks).
    """

    backend = "dask"

    def __init__(self, address: str, retries: int = 2, timeout_s: float = 30.0, *, deadline_s: float | None = None,
                 priority: int = 0):
        super().__init__(retries, deadline_s=deadline_s)
        from distributed import Client

        self.address = address
        self.priority = priority
        self.client = Client(address, timeout=timeout_s, set_as_default=False)

    @property
    def workers(self) -> int:
        return len(self.client.scheduler_info(n_workers=-1).get("workers", {}))

    def _run_round(self, fn, tasks, run, name, deadline, timed_out):
        from distributed import as_completed

        with warnings.catch_warnings():
            # shards of history are large task arguments on purpose (see the class docstring)
            warnings.filterwarnings("ignore", message=".*[Ll]arge.*")
            futures = {
                self.client.submit(_guarded, fn, *args, key=f"{name}-{key}-{uuid.uuid4().hex[:8]}", pure=False,
                                   priority=self.priority): key
                for key, args in tasks.items()
            }
        errors = {}
        remaining = dict(futures)
        try:
            try:
                # as they finish: a slow or hung task never holds the others' results back
                for future in as_completed(list(futures), loop=self.client.loop, timeout=_left(deadline)):
                    key = remaining.pop(future)
                    try:
                        run.results[key] = future.result()
                    except Exception as error:
                        errors[key] = _describe(error)
            except TimeoutError:  # the deadline passed
                self.client.cancel(list(remaining))
                for key in remaining.values():
                    errors[key] = self._late()
                    timed_out.append(key)
        finally:
            for future in futures:
                future.release()
        return errors

    def close(self) -> None:
        self.client.close()


_cache: dict[tuple, Executor] = {}
_cache_lock = threading.Lock()


def forecast_deadline_s(settings) -> float:
    """The forecast job's deadline for its shards: ``forecast_deadline_intervals`` forecast intervals."""
    return settings.forecast_deadline_intervals * settings.forecast_interval_s


def _executor_key(settings, purpose: str) -> tuple:
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    deadline = forecast_deadline_s(settings) if purpose == FORECAST else None
    if settings.dask_scheduler_address:
        return ("dask", purpose, settings.dask_scheduler_address, settings.shard_retries, deadline)
    # the forecast job's shards leave this process even for one worker: only a worker process can be killed at the
    # deadline (a shard hung in a native call in this process would hang the job, and every later run, for good)
    if settings.shard_workers > 1 or (purpose == FORECAST and not settings.forecast_in_process):
        return ("pool", purpose, settings.shard_workers, settings.shard_retries, deadline)
    return ("inline", purpose, settings.shard_retries, deadline)


def new_executor(settings, purpose: str = BATCH) -> Executor:
    """A new executor of the settings for ``purpose`` (see :func:`executor_for`), not cached: its caller closes it."""
    key = _executor_key(settings, purpose)
    deadline = key[-1]
    if key[0] == "dask":
        return DaskExecutor(settings.dask_scheduler_address, settings.shard_retries, settings.dask_connect_timeout_s,
                            deadline_s=deadline, priority=FORECAST_DASK_PRIORITY if purpose == FORECAST else 0)
    if key[0] == "pool":
        return PoolExecutor(settings.shard_workers, settings.shard_retries, deadline_s=deadline,
                            niceness=BATCH_NICENESS if purpose == BATCH else 0)
    return InlineExecutor(settings.shard_retries, deadline_s=deadline)


@contextmanager
def job_executor(settings, purpose: str = BATCH) -> Iterator[Executor]:
    """A new executor (:func:`new_executor`) for one job, closed when the job ends.

    The nightly retrain and the backtests run on one of these: their pool's workers (each holding the shards it
    fitted or loaded, the champion's included) end with the job instead of staying for the process lifetime next
    to the forecast job's own pool, and two such jobs at once never close each other's pool.
    """
    executor = new_executor(settings, purpose)
    try:
        yield executor
    finally:
        executor.close()


def executor_for(settings, purpose: str = BATCH) -> Executor:
    """The executor the settings ask for, created once per process (and purpose) and reused.

    ``purpose="forecast"`` (the per-minute forecast job) gets executors of its own: a pool of its own (so its
    shards never wait behind a retrain's fits in the other pool's queue), a deadline of
    :func:`forecast_deadline_s` per run, and on Dask a higher task priority. Without Dask its shards run in worker
    processes even with ``shard_workers=1`` (a pool of one), which the deadline can kill; in this process only with
    ``forecast_in_process``, where a hung shard holds the job past its deadline. ``"batch"`` (retrain, backtests):
    no deadline, and on a pool workers that run at a lower CPU priority (:data:`BATCH_NICENESS`). The retrain and
    the backtest jobs do not keep theirs: they run on a :func:`job_executor`, closed when they end.
    """
    key = _executor_key(settings, purpose)
    with _cache_lock:
        executor = _cache.get(key)
        if executor is None:
            executor = _cache[key] = new_executor(settings, purpose)
        return executor


def close_executors() -> None:
    """Close every cached executor (end of a CLI command or a test)."""
    with _cache_lock:
        for executor in _cache.values():
            executor.close()
        _cache.clear()
