"""``job_runs``: one row per (job, slot), claimed before the job runs, so a slot never runs twice.

A claim names its process (``owner``, :func:`process_owner`) and holds a lease (``lease_expires_at``) that the
running process extends (:mod:`forecaster.jobs.runs`). A claim whose lease ran out, or whose process is known to be
gone, is dead: :func:`abandon_dead_claims` marks it ``abandoned``, :func:`claim_slot` may take its slot over, and
:data:`LATEST_JOB_RUNS_SQL` (``/metrics``) reports it as ``abandoned`` once its lease has run out.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Engine, inspect, text

#: A claim that died: its lease ran out or its process is gone (a status of ``job_runs``).
ABANDONED = "abandoned"

#: The names of the jobs with runs, one index probe each (a loose index scan over the primary key): the CTE
#: ``jobs(name)``, its last row NULL.
JOB_NAMES_CTE = """jobs AS (
    SELECT min(job_name) AS name FROM job_runs
    UNION ALL
    SELECT (SELECT min(job_name) FROM job_runs WHERE job_name > jobs.name) FROM jobs WHERE jobs.name IS NOT NULL)"""

#: Each job's newest run that is over: ``(job_name, status, seconds)``. A run is over when it finished, or when it
#: is still ``running`` past its lease (its process died or lost the database): that one reads ``abandoned``, its
#: seconds up to the lease's end, so the job-failing alert sees a job whose process was killed mid-run. A loose
#: index scan over the primary key ``(job_name, slot)`` (the job names one probe at a time, then each one's newest
#: such slot), so a scrape reads a handful of index entries however many runs are kept: the
#: ``DISTINCT ON (job_name)`` it replaces read every run (about 5,800 a day, kept PREWARM_JOB_RUNS_RETENTION_DAYS):
#: at 2,000,000 runs 2,122 ms a scrape against 1.2 ms (``bench/metrics_history.py``).
LATEST_JOB_RUNS_SQL = """
WITH RECURSIVE """ + JOB_NAMES_CTE + """
SELECT jobs.name, newest.status, newest.seconds FROM jobs CROSS JOIN LATERAL (
    SELECT CASE WHEN finished_at IS NULL THEN '""" + ABANDONED + """' ELSE status END AS status,
           EXTRACT(EPOCH FROM coalesce(finished_at, lease_expires_at) - started_at) AS seconds FROM job_runs
    WHERE job_name = jobs.name AND (finished_at IS NOT NULL OR lease_expires_at < now())
    ORDER BY slot DESC LIMIT 1) newest
ORDER BY jobs.name"""

_HOST = socket.gethostname()
_identity: dict[str, object] = {}


def process_owner() -> str:
    """``host:pid:token``, this process's name on its claims; the random token tells a restarted container's
    process from its previous life, which often had the same pid."""
    pid = os.getpid()
    if _identity.get("pid") != pid:  # a forked child is a process of its own
        _identity.update(pid=pid, owner=f"{_HOST}:{pid}:{secrets.token_hex(4)}")
    return str(_identity["owner"])


def owner_is_gone(owner: str | None, me: str | None = None) -> bool:
    """True when ``owner`` names a process of this host that no longer runs: its pid is ours (with another token:
    our previous life) or no process has it. False when it cannot tell (another host, no owner)."""
    me = me or process_owner()
    parts = (owner or "").rsplit(":", 2)
    host, pid, _ = me.rsplit(":", 2)
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit() or owner == me:
        return False
    if parts[1] == pid:
        return True
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it runs, as another user
        return False
    return False


def job_lock_key(job_name: str) -> int:
    """The key of ``job_name``'s session-level advisory lock (a signed 64-bit hash of the name)."""
    digest = hashlib.blake2b(f"prewarm.job:{job_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def try_job_lock(conn: Connection, job_name: str) -> bool:
    """Take ``job_name``'s session-level advisory lock on ``conn`` if no other session holds it (True)."""
    return bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": job_lock_key(job_name)}).scalar())


def release_job_lock(conn: Connection, job_name: str) -> None:
    """Let go of ``job_name``'s advisory lock held on ``conn`` at once (a closed session's backend lets go of its
    locks only as it exits, a little later)."""
    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": job_lock_key(job_name)})


def stored_scheduler_jobs(engine: Engine, table: str) -> list[tuple[str, bytes]]:
    """``(id, job_state)`` of every job in APScheduler's job store ``table``; none before its first start."""
    if not inspect(engine).has_table(table):
        return []
    with engine.connect() as conn:
        return [(r[0], r[1]) for r in conn.execute(text(f"SELECT id, job_state FROM {table}"))]


@dataclass(frozen=True)
class Claim:
    """A slot claimed: ``attempt`` 1 for a fresh one; above 1 when it was taken over from ``took_over`` (the dead
    claim's owner and status)."""

    attempt: int = 1
    took_over: str | None = None


def claim_slot(bind: Engine | Connection, job_name: str, slot: datetime, *, owner: str | None = None,
               lease_s: float = 86_400.0) -> Claim | None:
    """Record the start of ``job_name`` for ``slot``, owned by ``owner`` with a lease of ``lease_s`` seconds.

    A slot that finished, or whose claim is alive (running within its lease), is not claimed (None). A dead claim
    (``abandoned``, or ``running`` past its lease) is taken over: the row's owner, lease and start are this
    claim's, ``attempt`` counts one more and ``detail.took_over`` keeps what the dead claim said.
    """
    params = {"n": job_name, "s": slot, "o": owner, "lease": lease_s}
    with _transaction(bind) as conn:
        attempt = conn.execute(text(
            "INSERT INTO job_runs (job_name, slot, owner, lease_expires_at) "
            "VALUES (:n, :s, :o, now() + make_interval(secs => :lease)) ON CONFLICT DO NOTHING RETURNING attempt"),
            params).scalar()
        if attempt is not None:
            return Claim(attempt)
        taken = conn.execute(text(
            "UPDATE job_runs r SET owner = :o, lease_expires_at = now() + make_interval(secs => :lease), "
            "attempt = r.attempt + 1, started_at = now(), finished_at = NULL, status = 'running', "
            "detail = jsonb_build_object('took_over', jsonb_build_object('owner', old.owner, 'status', old.status, "
            "'started_at', old.started_at, 'lease_expires_at', old.lease_expires_at, 'detail', old.detail)) "
            "FROM (SELECT owner, status, started_at, lease_expires_at, detail FROM job_runs "
            "      WHERE job_name = :n AND slot = :s FOR UPDATE) old "
            "WHERE r.job_name = :n AND r.slot = :s "
            "AND (r.status = 'abandoned' OR (r.status = 'running' AND r.lease_expires_at < now())) "
            "RETURNING r.attempt, old.owner"), params).first()
    return None if taken is None else Claim(taken[0], taken[1] or "unknown")


def extend_lease(bind: Engine | Connection, job_name: str, slot: datetime, *, owner: str, lease_s: float) -> bool:
    """Push ``owner``'s claim's lease to ``lease_s`` seconds from now; False when the claim is no longer its own.

    A claim marked ``abandoned`` while its process lived (the process lost the database longer than its lease,
    and someone else took the job's lock) and not taken over yet is running again.
    """
    with _transaction(bind) as conn:
        return conn.execute(text(
            "UPDATE job_runs SET lease_expires_at = now() + make_interval(secs => :lease), status = 'running', "
            "finished_at = NULL WHERE job_name = :n AND slot = :s AND owner = :o AND status IN ('running', 'abandoned') "
            "RETURNING 1"), {"n": job_name, "s": slot, "o": owner, "lease": lease_s}).first() is not None


def finish_slot(bind: Engine | Connection, job_name: str, slot: datetime, *, status: str, detail: dict,
                owner: str | None = None, ended_s_ago: float = 0.0) -> bool:
    """Record the outcome of ``owner``'s run of ``slot``, which ended ``ended_s_ago`` seconds ago (an outcome kept
    in memory while the database was away); ``detail`` is added to what the claim recorded.

    False when the slot is no longer ``owner``'s (a process took it over after its lease ran out): that run's
    outcome stands.
    """
    with _transaction(bind) as conn:
        return conn.execute(text(
            "UPDATE job_runs SET status = :st, finished_at = now() - make_interval(secs => :ago), "
            "detail = detail || CAST(:d AS jsonb) "
            "WHERE job_name = :n AND slot = :s AND owner IS NOT DISTINCT FROM :o RETURNING 1"),
            {"st": status, "d": _json(detail), "n": job_name, "s": slot, "o": owner, "ago": max(ended_s_ago, 0.0)},
        ).first() is not None


def abandon_dead_claims(conn: Connection, job_name: str, *, owner: str) -> list[datetime]:
    """Mark ``abandoned`` the dead claims of ``job_name`` but ``owner``'s: past their lease, or of a process of
    this host that is gone (:func:`owner_is_gone`). The caller holds the job's advisory lock, so no claim it
    marks belongs to a process that runs the job now. Returns their slots.
    """
    claims = running_claims(conn, owner=owner, job_name=job_name).get(job_name, [])
    return abandon_claims(conn, job_name, [(slot, other) for slot, other, expired in claims
                                           if expired or owner_is_gone(other, owner)])


def abandon_claims(bind: Engine | Connection, job_name: str, claims: list[tuple[datetime, str | None]]
                   ) -> list[datetime]:
    """Mark ``abandoned`` these ``(slot, owner)`` claims of ``job_name`` that are still ``running`` and still
    that owner's (not taken over meanwhile); the slots marked. One past its lease finished when the lease ran
    out; another now."""
    marked = []
    with _transaction(bind) as conn:
        for slot, other in claims:
            if conn.execute(text(
                    "UPDATE job_runs SET status = 'abandoned', "
                    "finished_at = least(now(), coalesce(lease_expires_at, now())), "
                    "detail = detail || jsonb_build_object('abandoned', CASE WHEN lease_expires_at < now() "
                    "THEN 'its lease ran out' ELSE 'its process is gone' END) "
                    "WHERE job_name = :n AND slot = :s AND status = 'running' AND owner IS NOT DISTINCT FROM :o "
                    "RETURNING 1"), {"n": job_name, "s": slot, "o": other}).first():
                marked.append(slot)
    return marked


def running_claims(bind: Engine | Connection, *, owner: str, job_name: str | None = None
                   ) -> dict[str, list[tuple[datetime, str | None, bool]]]:
    """The claims still ``running`` but ``owner``'s, by job: ``(slot, owner, past its lease)`` (through the partial
    index ``job_runs_running``)."""
    with _transaction(bind) as conn:
        rows = conn.execute(text(
            "SELECT job_name, slot, owner, coalesce(lease_expires_at < now(), false) FROM job_runs "
            "WHERE status = 'running' AND owner IS DISTINCT FROM :o AND (job_name = :n OR CAST(:n AS text) IS NULL) "
            "ORDER BY job_name, slot"), {"o": owner, "n": job_name}).all()
    claims: dict[str, list[tuple[datetime, str | None, bool]]] = {}
    for name, slot, other, expired in rows:
        claims.setdefault(name, []).append((slot, other, expired))
    return claims


def job_lock_held(bind: Engine | Connection, job_name: str) -> bool:
    """Whether a session holds ``job_name``'s advisory lock in this database (read from ``pg_locks``, not taken).

    A bigint key shows as ``classid`` (its high 32 bits) and ``objid`` (its low 32 bits), ``objsubid`` 1."""
    with _transaction(bind) as conn:
        return bool(conn.execute(text(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND ((classid::bigint << 32) | objid::bigint) = :k)"), {"k": job_lock_key(job_name)}).scalar())


def live_claim_elsewhere(conn: Connection, job_name: str, *, owner: str) -> tuple[str, datetime] | None:
    """Another process's claim of ``job_name`` still within its lease (its owner and slot), or None.

    Such a process runs the job although it does not hold the job's lock (it lost its connection in an outage
    and has not taken the lock again yet). Claims without an owner (of a previous version) are not counted.
    """
    return conn.execute(text(
        "SELECT owner, slot FROM job_runs WHERE job_name = :n AND status = 'running' AND owner IS NOT NULL "
        "AND owner <> :o AND lease_expires_at > now() ORDER BY slot DESC LIMIT 1"),
        {"n": job_name, "o": owner}).first()


def last_ok_slot(engine: Engine, job_name: str) -> datetime | None:
    """The slot of ``job_name``'s newest successful run that did its work (None when there is none).

    A run whose detail says ``skipped`` (nothing it could do, e.g. a backend that cannot observe) does not count.
    One walk down the primary key ``(job_name, slot)`` from the newest slot.
    """
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT slot FROM job_runs WHERE job_name = :n AND status = 'ok' AND detail->'skipped' IS NULL "
                 "ORDER BY slot DESC LIMIT 1"),
            {"n": job_name},
        ).scalar()


class _transaction:
    """``engine.begin()`` for an engine; a connection as it is (its caller commits, or it autocommits)."""

    def __init__(self, bind: Engine | Connection) -> None:
        self._bind = bind
        self._context = None

    def __enter__(self) -> Connection:
        if isinstance(self._bind, Connection):
            return self._bind
        self._context = self._bind.begin()
        return self._context.__enter__()

    def __exit__(self, *exc):
        return None if self._context is None else self._context.__exit__(*exc)


def _json(detail: dict) -> str:
    return json.dumps(detail, default=str)
