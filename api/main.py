"""The REST API application (versioned under /v1, OpenAPI at /docs and /openapi.json)."""

from __future__ import annotations

import gc
import logging
import sys
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from datetime import datetime, timezone

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Engine

from api.cache import LastGood
from api.deps import TokenCache
from api.errors import BodySizeLimit, TextGuard, install_error_handlers
from api.hotpath import ROUTE_PATH, RecommendationHotPath
from api.metrics import LatencyMiddleware, ServiceMetrics
from api.snapshot import ForecastSnapshot
from api.routes import audit, coldstart, dashboard, forecasts, health, ingest, models, replays
from forecaster import __version__
from forecaster.settings import Settings
from forecaster.store.db import make_engine
from forecaster.store.tokens import RevocationListener


log = logging.getLogger(__name__)

#: Seconds a thread holding the GIL keeps it while another waits, in a serving process with a refresher.
SWITCH_INTERVAL_S = 0.001


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class PrewarmAPI(FastAPI):
    """FastAPI, with the autoscalers' hot path (:mod:`api.hotpath`) offered each HTTP request first."""

    hot_path: RecommendationHotPath | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.hot_path is not None and await self.hot_path.answer(scope, send):
            return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings, engine: Engine, *, clock: Callable[[], datetime] = utc_now,
               owns_engine: bool = False, shared_port: bool = False,
               scheduler_health: Callable[[], tuple[bool, dict]] | None = None) -> FastAPI:
    """Build the app around an open engine; the caller owns the engine's life (and migrations) unless ``owns_engine``.

    At start-up the app listens for token revocations (:class:`~forecaster.store.tokens.RevocationListener`)
    and, with a background refresh (``PREWARM_API_SNAPSHOT_REFRESH_S`` > 0), loads the forecast snapshot before
    it takes requests, so that a new worker process answers from memory from its first request.

    With ``PREWARM_KEDA_GRPC_PORT`` set it also serves KEDA's external scaler, on ``settings.api_host`` (``prewarm
    serve`` sets it to the address it binds for HTTP). ``shared_port``: this app is one of several worker processes
    on the same ports, so the scaler binds its port with ``SO_REUSEPORT`` as the worker binds HTTP's.

    ``scheduler_health``: in a process that runs the scheduler (``prewarm serve --scheduler``), its heartbeat's
    check (:mod:`forecaster.jobs.heartbeat`); ``/healthz`` then fails when the scheduler's loop has ended or is stuck.
    """
    snapshot = ForecastSnapshot(engine, refresh_s=settings.api_snapshot_refresh_s, settings=settings, clock=clock)

    held = {"prepared": None}

    def refresh_and_freeze() -> None:
        """Refresh; when the snapshot was rebuilt, move what is alive now out of the cyclic GC's sight.

        At 100,000 models the snapshot is about a million tracked objects that live until the next run
        lands; a full collection walking them all stalled the event loop for well over 100 ms. The young
        generations are collected first, so what is frozen is what is in use.
        """
        snapshot.refresh()
        if snapshot.prepared is not held["prepared"]:
            held["prepared"] = snapshot.prepared
            gc.collect(1)
            gc.freeze()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stop = threading.Event()
        refresher = None
        listener = app.state.revocations = RevocationListener(engine).start()
        if settings.api_snapshot_refresh_s > 0:
            await run_in_threadpool(refresh_and_freeze)
            # The refresher thread holds the GIL for up to a second or so when a fleet's run lands; a shorter
            # switch interval (default 5 ms) bounds what each hand-back to the event loop's thread waits.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

            def refresh_forever() -> None:
                # nothing may end this loop but stop: a refresh that raised would leave the snapshot frozen
                # (every recommendation forecast_stale) until the process restarts
                while not stop.wait(settings.api_snapshot_refresh_s):
                    try:
                        refresh_and_freeze()
                    except Exception:  # noqa: BLE001 - logged; the next round tries again
                        snapshot.healthy = False
                        log.exception("forecast snapshot refresher: refresh failed; retrying in %g s",
                                      settings.api_snapshot_refresh_s)

            refresher = threading.Thread(target=refresh_forever, name="forecast-snapshot", daemon=True)
            refresher.start()
        scaler = None
        try:
            if settings.keda_grpc_port is not None:  # KEDA's external scaler beside REST, on the same snapshot
                from api.keda_scaler import KedaScalerServer

                scaler = KedaScalerServer(snapshot, settings, clock, host=settings.api_host,
                                          port=settings.keda_grpc_port, reuse_port=shared_port)
                app.state.keda_scaler = scaler
                scaler.start()
            yield
        finally:
            if scaler is not None:
                scaler.stop()
            stop.set()
            listener.stop()
            if refresher is not None:
                refresher.join(timeout=5)
            if owns_engine:
                engine.dispose()

    app = PrewarmAPI(
        lifespan=lifespan,
        title="prewarm",
        version=__version__,
        description="Forecasts, replica recommendations and pre-warm actions for GPU inference fleets.",
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.clock = clock
    app.state.scheduler_health = scheduler_health
    app.state.last_good = LastGood()
    app.state.snapshot = snapshot
    app.state.token_cache = TokenCache(settings.token_cache_s)
    app.state.metrics = ServiceMetrics(engine, clock, snapshot, settings)
    app.add_middleware(TextGuard)
    app.add_middleware(BodySizeLimit, max_bytes=settings.api_max_body_bytes)
    app.add_middleware(LatencyMiddleware)  # outermost: it also counts what the guards refuse
    install_error_handlers(app)
    # The catalogue's bare /v1/models/{model_id} last: its id may hold '/', so tried first it would take
    # /v1/models/{id}/forecast and the other per-model routes as ids (api.model_routes).
    for module in (health, forecasts, ingest, audit, dashboard, replays, coldstart, models):
        app.include_router(module.router)
    app.mount("/dashboard", dashboard.static_files(), name="dashboard")
    app.hot_path = RecommendationHotPath(
        app.state, latency=app.state.metrics.request_seconds.labels("GET", ROUTE_PATH, "200"))
    return app


def app_from_environment() -> FastAPI:
    """The app of one ``prewarm serve`` worker process (``PREWARM_API_WORKERS`` > 1), as a uvicorn factory.

    Each worker opens its own engine from the environment (the parent process exported ``DATABASE_URL`` and
    ``PREWARM_API_HOST``, and ran the migrations) and loads its own forecast snapshot at start-up. Its KEDA scaler,
    when one is served, shares the gRPC port with the other workers' (``SO_REUSEPORT``), as HTTP's is shared. When
    the parent runs the scheduler it names its heartbeat file (``PREWARM_SCHEDULER_HEARTBEAT_FILE``), which the
    worker's ``/healthz`` checks.
    """
    import os
    from functools import partial
    from pathlib import Path

    from forecaster.jobs.heartbeat import HEARTBEAT_FILE_ENV, file_health

    settings = Settings()
    if settings.database_url is None:
        raise RuntimeError("a worker process needs DATABASE_URL (prewarm serve sets it for its workers)")
    heartbeat_file = os.environ.get(HEARTBEAT_FILE_ENV)
    return create_app(settings, make_engine(settings.database_url), owns_engine=True, shared_port=True,
                      scheduler_health=partial(file_health, Path(heartbeat_file)) if heartbeat_file else None)
