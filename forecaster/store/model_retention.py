"""Retention of saved model versions: the ``models/<version>/`` folders and their ``model_versions`` rows.

Every nightly retrain saves a forecasting challenger, promoted or not (each pickles its fit panel: about 94 KB
per series), and a latency model; nothing else ever deletes one. The hourly retention job deletes a version, its
folder and its row, when all of these hold:

* it is not the champion of its kind;
* its row is older than ``PREWARM_MODEL_VERSIONS_RETENTION_DAYS`` (``created_at``, against the job's ``now``: a
  clock that has not reached it, as in a replay, deletes nothing);
* it is not among the newest ``PREWARM_MODEL_VERSIONS_KEPT`` of its kind (what a rollback would promote);
* no stored forecast names it (``forecasts.model_version_id``, a foreign key: the delete itself is refused while
  one does, so a former champion goes once the forecast partitions' retention,
  ``PREWARM_FORECAST_RETENTION_DAYS``, has dropped its days; also a previous champion the forecast job still
  forecasts with because the new one cannot be loaded, whose shard files it reads);
* its row names a folder directly in ``models_dir`` (or a folder already gone): a path elsewhere is not this
  job's to delete, and the row stays with it.

Crash safety, per version: one transaction locks the row (still not the champion), deletes it, and renames the
folder into ``models_dir/.trash/<version>`` before it commits; the trash entry is removed after the commit. A
crash or a failed commit leaves at most a trash entry, which the next run resolves first (:func:`sweep_trash`):
its row gone, it is removed; its row still there (the delete never committed), it is renamed back. A champion row
never names a missing folder: its row is never deleted, and :func:`~forecaster.store.registry.promote_version`
refuses a version whose row was deleted while it waited for the lock.

Cost: ``forecasts`` has no index on ``model_version_id``, so PostgreSQL's check of the foreign key reads the
forecast partitions for each deleted row (stopping at the first row that names it). A few versions a day become
deletable; the first run on a store with a long backlog stops after ``budget_s`` and leaves the rest to the next.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

from forecaster.store.files import fsync_path

log = logging.getLogger(__name__)

#: Folder under ``models_dir`` a version's folder is moved into before its row's delete commits.
TRASH_DIR = ".trash"
#: Seconds a run spends deleting before it leaves the rest to the next run.
RUN_BUDGET_S = 300.0
_FOREIGN_KEY_VIOLATION = "23503"


@dataclass
class PrunedVersions:
    """What one run did: versions deleted, and why the other old ones stayed."""

    deleted: list[str] = field(default_factory=list)
    referenced: list[str] = field(default_factory=list)  # named by a stored forecast
    elsewhere: list[str] = field(default_factory=list)  # folder outside models_dir: left alone
    failed: list[str] = field(default_factory=list)  # the folder could not be moved (logged); tried next run
    trash_removed: int = 0  # leftovers of an interrupted run removed
    trash_restored: int = 0  # folders of an interrupted run put back (their delete never committed)
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
    with engine.connect() as conn:
        candidates = conn.execute(text(
            "SELECT id, path FROM (SELECT id, path, status, created_at, row_number() OVER "
            "(PARTITION BY kind ORDER BY created_at DESC, id DESC) AS newest FROM model_versions) v "
            "WHERE newest > :kept AND status <> 'champion' AND created_at < :before ORDER BY created_at, id"),
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
        log.info("retention: deleted %d model versions older than %d days (%s); %d named by stored forecasts kept",
                 len(result.deleted), retention_days, ", ".join(result.deleted), len(result.referenced))
    return asdict(result)


def sweep_trash(engine: Engine, models_dir: Path) -> tuple[int, int]:
    """Resolve what an interrupted run left in the trash: remove entries whose row is gone, put back those whose
    row is still there (its delete never committed). An entry whose row another run holds locked is its business.

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
            path = conn.execute(text("SELECT path FROM model_versions WHERE id = :id"), {"id": entry.name}).scalar()
            if path is not None:
                mine = conn.execute(text("SELECT path FROM model_versions WHERE id = :id FOR UPDATE SKIP LOCKED"),
                                    {"id": entry.name}).scalar()
                if mine is None or Path(path).exists():
                    continue  # being deleted by another run; or its folder is back already (left for a person)
                try:
                    os.rename(entry, path)
                except OSError as error:
                    log.error("retention: model version %s could not be put back from %s (%s)", entry.name, entry,
                              error)
                    continue
                restored += 1
                log.warning("retention: model version %s put back from the trash (its delete did not commit)",
                            entry.name)
                continue
        _remove(entry)
        removed += 1
    return removed, restored


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
    """Delete one version's row and move its folder to the trash in one transaction; then remove the trash entry.

    Returns the :class:`PrunedVersions` list it goes to (``deleted``, ``referenced``, ``failed``), or None when
    the version was promoted or deleted since the candidates were read (not this run's to prune).
    """
    entry = models_dir / TRASH_DIR / version_id
    try:
        with engine.begin() as conn:
            still = conn.execute(text("SELECT 1 FROM model_versions WHERE id = :id AND status <> 'champion' "
                                      "FOR UPDATE"), {"id": version_id}).first()
            if still is None:
                return None
            try:
                with conn.begin_nested():
                    conn.execute(text("DELETE FROM model_versions WHERE id = :id"), {"id": version_id})
            except IntegrityError as error:
                if getattr(error.orig, "sqlstate", None) != _FOREIGN_KEY_VIOLATION:
                    raise
                return "referenced"
            if folder.exists():
                entry.parent.mkdir(exist_ok=True)
                os.rename(folder, entry)  # an error rolls the delete back: the row keeps its folder
                fsync_path(models_dir)  # the move durable before the delete is: a power loss brings back no orphan
                fsync_path(entry.parent)
    except OSError as error:
        log.error("retention: model version %s kept: its folder %s could not be moved to the trash (%s)",
                  version_id, folder, error)
        return "failed"
    _remove(entry)  # what stays (a crash here, a file that resists) the next run's sweep removes
    return "deleted"
