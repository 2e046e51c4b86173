"""The REST API application (versioned under /v1, OpenAPI at /docs and /openapi.json)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from datetime import datetime, timezone

from fastapi import FastAPI
from sqlalchemy import Engine

from api.cache import LastGood
from api.errors import BodySizeLimit, TextGuard, install_error_handlers
from api.metrics import LatencyMiddleware, ServiceMetrics
from api.snapshot import ForecastSnapshot
from api.routes import audit, coldstart, dashboard, forecasts, health, ingest, models, replays
from forecaster import __version__
from forecaster.settings import Settings


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def create_app(settings: Settings, engine: Engine, *, clock: Callable[[], datetime] = utc_now) -> FastAPI:
    """Build the app around an open engine; the caller owns the engine's life (and migrations)."""
    snapshot = ForecastSnapshot(engine, refresh_s=settings.api_snapshot_refresh_s, settings=settings, clock=clock)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stop = threading.Event()
        refresher = None
        if settings.api_snapshot_refresh_s > 0:
            def refresh_forever() -> None:
                while not stop.is_set():
                    snapshot.refresh()
                    stop.wait(settings.api_snapshot_refresh_s)

            refresher = threading.Thread(target=refresh_forever, name="forecast-snapshot", daemon=True)
            refresher.start()
        scaler = None
        try:
            if settings.keda_grpc_port is not None:  # KEDA's external scaler beside REST, on the same snapshot
                from api.keda_scaler import KedaScalerServer

                scaler = KedaScalerServer(snapshot, settings, clock, host=settings.api_host,
                                          port=settings.keda_grpc_port)
                app.state.keda_scaler = scaler
                scaler.start()
            yield
        finally:
            if scaler is not None:
                scaler.stop()
            stop.set()
            if refresher is not None:
                refresher.join(timeout=5)

    app = FastAPI(
        lifespan=lifespan,
        title="prewarm",
        version=__version__,
        description="Forecasts, replica recommendations and pre-warm actions for GPU inference fleets.",
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.clock = clock
    app.state.last_good = LastGood()
    app.state.snapshot = snapshot
    app.state.token_cache = {}
    app.state.metrics = ServiceMetrics(engine, clock, snapshot, settings)
    app.add_middleware(TextGuard)
    app.add_middleware(BodySizeLimit, max_bytes=settings.api_max_body_bytes)
    app.add_middleware(LatencyMiddleware)  # outermost: it also counts what the guards refuse
    install_error_handlers(app)
    for module in (health, models, forecasts, ingest, audit, dashboard, replays, coldstart):
        app.include_router(module.router)
    app.mount("/dashboard", dashboard.static_files(), name="dashboard")
    return app
