"""What the API answers when a request is bad or the database is not there: never a 500.

* :class:`BodySizeLimit`: a body over ``PREWARM_API_MAX_BODY_BYTES`` is 413,
  before it is parsed (``Content-Length`` checked first, streamed bytes too).
* :class:`TextGuard`: NUL and other control characters, or lone surrogates,
  anywhere in the path or the query string are 422 before routing
  (PostgreSQL refuses NUL; UTF-8 refuses surrogates).
* :func:`install_error_handlers`: 422 bodies name the field (``loc``) and the
  reason without echoing the input (a 200,001-row batch came back as 14 MB,
  and NaN in it made the 422 itself fail to serialise); every database error
  becomes 503 with ``Retry-After`` when sending again may work, 422 when a
  value is out of the database's range, and a 503 that says it was not a
  transient outage otherwise (``out of shared memory`` is not "send it again").
"""

from __future__ import annotations

import logging
import math
import re
from urllib.parse import unquote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError

from forecaster.store.fields import safe_value
from forecaster.store.db import DatabaseUnavailable, is_transient, sqlstate_of

log = logging.getLogger(__name__)

#: At most this many validation errors are listed in one 422 (each names its location).
MAX_ERRORS_LISTED = 20
_BAD_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _plain(value: object) -> object:
    """A JSON-safe version of an error's context value (no NaN, no surrogates, short)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return safe_value(value, limit=200)


def _loc(loc: tuple) -> list:
    return [_plain(part) if isinstance(part, str) else part for part in loc]


def validation_problem(errors: list[dict]) -> dict:
    """The body of a 422 from pydantic errors: locations, messages and types, never the input."""
    listed = []
    for err in errors[:MAX_ERRORS_LISTED]:
        entry = {"loc": _loc(tuple(err.get("loc", ()))), "msg": _plain(str(err.get("msg", ""))),
                 "type": err.get("type")}
        listed.append(entry)
    first = listed[0] if listed else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(p) for p in first["loc"]) or "request"
    extra = [".".join(str(p) for p in e["loc"][1:]) for e in listed if e.get("type") == "extra_forbidden"]
    message = f"{where}: {first['msg']}"
    if extra:
        message = f"unknown field(s) {extra}; " + message
    row = next((p for p in first["loc"][2:3] if isinstance(p, int)), None)
    # ``detail`` keeps FastAPI's shape (a list of loc/msg/type), less the ``input`` it would echo
    return {"detail": listed, "message": message, "reason": "invalid_request", "error_count": len(errors),
            "unknown_fields": extra, "row": None if row is None else row + 1,
            "field": str(first["loc"][-1]) if first["loc"] else None}


def retry_after(request: Request) -> dict[str, str]:
    return {"Retry-After": str(request.app.state.settings.ingest_retry_after_s)}


def database_problem(request: Request, exc: BaseException) -> JSONResponse:
    """503 + Retry-After for an outage; 422 for a value the database refuses; a plain 503 otherwise."""
    if isinstance(exc, DatabaseUnavailable) or (isinstance(exc, DBAPIError) and is_transient(exc)):
        return JSONResponse({"detail": "database unavailable; nothing was changed, send it again",
                             "reason": "database_unavailable"}, status_code=503, headers=retry_after(request))
    sqlstate = sqlstate_of(exc)
    if sqlstate == "55P03":  # lock_timeout: another writer of the same models holds them
        return JSONResponse({"detail": "another write to these models is in progress; nothing was changed, send it "
                                       "again", "reason": "busy"}, status_code=503, headers=retry_after(request))
    if sqlstate.startswith("22"):  # data exception: out of range, NUL in text, bad encoding
        return JSONResponse({"detail": f"a value is out of the database's range (SQLSTATE {sqlstate})",
                             "reason": "value_out_of_range"}, status_code=422)
    log.error("database refused %s %s: SQLSTATE %s: %s", request.method, request.url.path, sqlstate or "-",
              getattr(exc, "orig", exc))
    return JSONResponse({"detail": f"the database refused this request (SQLSTATE {sqlstate or 'unknown'}); it is "
                                   "not an outage and sending it again will fail the same way",
                         "reason": "database_refused", "sqlstate": sqlstate or None}, status_code=503)


def install_error_handlers(app: FastAPI) -> None:
    """422 without echoes, and no database error ever a 500."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_problem(list(exc.errors())), status_code=422)

    @app.exception_handler(DBAPIError)
    async def _database(request: Request, exc: DBAPIError) -> JSONResponse:
        return database_problem(request, exc)

    @app.exception_handler(DatabaseUnavailable)
    async def _unavailable(request: Request, exc: DatabaseUnavailable) -> JSONResponse:
        return database_problem(request, exc)

    @app.exception_handler(UnicodeEncodeError)
    async def _unencodable(request: Request, exc: UnicodeEncodeError) -> JSONResponse:
        return JSONResponse({"detail": "text that is not valid Unicode (a lone surrogate?)",
                             "reason": "bad_text"}, status_code=422)


class BodySizeLimit:
    """Pure ASGI middleware: 413 for a request body over ``max_bytes`` (declared or streamed)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send) -> None:
        body = (b'{"detail":"request body larger than %d bytes (PREWARM_API_MAX_BODY_BYTES)",'
                b'"reason":"body_too_large"}' % self.max_bytes)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._reject(send)
                    return
        declared_length = any(name == b"content-length" for name, _ in scope.get("headers", ()))
        if declared_length:
            await self.app(scope, receive, send)  # the server frames the body by Content-Length, checked above
            return
        # Streamed (chunked) body: read it up to the limit before the app sees any of it, then replay it.
        messages = []
        seen = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await self._reject(send)
                return
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replayed_receive():
            try:
                return next(replay)
            except StopIteration:
                return await receive()

        await self.app(scope, replayed_receive, send)


class TextGuard:
    """Pure ASGI middleware: 422 for control characters or lone surrogates in the path or query string."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            raw_query = scope.get("query_string", b"").decode("latin-1")
            where = None
            raw_path = scope.get("raw_path") or b""
            try:
                unquote(raw_path.decode("latin-1"), errors="strict")  # percent-escapes must be UTF-8
            except UnicodeDecodeError:
                where = "path"
            if where is None and _BAD_TEXT.search(scope.get("path", "")):
                where = "path"
            else:
                query = unquote(raw_query.replace("+", " "), errors="surrogateescape")
                if _BAD_TEXT.search(query):
                    where = "query"
            if where is not None:
                body = (b'{"detail":"the %s holds a control character or invalid text","reason":"bad_text",'
                        b'"field":"%s"}' % (where.encode(), where.encode()))
                await send({"type": "http.response.start", "status": 422,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
