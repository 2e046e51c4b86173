"""API bearer tokens with scopes, hashed at rest.

Tokens are 32 random bytes (URL-safe text, prefixed ``pw_``), so a plain
SHA-256 is enough to store them: there is nothing to brute-force. The clear
token is shown once, when it is created.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import secrets
import select
import socket
import threading
from dataclasses import dataclass

import psycopg
from sqlalchemy import Engine, text

log = logging.getLogger(__name__)

SCOPES = ("read", "ingest", "admin")
TOKEN_PREFIX = "pw_"
#: PostgreSQL notification channel a revocation is announced on (``pg_notify`` in the revoking transaction).
REVOCATION_CHANNEL = "prewarm_token_revoked"


_revocations = itertools.count(1)
_generation = 0
_generation_lock = threading.Lock()


def revocation_generation() -> int:
    """A number that changes whenever this process revokes a token or hears of a revocation.

    The API keeps verified tokens for at most ``PREWARM_TOKEN_CACHE_S`` (1 s);
    an entry cached under an older generation is checked again, so a
    revocation made in the serving process counts for the very next request,
    and one made elsewhere as soon as its notification arrives
    (:class:`RevocationListener`, milliseconds).
    """
    return _generation


def _bump_generation() -> None:
    global _generation
    with _generation_lock:
        _generation = next(_revocations)


@dataclass(frozen=True)
class TokenInfo:
    name: str
    scopes: frozenset[str]


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(engine: Engine, *, name: str, scopes: list[str]) -> str:
    """Store a new token's hash; return the clear token (shown once).

    Raises:
        ValueError: an unknown scope, or a name already in use.
    """
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown or not scopes:
        raise ValueError(f"scopes must be some of {list(SCOPES)}, got {scopes}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with engine.begin() as conn:
        exists = conn.execute(text("SELECT 1 FROM api_tokens WHERE name = :n"), {"n": name}).first()
        if exists:
            raise ValueError(f"a token named {name!r} exists; revoke it first")
        conn.execute(
            text("INSERT INTO api_tokens (name, token_sha256, scopes) VALUES (:n, :h, :s)"),
            {"n": name, "h": hash_token(token), "s": sorted(set(scopes))},
        )
    return token


def revoke_in_database(engine: Engine, *, name: str) -> bool:
    """Mark the token revoked and announce it on :data:`REVOCATION_CHANNEL` (sent when the transaction commits).

    What :func:`revoke_token` does in the database; every serving process that
    listens drops its cached verifications when the notification arrives.
    """
    with engine.begin() as conn:
        result = conn.execute(text("UPDATE api_tokens SET revoked = true WHERE name = :n AND NOT revoked"),
                              {"n": name})
        conn.execute(text("SELECT pg_notify(:channel, :name)"), {"channel": REVOCATION_CHANNEL, "name": name})
    return result.rowcount == 1


def revoke_token(engine: Engine, *, name: str) -> bool:
    """Revoke the token called ``name``; True when one was active.

    Takes effect at once in this process; in every other serving process as
    soon as the notification reaches its :class:`RevocationListener`, and in
    any case within ``PREWARM_TOKEN_CACHE_S`` (at most 1 s).
    """
    revoked = revoke_in_database(engine, name=name)
    _bump_generation()
    return revoked


class RevocationListener:
    """A thread that LISTENs on :data:`REVOCATION_CHANNEL` and bumps :func:`revocation_generation` per notification.

    It holds one connection of its own (autocommit, outside the engine's pool).
    While that connection is down no notification can arrive, so the cache's
    time limit (``PREWARM_TOKEN_CACHE_S``) is the bound then; on reconnecting
    the generation is bumped once, for revocations that may have been missed.
    """

    def __init__(self, engine: Engine, *, retry_s: float = 1.0) -> None:
        self._engine = engine
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()  # stop() wakes the thread out of its wait at once
        self._thread: threading.Thread | None = None
        self.listening = threading.Event()  # set while LISTEN is in force (tests wait on it)

    def start(self) -> RevocationListener:
        self._thread = threading.Thread(target=self._run, name="token-revocations", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._wake_r.close()
        self._wake_w.close()

    def _connect(self) -> psycopg.Connection:
        args, kwargs = self._engine.dialect.create_connect_args(self._engine.url)
        return psycopg.connect(*args, **{"connect_timeout": 5, **kwargs}, autocommit=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._connect() as conn:
                    conn.execute(f"LISTEN {REVOCATION_CHANNEL}")
                    _bump_generation()  # whatever was revoked while not listening
                    self.listening.set()
                    while not self._stop.is_set():
                        readable, _, _ = select.select([conn.fileno(), self._wake_r], [], [], 60.0)
                        if self._wake_r in readable:
                            break
                        if not readable:
                            conn.execute("SELECT 1")  # a quiet minute: is the connection still there?
                        for _ in conn.notifies(timeout=0):
                            _bump_generation()
            except psycopg.Error as exc:
                self.listening.clear()
                log.warning("token revocations: not listening (%s); cached tokens expire after "
                            "PREWARM_TOKEN_CACHE_S meanwhile", exc)
                self._stop.wait(self._retry_s)
        self.listening.clear()


def lookup_token(engine: Engine, token: str) -> TokenInfo | None:
    """The token's name and scopes, or None if unknown or revoked."""
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT name, scopes FROM api_tokens WHERE token_sha256 = :h AND NOT revoked"),
            {"h": hash_token(token)},
        ).first()
    return None if row is None else TokenInfo(name=row[0], scopes=frozenset(row[1]))
