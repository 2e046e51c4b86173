"""FastAPI dependencies as ``Annotated`` aliases: engine, settings, clock, and scoped bearer auth."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from forecaster.settings import Settings
from forecaster.store.tokens import TokenInfo, lookup_token, revocation_generation

_bearer = HTTPBearer(auto_error=False)

#: Longest bearer token looked up (ours are 46 characters); longer ones are refused without a query.
MAX_TOKEN_LENGTH = 512


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_clock(request: Request) -> Callable[[], datetime]:
    return request.app.state.clock


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
ClockDep = Annotated[Callable[[], datetime], Depends(get_clock)]


async def _authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None) -> TokenInfo:
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing bearer token",
                            headers={"WWW-Authenticate": "Bearer"})
    token = credentials.credentials
    if len(token) > MAX_TOKEN_LENGTH:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "unknown or revoked token",
                            headers={"WWW-Authenticate": "Bearer"})
    # Verified tokens are trusted for at most token_cache_s (<= 1 s): a revocation in another process counts
    # within that, one in this process at once (the generation changes).
    cache: dict[str, tuple[float, int, TokenInfo | None]] = request.app.state.token_cache
    ttl_s = request.app.state.settings.token_cache_s
    generation = revocation_generation()
    hit = cache.get(token)
    if hit is not None and hit[1] == generation and time.monotonic() - hit[0] < ttl_s:
        info = hit[2]
    else:
        try:
            info = await run_in_threadpool(lookup_token, request.app.state.engine, token)
        except OperationalError:
            if hit is not None and hit[1] == generation and hit[2] is not None:
                info = hit[2]  # database away: a token verified before, not revoked here since, still reads
            else:
                raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "cannot verify token: database unavailable",
                                    headers={"Retry-After": str(request.app.state.settings.ingest_retry_after_s)})
        if len(cache) > 10_000:
            cache.clear()  # bounded: unknown tokens sprayed at the API must not grow memory
        cache[token] = (time.monotonic(), generation, info)
    if info is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "unknown or revoked token",
                            headers={"WWW-Authenticate": "Bearer"})
    return info


def require(scope: str) -> Callable[..., TokenInfo]:
    """Dependency: a valid token holding ``scope`` (``admin`` holds every scope)."""

    async def dependency(request: Request,
                         credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> TokenInfo:
        # async: a cached token costs no thread hop; only a cache miss asks the database (in a thread)
        info = await _authenticate(request, credentials)
        if scope not in info.scopes and "admin" not in info.scopes:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"token {info.name!r} lacks scope {scope!r}")
        return info

    return dependency


ReadToken = Annotated[TokenInfo, Depends(require("read"))]
IngestToken = Annotated[TokenInfo, Depends(require("ingest"))]
AdminToken = Annotated[TokenInfo, Depends(require("admin"))]
