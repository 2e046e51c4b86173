"""FastAPI dependencies as ``Annotated`` aliases: engine, settings, clock, and scoped bearer auth."""

from __future__ import annotations

import asyncio
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
from forecaster.store.tokens import TokenInfo, hash_token, lookup_token, revocation_generation

_bearer = HTTPBearer(auto_error=False)

#: Longest bearer token looked up (ours are 46 characters); longer ones are refused without a query.
MAX_TOKEN_LENGTH = 512


class TokenCache:
    """Verified tokens by SHA-256 (the clear token is not kept), each trusted for at most ``ttl_s`` seconds.

    An entry counts only under the revocation generation it was verified in
    (:func:`~forecaster.store.tokens.revocation_generation`): a revocation in
    this process, or one announced by the database to its listener, makes every
    entry be checked again on its next use. Bounded: unknown tokens sprayed at
    the API cannot grow memory past ``max_entries``.
    """

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, int, TokenInfo | None]] = {}
        self._renewing: set[str] = set()

    def fresh(self, token_sha256: str) -> tuple[bool, TokenInfo | None]:
        """``(True, info)`` when verified within ``ttl_s`` under the current generation (info None: refused)."""
        hit = self._entries.get(token_sha256)
        if hit is not None and hit[1] == revocation_generation() and time.monotonic() - hit[0] < self.ttl_s:
            return True, hit[2]
        return False, None

    def renew_if_due(self, token: str, token_sha256: str, engine: Engine) -> None:
        """Verify a token again in a worker thread once half its time is up, while the entry still counts.

        A token in steady use (KEDA's, polled hundreds of times a second) then never expires under the
        requests: without this, every request arriving in the moment after expiry would ask the database
        at once. One renewal per token at a time; a failed one leaves the entry to expire as it would.
        """
        hit = self._entries.get(token_sha256)
        if hit is None or time.monotonic() - hit[0] < self.ttl_s / 2 or token_sha256 in self._renewing:
            return
        self._renewing.add(token_sha256)
        generation = revocation_generation()

        async def renew() -> None:
            try:
                self.put(token_sha256, generation, await run_in_threadpool(lookup_token, engine, token))
            except OperationalError:
                pass
            finally:
                self._renewing.discard(token_sha256)

        task = asyncio.get_running_loop().create_task(renew())
        _renewals.add(task)
        task.add_done_callback(_renewals.discard)

    def last_known(self, token_sha256: str) -> TokenInfo | None:
        """A token verified before and not revoked in this process since (for when the database is away)."""
        hit = self._entries.get(token_sha256)
        return hit[2] if hit is not None and hit[1] == revocation_generation() else None

    def put(self, token_sha256: str, generation: int, info: TokenInfo | None) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[token_sha256] = (time.monotonic(), generation, info)

    def read_allowed(self, authorization: str | None, engine: Engine) -> bool:
        """True when an ``Authorization`` header value holds a cached, valid token with the ``read`` scope.

        The hot path's check (:mod:`api.hotpath`, in the event loop): no database, no thread hop but a
        renewal in the background (:meth:`renew_if_due`). Anything else (no header, another scheme, an
        unknown, expired or refused token) answers False and the request takes the full path, which asks
        the database and says 401 or 403.
        """
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_LENGTH:
            return False
        digest = hash_token(token)
        ok, info = self.fresh(digest)
        if not (ok and info is not None and ("read" in info.scopes or "admin" in info.scopes)):
            return False
        self.renew_if_due(token, digest, engine)
        return True


#: Renewal tasks in flight (the event loop keeps only weak references to tasks).
_renewals: set = set()


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
    # Verified tokens are trusted for at most token_cache_s (<= 1 s): a revocation in this process counts at
    # once (the generation changes), one in another process when its notification arrives, or within that.
    cache: TokenCache = request.app.state.token_cache
    digest = hash_token(token)
    ok, info = cache.fresh(digest)
    if not ok:
        generation = revocation_generation()
        try:
            info = await run_in_threadpool(lookup_token, request.app.state.engine, token)
        except OperationalError:
            info = cache.last_known(digest)  # database away: a token verified before, not revoked since, reads
            if info is None:
                raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "cannot verify token: database unavailable",
                                    headers={"Retry-After": str(request.app.state.settings.ingest_retry_after_s)})
        cache.put(digest, generation, info)
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
