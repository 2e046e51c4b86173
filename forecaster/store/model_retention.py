"""Retention of saved model versions: the ``models/<version>/`` folders (their ``model_versions`` rows stay).

Every nightly retrain saves a forecasting challenger, promoted or not (each pickles its fit panel: about 94 KB
per series), and a latency model; nothing else ever deletes one. The hourly retention job deletes a version's
folder and marks its row ``deleted`` when all of these hold:

* it is not the champion of its kind, nor the newest ``retired`` one of its kind (the champion before the
  current one: the forecast job keeps forecasting with it, from memory and its shard files, while a new champion
  cannot be loaded; a challenger that lost is ``rejected``, not ``retired``);
* its row is older than ``PREWARM_MODEL_VERSIONS_RETENTION_DAYS`` (``created_at``, against the job's ``now``: a
  clock that has not reached it, as in a replay, deletes nothing);
* it is not among the newest ``PREWARM_MODEL_VERSIONS_KEPT`` of its kind (what a rollback would promote);
* its row names a folder directly in ``models_dir`` (or a folder already gone): a path elsewhere is not this
  job's to delete.

The row stays, with status ``deleted``: stored forecasts name their version (a foreign key), and deleting the row
would have PostgreSQL check that key across every forecast partition (``forecasts`` has no index on
``model_version_id``: at 100,000 models a scan of days of forecasts per version). A row is a few hundred bytes.

Crash safety, per version: one transaction locks the row (still not the champion), marks it ``deleted`` and
renames the folder into ``models_dir/.trash/<version>`` before it commits; the trash entry is removed after the
commit. A crash or a failed commit leaves at most a trash entry, which the next run resolves first
(:func:`sweep_trash`): its row ``deleted``, it is removed; not (the mark never committed), it is renamed back. A
champion row never names a missing folder: :func:`~forecaster.store.registry.promote_version` refuses a version
marked deleted while it waited for the lock.

Leftovers of saves that never finished (:func:`sweep_leftovers`), each only once nothing in it has changed for
:data:`LEFTOVER_AGE_S` (wall clock: a save in progress, or a retrain registering the folder it has just published,
is never touched) and only under a name the registry gives (:data:`VERSION_NAME`, :data:`STAGING_NAME`; anything
else in ``models_dir`` is left alone):

* a staging folder ``.<version>.partial`` (forecast or latency model) that a killed save left (a failed save
  removes its own);
* a version folder that no ``model_versions`` row names, whatever its status (published, then the process was
  killed or the database was away before the row was written; a retrain whose ``register`` raises removes its
  own): nothing will ever load or delete it. It goes through the trash like a pruned version.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, text

from forecaster.store.files import fsync_path

log = logging.getLogger(__name__)

#: Folder under ``models_dir`` a version's folder is moved into before its row's delete commits.
TRASH_DIR = ".trash"
#: Seconds a run spends deleting before it leaves the rest to the next run.
RUN_BUDGET_S = 300.0
#: The name of a version folder the registry writes: a forecasting version (``<YYYYmmddTHHMM>-<6 hex>``,
#: :func:`~forecaster.jobs.forecasting.retrain_job`) or a latency model's (``latency-`` before it).
VERSION_NAME = re.compile(r"(?:latency-)?\d{8}T\d{4}-[0-9a-f]{6}")
#: The staging folder a version is written into before it is renamed into place.
STAGING_NAME = re.compile(r"\.(?:latency-)?\d{8}T\d{4}-[0-9a-f]{6}\.partial")
#: Seconds since anything in a leftover last changed before :func:`sweep_leftovers` removes it.
LEFTOVER_AGE_S = 86400.0


@dataclass
class PrunedVersions:
    """What one run did: versions deleted, and why the other old ones stayed."""

    deleted: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)  # folder outside models_dir: left alone
    failed: list[str] = field(default_factory=list)  # the folder could not be moved (logged); tried next run
    trash_removed: int = 0  # leftovers of an interrupted run removed
    trash_restored: int = 0  # folders of an interrupted run put back (their delete never committed)
    partial_removed: list[str] = field(default_factory=list)  # staging folders a killed save left
    orphans_removed: list[str] = field(default_factory=list)  # version folders no row names
    more: bool = False  # the budget ran out; the rest next run


def prune_model_versions(engine: Engine, models_dir: str | Path, *, now: datetime, retention_days: int, kept: int,
                         budget_s: float = RUN_BUDGET_S) -> dict:
    """Delete the model versions past retention (module docstring), folder and row; returns :class:`PrunedVersions`
    as a dict."""
    if retention_days < 1 or kept < 1:
        raise ValueError(f"retention_days and kept must be at least 1, got {retention_days} and {kept}")
    deadline = time.monotonic() + budget_s
    models_dir = Path(models_dir)
    result = PrunedVersions()
    result.trash_removed, result.trash_restored = sweep_trash(engine, models_dir)
    result.partial_removed, result.orphans_removed = sweep_leftovers(engine, models_dir)
    with engine.connect() as conn:
        candidates = conn.execute(text(
            "SELECT id, path FROM (SELECT id, path, status, created_at, "
            "row_number() OVER (PARTITION BY kind ORDER BY created_at DESC, id DESC) AS newest, "
            "row_number() OVER (PARTITION BY kind, status ORDER BY created_at DESC, id DESC) AS newest_of_status "
            "FROM model_versions WHERE status <> 'deleted') v "
            "WHERE newest > :kept AND status <> 'champion' AND NOT (status = 'retired' AND newest_of_status = 1) "
            "AND created_at < :before ORDER BY created_at, id"),
            {"kept": kept, "before": now - timedelta(days=retention_days)}).all()
    for version_id, path in candidates:
        if time.monotonic() > deadline:
            result.more = True
            break
        folder = Path(path)
        if not _owned(models_dir, version_id, folder):
            result.elsewhere.append(version_id)
            continue
        outcome = _delete_version(engine, models_dir, version_id, folder)
        if outcome is not None:
            getattr(result, outcome).append(version_id)
    if result.deleted:
        log.info("retention: deleted the files of %d model versions older than %d days (%s)",
                 len(result.deleted), retention_days, ", ".join(result.deleted))
    return asdict(result)


def sweep_trash(engine: Engine, models_dir: Path) -> tuple[int, int]:
    """Resolve what an interrupted run left in the trash: remove entries whose row is marked deleted (or gone), put
    back those whose row is not (the mark never committed). An entry whose row another run holds locked is its
    business.

    Returns:
        (entries removed, entries restored).
    """
    trash = Path(models_dir) / TRASH_DIR
    try:
        entries = sorted(trash.iterdir())
    except FileNotFoundError:
        return 0, 0
    removed = restored = 0
    for entry in entries:
        with engine.begin() as conn:
            path = conn.execute(text("SELECT path FROM model_versions WHERE id = :id AND status <> 'deleted'"),
                                {"id": entry.name}).scalar()
            if path is not None:
                mine = conn.execute(text("SELECT path FROM model_versions WHERE id = :id AND status <> 'deleted' "
                                         "FOR UPDATE SKIP LOCKED"), {"id": entry.name}).scalar()
                if mine is None or Path(path).exists():
                    continue  # being deleted by another run; or its folder is back already (left for a person)
                try:
                    os.rename(entry, path)
                except OSError as error:
                    log.error("retention: model version %s could not be put back from %s (%s)", entry.name, entry,
                              error)
                    continue
                restored += 1
                log.warning("retention: model version %s put back from the trash (its deletion did not commit)",
                            entry.name)
                continue
        _remove(entry)
        removed += 1
    return removed, restored


def sweep_leftovers(engine: Engine, models_dir: Path, *, min_age_s: float | None = None,
                    clock=time.time) -> tuple[list[str], list[str]]:
    """Remove the staging folders of saves that never finished and the version folders no row names (module
    docstring), each only when nothing in it changed for ``min_age_s`` (default :data:`LEFTOVER_AGE_S`;
    ``clock``: the wall clock, as the files' times are).

    Returns:
        (staging folders removed, version folders removed), by name.
    """
    models_dir = Path(models_dir)
    try:
        entries = sorted(models_dir.iterdir())
    except FileNotFoundError:
        return [], []
    now = clock()
    min_age_s = LEFTOVER_AGE_S if min_age_s is None else min_age_s

    def stale(entry: Path) -> bool:
        return entry.is_dir() and not entry.is_symlink() and now - _last_change(entry) >= min_age_s

    partial = [entry for entry in entries if STAGING_NAME.fullmatch(entry.name) and stale(entry)]
    for entry in partial:
        shutil.rmtree(entry, ignore_errors=True)
    if partial:
        log.warning("retention: removed %d staging folders of model saves that never finished (%s)", len(partial),
                    ", ".join(entry.name for entry in partial))
    folders = [entry for entry in entries if VERSION_NAME.fullmatch(entry.name) and stale(entry)]
    orphans = []
    if folders:
        with engine.connect() as conn:
            named = set(conn.execute(text("SELECT id FROM model_versions WHERE id = ANY(:ids)"),
                                     {"ids": [entry.name for entry in folders]}).scalars())
        for folder in folders:
            if folder.name in named:
                continue
            entry = models_dir / TRASH_DIR / folder.name
            try:
                entry.parent.mkdir(exist_ok=True)
                os.rename(folder, entry)
            except OSError as error:
                log.error("retention: orphaned model folder %s could not be moved to the trash (%s)", folder, error)
                continue
            _remove(entry)  # no row: the next run's sweep_trash removes what stays
            orphans.append(folder.name)
        if orphans:
            log.warning("retention: removed %d model version folders that no model_versions row names (a save "
                        "whose registration never happened: %s)", len(orphans), ", ".join(orphans))
    return [entry.name for entry in partial], orphans


def _last_change(folder: Path) -> float:
    """The newest modification or status change of ``folder`` and of everything under it (a rename changes the
    renamed folder's ctime: a version published a moment ago is new however old its files)."""
    newest = 0.0
    for root, dirs, files in os.walk(folder):
        for name in [".", *dirs, *files]:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            newest = max(newest, st.st_mtime, st.st_ctime)
    return newest


def _remove(entry: Path) -> None:
    """Remove a trash entry, folder or file; what cannot be removed stays for the next run."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def _owned(models_dir: Path, version_id: str, folder: Path) -> bool:
    """Whether ``folder`` is a version folder this job may delete: directly in ``models_dir``, not hidden, and the
    version id usable as a trash entry's name."""
    if not version_id or "/" in version_id or version_id.startswith(".") or folder.name.startswith("."):
        return False
    return folder.resolve().parent == models_dir.resolve()


def _delete_version(engine: Engine, models_dir: Path, version_id: str, folder: Path) -> str | None:
    """Mark one version's row deleted and move its folder to the trash in one transaction; then remove the entry.

    Returns the :class:`PrunedVersions` list it goes to (``deleted``, ``failed``), or None when the version was
    promoted or deleted since the candidates were read (not this run's to prune).
    """
    entry = models_dir / TRASH_DIR / version_id
    try:
        with engine.begin() as conn:
            marked = conn.execute(text("UPDATE model_versions SET status = 'deleted' WHERE id = :id "
                                       "AND status NOT IN ('champion', 'deleted') RETURNING id"),
                                  {"id": version_id}).first()
            if marked is None:
                return None
            if folder.exists():
                entry.parent.mkdir(exist_ok=True)
                os.rename(folder, entry)  # an error rolls the mark back: the row keeps its folder
                fsync_path(models_dir)  # the move durable before the mark is: a power loss brings back no orphan
                fsync_path(entry.parent)
    except OSError as error:
        log.error("retention: model version %s kept: its folder %s could not be moved to the trash (%s)",
                  version_id, folder, error)
        return "failed"
    _remove(entry)  # what stays (a crash here, a file that resists) the next run's sweep removes
    return "deleted"
