"""API bearer tokens with scopes, hashed at rest.

Tokens are 32 random bytes (URL-safe text, prefixed ``pw_``), so a plain
SHA-256 is enough to store them: there is nothing to brute-force. The clear
token is shown once, when it is created.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import threading
from dataclasses import dataclass

from sqlalchemy import Engine, text

SCOPES = ("read", "ingest", "admin")
TOKEN_PREFIX = "pw_"


_revocations = itertools.count(1)
_generation = 0
_generation_lock = threading.Lock()


def revocation_generation() -> int:
    """A number that changes whenever this process revokes a token.

    The API keeps verified tokens for at most ``PREWARM_TOKEN_CACHE_S`` (1 s);
    an entry cached under an older generation is checked again, so a
    revocation made in the serving process counts for the very next request.
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


def revoke_token(engine: Engine, *, name: str) -> bool:
    """Revoke the token called ``name``; True when one was active.

    Takes effect at once in this process and within ``PREWARM_TOKEN_CACHE_S``
    (at most 1 s) in every other serving process.
    """
    with engine.begin() as conn:
        result = conn.execute(text("UPDATE api_tokens SET revoked = true WHERE name = :n AND NOT revoked"),
                              {"n": name})
    _bump_generation()
    return result.rowcount == 1


def lookup_token(engine: Engine, token: str) -> TokenInfo | None:
    """The token's name and scopes, or None if unknown or revoked."""
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT name, scopes FROM api_tokens WHERE token_sha256 = :h AND NOT revoked"),
            {"h": hash_token(token)},
        ).first()
    return None if row is None else TokenInfo(name=row[0], scopes=frozenset(row[1]))
