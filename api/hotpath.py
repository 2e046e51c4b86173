"""The autoscalers' hot path: ``GET /v1/models/{id}/recommendation`` answered from prepared bytes, in pure ASGI.

KEDA polls each model's recommendation every 30 s: 3,333 requests a second
for 100,000 models, all asking what the snapshot already knows. FastAPI's
route costs far more than the answer (dependency solving, query validation,
the response model, the exception, telemetry and routing layers). The app
(:class:`api.main.PrewarmAPI`) offers each HTTP request to this hot path
before any of those layers; it answers a request itself only when all of
these hold, so that its answer is the one the route would give, byte for byte
(and times it into the same latency histogram, under the route's label):

* ``GET``, no query string (the default quantile), no ``root_path``, no body; the model id is what lies
  between ``/v1/models/`` and ``/recommendation`` in the decoded path, ``/`` included;
* an ``Authorization: Bearer`` token verified within ``PREWARM_TOKEN_CACHE_S``
  under the current revocation generation, with the ``read`` (or ``admin``)
  scope (:meth:`api.deps.TokenCache.read_allowed`);
* the snapshot refreshes in the background and holds a prepared body for
  the model (:mod:`api.prepared`).

Anything else (first use of a token, a revoked or unknown one, an unknown
model, a ``quantile``, refresh on every request) goes to the app as before,
which answers and fills the caches the next request reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime

PREFIX = "/v1/models/"
SUFFIX = "/recommendation"
RAW_SUFFIX = SUFFIX.encode("ascii")
ROUTE_PATH = PREFIX + "{model_id}" + SUFFIX


class RecommendationHotPath:
    """Answers what it can from ``state`` (the app's: snapshot, token cache, settings, clock, engine)."""

    def __init__(self, state, *, latency) -> None:
        self.state = state
        self.latency = latency  # the histogram child of (GET, ROUTE_PATH, 200)

    def _body(self, scope) -> bytes | None:
        path: str = scope["path"]
        if not (path.startswith(PREFIX) and path.endswith(SUFFIX)) or scope["method"] != "GET" \
                or scope.get("query_string") or scope.get("root_path"):
            return None
        # The id may hold '/' (org/name, sent as org%2Fname or as it is), as the route's does (api.model_routes);
        # a tail that came encoded (org%2Frecommendation) is part of an id: the catalogue route's, not this one's.
        raw = scope.get("raw_path")
        if raw is not None and not raw.endswith(RAW_SUFFIX):
            return None
        if "//" in path:  # an empty segment: no id when sent as such (api.model_routes); the app decides
            return None
        model_id = path[len(PREFIX):-len(SUFFIX)]
        if not model_id:
            return None
        state = self.state
        snapshot = state.snapshot
        if state.settings.api_snapshot_refresh_s == 0 or snapshot.newest_issued_at is None:
            return None
        prepared = snapshot.prepared.get(model_id)
        if prepared is None:
            return None
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if authorization is None:  # the first one, as Starlette's Headers.get reads it
                    authorization = value.decode("latin-1")
            elif name == b"content-length" or name == b"transfer-encoding":
                return None  # a GET with a body: the app's body limit decides (413 or not)
        if not state.token_cache.read_allowed(authorization, state.engine):
            return None
        clock: Callable[[], datetime] = state.clock
        return prepared.body(clock().timestamp(), not snapshot.healthy)

    async def answer(self, scope, send) -> bool:
        """Send the response and return True when this request is the hot path's; False: the app's."""
        started = time.perf_counter()
        body = self._body(scope)
        if body is None:
            return False
        # the headers Starlette's Response(media_type="application/json") sends, in its order
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        self.latency.observe(time.perf_counter() - started)
        return True
