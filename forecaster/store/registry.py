"""The model registry's rows: one ``model_versions`` row per saved model, at most one champion per kind.

Kinds: ``forecast`` (the forecasting ensemble, see :mod:`forecaster.forecast.registry`) and ``latency`` (the
cold-start latency model, see :mod:`forecaster.coldstart.service`). The files of a version live under
``models/<version>/``; this module only keeps the rows (:mod:`forecaster.store.model_retention` deletes old
versions' folders and marks their rows ``deleted``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import Engine, text

KINDS = ("forecast", "latency")


@dataclass(frozen=True)
class VersionInfo:
    """One saved model version as the registry holds it."""

    id: str
    status: str
    path: Path
    train_start: datetime | None
    train_end: datetime | None
    scores: dict
    members: list
    kind: str = "forecast"
    #: Package version and commit of the code that trained it (None for rows written without one).
    code_version: str | None = None


def insert_version(engine: Engine, *, version_id: str, path: Path, status: str, train_start, train_end,
                   members: list, scores: dict, code_version: str, kind: str = "forecast") -> None:
    """Add one version row (``status``: challenger, champion, retired (a former champion), rejected (a challenger
    that lost), failed; the retention job marks old ones deleted)."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {KINDS}")
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO model_versions (id, status, path, train_start, train_end, members, scores, "
                 "code_version, kind) VALUES (:id, :st, :p, :ts, :te, CAST(:m AS jsonb), CAST(:s AS jsonb), :cv, "
                 ":kind)"),
            {"id": version_id, "st": status, "p": str(path), "ts": train_start, "te": train_end,
             "m": json.dumps(members), "s": json.dumps(scores, default=str), "cv": code_version, "kind": kind},
        )


def champion_version(engine: Engine, *, kind: str = "forecast") -> VersionInfo | None:
    """The champion of ``kind``, or None when none is saved yet (one index probe)."""
    with engine.connect() as conn:
        row = conn.execute(text("SELECT id, status, path, train_start, train_end, scores, members, kind, "
                                "code_version FROM model_versions WHERE status = 'champion' AND kind = :kind"),
                           {"kind": kind}).first()
    return None if row is None else VersionInfo(row[0], row[1], Path(row[2]), row[3], row[4], row[5], row[6],
                                                row[7], row[8])


def retired_versions(engine: Engine, *, kind: str = "forecast", limit: int = 3) -> list[VersionInfo]:
    """The newest former champions of ``kind`` (status ``retired``), newest first: the order in which
    :mod:`forecaster.store.model_retention` keeps the newest one's files."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, status, path, train_start, train_end, scores, members, kind, "
                                 "code_version FROM model_versions WHERE status = 'retired' AND kind = :kind "
                                 "ORDER BY created_at DESC, id DESC LIMIT :n"), {"kind": kind, "n": limit}).all()
    return [VersionInfo(r[0], r[1], Path(r[2]), r[3], r[4], r[5], r[6], r[7], r[8]) for r in rows]


def promote_version(engine: Engine, version_id: str) -> None:
    """Make ``version_id`` the champion of its kind and retire the previous one, in one transaction.

    A version whose files the retention job deleted (:mod:`forecaster.store.model_retention`: it marks the row
    ``deleted`` under a row lock while it moves the folder away), before or while this waits, raises
    ``LookupError`` and leaves the previous champion in place: a champion row never names a deleted folder, and
    a kind is never left without a champion.
    """
    with engine.begin() as conn:
        kind = conn.execute(text("SELECT kind FROM model_versions WHERE id = :id"), {"id": version_id}).scalar()
        if kind is None:
            raise LookupError(f"no model version {version_id!r}")
        conn.execute(text("UPDATE model_versions SET status = 'retired' WHERE status = 'champion' AND kind = :k"),
                     {"k": kind})
        promoted = conn.execute(text("UPDATE model_versions SET status = 'champion' WHERE id = :id "
                                     "AND status <> 'deleted'"), {"id": version_id}).rowcount
        if promoted != 1:
            raise LookupError(f"model version {version_id!r} is deleted (its files are gone)")


def set_version_status(engine: Engine, version_id: str, status: str) -> None:
    with engine.begin() as conn:
        conn.execute(text("UPDATE model_versions SET status = :st WHERE id = :id"), {"st": status, "id": version_id})
