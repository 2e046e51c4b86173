"""Per-model routes (``/v1/models/{model_id}...``) whose model id may hold ``/``.

Hugging Face ids are ``org/name`` (``meta-llama/Llama-3-8B``), and registration accepts them. A client sends
the id percent-encoded in the path (``meta-llama%2FLlama-3-8B``; ``%25``, ``%3F``, ``%23``, ``%20`` and UTF-8
likewise), but the server decodes ``%2F`` into ``/`` before any route sees the path, and a plain
``{model_id}`` matches one segment only: every per-model route answered 404 for such ids.

:class:`ModelIdRoute` matches ``{model_id}`` as one or more characters of the decoded path, ``/`` included,
with the route's fixed tail (``/forecast``, ``/series``...) after it, while the route's template, OpenAPI path,
operation id and latency label stay ``/v1/models/{model_id}/...``. Which route a path is for is decided by the
tail as it came over the wire (``raw_path``): ``/v1/models/org%2Fforecast`` is the model ``org/forecast``
itself, not the forecast of ``org``. An id sent with literal slashes (``/v1/models/org/name/forecast``) works
too; only there an id ending in a route's tail (``org/series``) is ambiguous, and the route with the tail wins:
encode the id to mean the model. The bare ``/v1/models/{model_id}`` routes must therefore be tried after the
routes with a tail (``api.main`` includes the catalogue's router last).
"""

from __future__ import annotations

import re

from fastapi.routing import APIRoute
from starlette._utils import get_route_path
from starlette.routing import Match
from starlette.types import Scope

PARAM = "{model_id}"


class ModelIdRoute(APIRoute):
    """An ``APIRoute`` whose ``{model_id}`` may span ``/``; routes without one match as any ``APIRoute``."""

    def __init__(self, path: str, endpoint, **kwargs) -> None:
        super().__init__(path, endpoint, **kwargs)
        self._any_id: re.Pattern[str] | None = None
        self._raw_tail = b""
        if PARAM in path:
            head, tail = path.split(PARAM, 1)
            self._any_id = re.compile(f"{re.escape(head)}(?P<model_id>.+){re.escape(tail)}", re.DOTALL)
            self._raw_tail = tail.encode("ascii")

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if self._any_id is None or scope["type"] != "http":
            return super().matches(scope)
        raw = scope.get("raw_path")
        if self._raw_tail and raw is not None and not raw.endswith(self._raw_tail):
            return Match.NONE, {}  # the tail was part of an encoded id (org%2Fforecast): another route's
        match, child_scope = super().matches(scope)  # an id without '/'
        if match is not Match.NONE:
            return match, child_scope
        found = self._any_id.fullmatch(get_route_path(scope))
        if found is None:
            return Match.NONE, {}
        child_scope = {"endpoint": self.endpoint, "route": self,
                       "path_params": {**scope.get("path_params", {}), "model_id": found["model_id"]}}
        if self.methods and scope["method"] not in self.methods:
            return Match.PARTIAL, child_scope
        return Match.FULL, child_scope
