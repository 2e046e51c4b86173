"""Several API worker processes on one port, each accepting on its own socket (``SO_REUSEPORT``).

uvicorn's own multi-worker mode binds one listening socket in its parent and lets every worker accept from it.
On uvloop a worker that wakes first accepts a whole burst of connections, and autoscalers (KEDA, HPA's
adapters, our own load generators) keep their connections open, so connections stay where they first landed:
``bench/api.py`` (10,000 models, 2 workers per server, ``wrk``) saw all 100 connections of a run on one worker of
the bare floor server and all 10 of another on one of prewarm's workers, the other worker idle, and the two
servers' capacity ratio swing between 0.6x and 1.3x from run to run on that alone. Here each worker binds its own
socket to the same address with ``SO_REUSEPORT``, and the kernel spreads new connections over the listening
sockets by a hash of their addresses.

The supervisor (:func:`serve_workers`) starts the workers as spawned processes, starts a new one when one exits
(after a back-off that doubles while workers die soon after their start, e.g. while the database is down),
stops when a worker cannot bind the port, and on SIGINT or SIGTERM asks every worker to shut down gracefully (the
same signal, uvicorn's handling), killing those still running after ``graceful_s``.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import signal
import socket
import sys
import threading
import time

log = logging.getLogger(__name__)

#: uvicorn's options for every prewarm API process: uvloop and httptools when installed (``uvicorn[standard]``),
#: no access log on the hot path. ``bench/asgi_floor.py`` serves the floor with the same ones.
SERVER_OPTIONS = {"log_level": "warning", "access_log": False, "loop": "auto", "http": "auto"}
BIND_FAILURE = 3  # a worker's exit status when it cannot bind (uvicorn's STARTUP_FAILURE): restarting cannot help
QUICK_EXIT_S = 10.0  # a worker that exits sooner than this after its start is restarted after a back-off
MAX_BACKOFF_S = 60.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` that other sockets of this user may bind too (``SO_REUSEPORT``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def supported() -> bool:
    """Whether this platform has ``SO_REUSEPORT`` (Linux, the BSDs, macOS; not Windows)."""
    return hasattr(socket, "SO_REUSEPORT")


def _check_port_free(host: str, port: int) -> None:
    """Fail fast, in the caller, when the port is taken: bound by another program, or already accepting (another
    ``SO_REUSEPORT`` server of this user, which a bind alone would not notice and would share the connections with).
    """
    try:
        reuse_port_socket(host, port).close()
    except OSError as error:
        raise OSError(error.errno, f"{host}:{port}: {error.strerror}") from error
    target = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    try:
        socket.create_connection((target, port), timeout=1.0).close()
    except OSError:
        return
    raise OSError(errno.EADDRINUSE, f"{host}:{port} already accepts connections (another server on this port?)")


def _run_worker(app: str, options: dict) -> None:
    """One worker process: its own socket, uvicorn's server on it (``app`` is a factory's import string)."""
    import uvicorn

    config = uvicorn.Config(app, factory=True, **options)
    try:
        sock = reuse_port_socket(config.host, config.port)
    except OSError as error:
        log.error("API worker cannot bind %s:%s: %s", config.host, config.port, error)
        sys.exit(BIND_FAILURE)
    uvicorn.Server(config).run(sockets=[sock])


def serve_workers(app: str, workers: int, options: dict, *, graceful_s: float = 30.0, check_s: float = 0.5,
                  shared_ports: tuple[int, ...] = ()) -> None:
    """Run ``workers`` processes of the app factory ``app`` on ``options['host']:options['port']`` until a signal.

    ``shared_ports``: other ports on the same host that every worker binds with ``SO_REUSEPORT`` itself (KEDA's
    gRPC scaler), checked here as the HTTP port is, so that a taken one fails before any worker starts.

    Raises:
        OSError: a port is taken (checked here before any worker starts).
        SystemExit: a worker could not bind the port later (another program took it).
    """
    for port in (options["port"], *shared_ports):
        _check_port_free(options["host"], port)
    context = multiprocessing.get_context("spawn")
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def start() -> tuple[multiprocessing.Process, float]:
        process = context.Process(target=_run_worker, args=(app, options), name="prewarm-api-worker", daemon=False)
        process.start()
        return process, time.monotonic()

    processes = [start() for _ in range(workers)]
    backoff = [0.0] * workers
    due: dict[int, float] = {}  # worker slot -> when to start its replacement
    bind_failed = False
    try:
        while not stop.wait(check_s):
            for slot, (process, started) in enumerate(processes):
                if slot in due:
                    if time.monotonic() >= due[slot]:
                        del due[slot]
                        processes[slot] = start()
                    continue
                if process.is_alive():
                    if time.monotonic() - started > QUICK_EXIT_S:
                        backoff[slot] = 0.0
                    continue
                if process.exitcode == BIND_FAILURE:
                    log.error("API worker %s could not bind the port; stopping", process.pid)
                    bind_failed = True
                    stop.set()
                    break
                quick = time.monotonic() - started < QUICK_EXIT_S
                backoff[slot] = min(MAX_BACKOFF_S, max(1.0, 2 * backoff[slot])) if quick else 0.0
                log.warning("API worker %s exited with status %s; starting another in %.0f s",
                            process.pid, process.exitcode, backoff[slot])
                due[slot] = time.monotonic() + backoff[slot]
    finally:
        running = [process for process, _ in processes if process.is_alive()]
        for process in running:
            process.terminate()  # SIGTERM: uvicorn finishes the requests in flight, then exits
        deadline = time.monotonic() + graceful_s
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if bind_failed:
        raise SystemExit(BIND_FAILURE)
