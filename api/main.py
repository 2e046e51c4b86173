"""The REST API application (versioned under /v1, OpenAPI at /docs and /openapi.json)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone

from fastapi import FastAPI
from sqlalchemy import Engine

from api.cache import LastGood
from api.metrics import LatencyMiddleware, ServiceMetrics
from api.routes import audit, forecasts, health, ingest, models
from forecaster import __version__
from forecaster.settings import Settings


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def create_app(settings: Settings, engine: Engine, *, clock: Callable[[], datetime] = utc_now) -> FastAPI:
    """Build the app around an open engine; the caller owns the engine's life (and migrations)."""
    app = FastAPI(
        title="prewarm",
        version=__version__,
        description="Forecasts, replica recommendations and pre-warm actions for GPU inference fleets.",
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.clock = clock
    app.state.last_good = LastGood()
    app.state.token_cache = {}
    app.state.metrics = ServiceMetrics(engine, clock)
    app.add_middleware(LatencyMiddleware)
    for module in (health, models, forecasts, ingest, audit):
        app.include_router(module.router)
    return app
