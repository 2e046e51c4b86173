"""Per-model routes (``/v1/models/{model_id}...``) whose model id may hold ``/``.

Hugging Face ids are ``org/name`` (``meta-llama/Llama-3-8B``), and registration accepts them. A client sends
the id percent-encoded in the path (``meta-llama%2FLlama-3-8B``; ``%25``, ``%3F``, ``%23``, ``%20`` and UTF-8
likewise), but the server decodes ``%2F`` into ``/`` before any route sees the path, and a plain
``{model_id}`` matches one segment only: every per-model route answered 404 for such ids.

:class:`ModelIdRoute` matches ``{model_id}`` as one or more characters of the decoded path, ``/`` included,
with the route's fixed tail (``/forecast``, ``/series``...) after it, while the route's template, OpenAPI path,
operation id and latency label stay ``/v1/models/{model_id}/...``. Which route a path is for is decided by the
tail as it came over the wire (``raw_path``): the tail is the path's last segments as split at the slashes
sent literally, so ``/v1/models/org%2Fforecast`` is the model ``org/forecast`` itself, not the forecast of
``org``. An id sent with literal slashes (``/v1/models/org/name/forecast``) works too; only there an id ending
in a route's tail (``org/series``) is ambiguous, and the route with the tail wins: encode the id to mean the
model.

The route with the tail wins for every method, not only for the ones it serves: a route without a tail (the
catalogue's ``GET``/``PUT /v1/models/{model_id}``) refuses a path whose literal tail is any per-model route's
tail (each such route adds its tail to :data:`TAILS` as it is made, so none is listed by hand), so
``PUT /v1/models/llama/forecast`` is a 405 from the forecast route, not a model ``llama/forecast`` registered
(a full match would beat the forecast route's partial one); ``PUT /v1/models/llama%2Fforecast`` registers it.
The bare routes are still included last (``api.main``), which keeps the order plain. A path with an empty
segment sent as such (``/v1/models/llama/forecast/``, ``/v1/models/a//b``) holds no id with ``/`` either: that
would register ``llama/forecast/`` (or, through the trailing-slash redirect, ``/forecast/`` for
``/v1/models//forecast``); encoded (``%2F%2F``), such an id is taken.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_to_bytes

from fastapi.routing import APIRoute
from starlette._utils import get_route_path
from starlette.routing import Match
from starlette.types import Scope

PARAM = "{model_id}"

#: The tail of every per-model route made (``/v1/models/`` -> {("forecast",), ("series",)...}), as it is made:
#: the routes with no tail under the same head refuse those tails (:meth:`ModelIdRoute._refused`).
TAILS: dict[str, set[tuple[str, ...]]] = {}


def _literal_tail_is(raw: bytes | None, path: str, segments: tuple[str, ...]) -> bool:
    """Whether the path's tail, split at the slashes sent literally, is ``segments`` (``("forecast",)``).

    Without ``raw_path`` (a server that does not keep it) the decoded path is all there is.
    """
    if raw is None:
        return path.endswith("/" + "/".join(segments))
    parts = raw.split(b"/")
    if len(parts) <= len(segments) + 1:
        return False
    return all(unquote_to_bytes(part) == segment.encode("utf-8")
               for part, segment in zip(parts[-len(segments):], segments))


class ModelIdRoute(APIRoute):
    """An ``APIRoute`` whose ``{model_id}`` may span ``/``; routes without one match as any ``APIRoute``."""

    def __init__(self, path: str, endpoint, **kwargs) -> None:
        super().__init__(path, endpoint, **kwargs)
        self._any_id: re.Pattern[str] | None = None
        self._head = ""
        self._tail_segments: tuple[str, ...] = ()
        if PARAM in path:
            head, tail = path.split(PARAM, 1)
            self._any_id = re.compile(f"{re.escape(head)}(?P<model_id>.+){re.escape(tail)}", re.DOTALL)
            self._head = head
            self._tail_segments = tuple(tail.split("/")[1:]) if tail else ()
            if self._tail_segments:
                TAILS.setdefault(head, set()).add(self._tail_segments)

    def _refused(self, scope: Scope) -> bool:
        """Whether the path's tail as sent says it is another route's (or, for a tail, not this one's)."""
        raw = scope.get("raw_path")
        if self._tail_segments:  # the tail was part of an encoded id (org%2Fforecast): another route's
            return not _literal_tail_is(raw, get_route_path(scope), self._tail_segments)
        path = get_route_path(scope)
        if not path.startswith(self._head):
            return False
        after_head = path[len(self._head):]  # the tail's slash must follow the head's: /v1/models/forecast is an id
        return any(after_head.endswith("/" + "/".join(segments)) and _literal_tail_is(raw, path, segments)
                   for segments in TAILS.get(self._head, ()))

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if self._any_id is None or scope["type"] != "http":
            return super().matches(scope)
        if self._refused(scope):
            return Match.NONE, {}
        match, child_scope = super().matches(scope)  # an id without '/'
        if match is not Match.NONE:
            return match, child_scope
        path = get_route_path(scope)
        found = self._any_id.fullmatch(path)
        if found is None:
            return Match.NONE, {}
        literal = scope.get("raw_path") or path.encode("utf-8")
        if b"//" in literal or literal.endswith(b"/"):
            return Match.NONE, {}  # an empty segment sent as such (a//b, a/) is no part of an id; %2F%2F is
        child_scope = {"endpoint": self.endpoint, "route": self,
                       "path_params": {**scope.get("path_params", {}), "model_id": found["model_id"]}}
        if self.methods and scope["method"] not in self.methods:
            return Match.PARTIAL, child_scope
        return Match.FULL, child_scope
