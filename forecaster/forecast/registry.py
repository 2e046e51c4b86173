"""The model registry: trained ensembles under ``models/<version>/`` plus a row in ``model_versions``.

A version folder holds two files with fixed names (after mlforecast's
save/load): ``ensemble.pkl`` (the fitted ensemble) and ``metadata.json``
(training window, members, failures, backtest scores, code version). At most
one forecasting version is the ``champion`` (the rows live in :mod:`forecaster.store.registry`,
which also keeps the latency model's versions); the nightly retrain adds a ``challenger`` and
promotes it only when its backtest is not worse than the champion's on the
same held-out origins.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path

from sqlalchemy import Engine

from forecaster import __version__
from forecaster.store.files import publish_dir
from forecaster.store.registry import (VersionInfo, champion_version, insert_version, promote_version, retired_versions,
                                      set_version_status)

log = logging.getLogger(__name__)

ENSEMBLE_FILE = "ensemble.pkl"
METADATA_FILE = "metadata.json"
#: Layout of what :func:`save_version` pickles (the ensemble classes' attributes, the shard files). Written to each
#: version's ``metadata.json`` as ``artefact_format`` and compared by :func:`load_ensemble`: a version saved in
#: another format is refused at load (:class:`ArtefactFormatError`), like a missing file, rather than accepted and
#: failing at its first forecast. Raise it whenever a change to those classes makes older pickles unusable.
ARTEFACT_FORMAT = 1
#: The format a ``metadata.json`` without ``artefact_format`` is read as: versions saved before the field existed,
#: by code whose pickles are this format's. Such a version from older code still (one pickled before a later
#: attribute was added) loads; that is safe because the forecast job catches a champion that then fails to forecast
#: and forecasts with the previous champion or the fallback model (:meth:`ChampionCache.failed`). Once
#: :data:`ARTEFACT_FORMAT` is raised, versions without the field are refused like any other older format.
LEGACY_ARTEFACT_FORMAT = 1


class ArtefactFormatError(ValueError):
    """A version folder saved in another :data:`ARTEFACT_FORMAT` (or whose ``metadata.json`` cannot be read)."""


def code_version() -> str:
    """Package version plus the git commit when running from a checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{__version__}+{commit}" if commit else __version__


def save_version(
    ensemble,
    models_dir: Path,
    *,
    version_id: str,
    train_start: datetime | None,
    train_end: datetime | None,
    scores: dict,
) -> Path:
    """Write ``ensemble`` and its metadata atomically (a temp folder renamed into place) and durably.

    Every file (``ensemble.pkl``, ``metadata.json``, a sharded ensemble's ``shards/*.pkl``) and the folders are
    synced to disk before the rename, and the rename before this returns (:func:`~forecaster.store.files.publish_dir`):
    the caller then registers and promotes the version in PostgreSQL, durable at once, and a power loss must not
    leave that row naming empty or partly written files.
    """
    final = Path(models_dir) / version_id
    if final.exists():
        raise FileExistsError(f"model version {version_id!r} already exists at {final}")
    staging = Path(models_dir) / f".{version_id}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _write_version(ensemble, staging, version_id=version_id, train_start=train_start, train_end=train_end,
                       scores=scores)
        return publish_dir(staging, final)
    except BaseException:  # a full disk, a pickling error, an interrupt: no staging folder is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_version(ensemble, staging: Path, *, version_id: str, train_start, train_end, scores: dict) -> None:
    progress = getattr(ensemble, "progress", None)
    try:
        ensemble.progress = None  # a logging callback is not part of the model (and may not pickle)
        if hasattr(ensemble, "save_shards"):  # a sharded ensemble: one file per shard, loaded by its workers
            ensemble.save_shards(staging)
        with open(staging / ENSEMBLE_FILE, "wb") as handle:
            pickle.dump(ensemble, handle, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        ensemble.progress = progress
    metadata = {
        "version": version_id,
        "train_start": train_start.isoformat() if train_start else None,
        "train_end": train_end.isoformat() if train_end else None,
        "members": member_report(ensemble),
        "failures": dict(getattr(ensemble, "failures_", {})),
        "scores": scores,
        "code_version": code_version(),
        "artefact_format": ARTEFACT_FORMAT,
    }
    (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2, default=str) + "\n")


def member_report(ensemble) -> list[dict]:
    """Each fitted member's name and the share of series that use it."""
    if hasattr(ensemble, "member_report"):  # sharded: aggregated over its shards
        return ensemble.member_report()
    members = getattr(ensemble, "members_", [])
    weights = getattr(ensemble, "weights_", None)
    report = []
    for j, member in enumerate(members):
        share = None
        if weights is not None:
            try:
                share = round(float((weights[:, j] > 0).mean()), 4)
            except (IndexError, TypeError):
                share = None
        report.append({"name": member.name, "series_share": share})
    return report


def load_ensemble(path: Path):
    """Load a saved ensemble (only load folders this service wrote: pickle runs code).

    A sharded ensemble's shard files are read later, by the workers that forecast them; here each is checked to be
    there and whole (:meth:`~forecaster.forecast.sharded.ShardedEnsemble.verify_shards`, a few bytes per file):
    a version with a missing or truncated shard file raises
    :class:`~forecaster.forecast.sharded.ShardFilesError` like one with a missing ``ensemble.pkl``.

    Before anything is unpickled, the version's ``artefact_format`` (``metadata.json``) is compared with
    :data:`ARTEFACT_FORMAT`: another format, or a ``metadata.json`` that is missing or cannot be read, raises
    :class:`ArtefactFormatError` (a load failure: :class:`ChampionCache` goes on with what it holds).
    """
    check_artefact_format(path)
    with open(Path(path) / ENSEMBLE_FILE, "rb") as handle:
        ensemble = pickle.load(handle)
    if hasattr(ensemble, "attach"):  # a sharded ensemble reads its shard files from this folder
        ensemble.attach(Path(path))
        ensemble.verify_shards()
    return ensemble


def check_artefact_format(path: Path) -> None:
    """Raise :class:`ArtefactFormatError` unless the version at ``path`` was saved in :data:`ARTEFACT_FORMAT`
    (a ``metadata.json`` without the field counts as :data:`LEGACY_ARTEFACT_FORMAT`)."""
    try:
        metadata = json.loads((Path(path) / METADATA_FILE).read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as error:
        raise ArtefactFormatError(f"{Path(path) / METADATA_FILE} cannot be read: {error!r}") from error
    found = metadata.get("artefact_format", LEGACY_ARTEFACT_FORMAT) if isinstance(metadata, dict) else None
    if found != ARTEFACT_FORMAT:
        raise ArtefactFormatError(f"model version at {path} was saved in artefact format {found!r} "
                                  f"(code {metadata.get('code_version') if isinstance(metadata, dict) else None}); "
                                  f"this code reads format {ARTEFACT_FORMAT}")


def register(engine: Engine, *, version_id: str, path: Path, status: str, train_start, train_end,
             members: list, scores: dict) -> None:
    """Add the ``model_versions`` row of a saved ensemble (kind ``forecast``)."""
    insert_version(engine, version_id=version_id, path=path, status=status, train_start=train_start,
                   train_end=train_end, members=members, scores=scores, code_version=code_version())


def champion(engine: Engine) -> VersionInfo | None:
    """The forecasting champion (kind ``forecast``), or None."""
    return champion_version(engine, kind="forecast")


def promote(engine: Engine, version_id: str) -> None:
    """Make ``version_id`` the champion and retire the previous one, in one transaction."""
    promote_version(engine, version_id)


def set_status(engine: Engine, version_id: str, status: str) -> None:
    set_version_status(engine, version_id, status)


class ChampionCache:
    """Loads the champion once per version; the forecast job asks it every minute.

    A champion whose artefacts cannot be loaded (its folder deleted or not yet mounted, a truncated pickle, a
    shard file missing or cut short (:func:`load_ensemble`), another :data:`ARTEFACT_FORMAT`, code that no longer
    unpickles it) never stops the job: the error is logged and kept in :attr:`last_error`, the job goes on with the
    ensemble it already holds (the previous champion, reported under its own version) or, when it holds none (a
    scheduler started after the promotion), with the newest former champion that loads
    (:func:`~forecaster.store.registry.retired_versions`: the one whose files the retention job keeps), else with
    the fallback model; the load is tried again ``retry_after_s`` later rather than every minute. A version that
    loads but then fails to forecast is treated the same way once the job reports it (:meth:`failed`): it is
    dropped, and the next :meth:`get` answers with the newest former champion that loads (or nothing: the
    fallback model). The version is not marked failed in the database: a volume that comes back heals by itself,
    and the nightly retrain promotes a challenger over a champion that cannot forecast (:attr:`champion_id` and
    :attr:`champion_loaded` tell it whether what :meth:`get` answered is the champion row itself).
    """

    def __init__(self, *, retry_after_s: float = 600.0, clock=time.monotonic) -> None:
        self._version: str | None = None
        self._ensemble = None
        self._failed_at: dict[str, float] = {}
        self.retry_after_s = retry_after_s
        self._clock = clock
        self.last_error: str | None = None
        #: the champion row's version at the last :meth:`get` (None: no champion row)
        self.champion_id: str | None = None

    @property
    def champion_loaded(self) -> bool:
        """Whether the last :meth:`get` answered with the champion row's own version (not a former champion, not
        nothing while a champion row exists)."""
        return self.champion_id is not None and self._version == self.champion_id and self._ensemble is not None

    def get(self, engine: Engine):
        """``(version id, ensemble)`` to forecast with; ``(None, None)`` when there is nothing to load."""
        info = champion(engine)
        self.champion_id = None if info is None else info.id
        if info is None:
            return None, None
        if info.id != self._version:
            failed_at = self._failed_at.get(info.id)
            if failed_at is not None and self._clock() - failed_at < self.retry_after_s:
                if self._ensemble is None:  # dropped after a failed forecast, or nothing loaded yet
                    self._load_previous(engine, info.id)
                return self._version, self._ensemble
            log.info("loading champion model %s from %s", info.id, info.path)
            try:
                ensemble = load_ensemble(info.path)
            except Exception as error:  # missing files, a truncated or foreign pickle: any of them, the job goes on
                self._failed_at[info.id] = self._clock()
                self.last_error = f"champion {info.id} could not be loaded from {info.path}: {error!r}"
                if self._ensemble is None:
                    self._load_previous(engine, info.id)
                log.error("%s; forecasting with %s, retrying in %.0f s", self.last_error,
                          f"the previous champion {self._version}" if self._ensemble is not None
                          else "the fallback model", self.retry_after_s)
                return self._version, self._ensemble
            self._ensemble, self._version = ensemble, info.id
            self._failed_at.pop(info.id, None)
            self.last_error = None
        return info.id, self._ensemble

    def failed(self, version_id: str, error: BaseException) -> None:
        """``version_id`` (what :meth:`get` answered) loaded but raised ``error`` when it forecast: drop it, keep
        the error in :attr:`last_error`, and leave it alone for ``retry_after_s``; the next :meth:`get` answers
        with the newest former champion that loads, else ``(None, None)`` (the fallback model)."""
        role = "champion" if version_id == self.champion_id else "former champion"
        self.last_error = f"{role} {version_id} failed to forecast: {error!r}"
        self._failed_at[version_id] = self._clock()
        if self._version == version_id:
            self._version, self._ensemble = None, None
        log.error("%s; forecasting again without it, retrying it in %.0f s", self.last_error, self.retry_after_s)

    def _load_previous(self, engine: Engine, champion_id: str) -> None:
        """Hold the newest former champion that loads (none held yet, the champion unusable)."""
        for info in retired_versions(engine, kind="forecast"):
            failed_at = self._failed_at.get(info.id)
            if info.id == champion_id or (failed_at is not None and self._clock() - failed_at < self.retry_after_s):
                continue
            try:
                ensemble = load_ensemble(info.path)
            except Exception as error:  # noqa: BLE001 - the next older one, or the fallback model
                self._failed_at[info.id] = self._clock()
                log.warning("former champion %s could not be loaded from %s either: %r", info.id, info.path, error)
                continue
            self._ensemble, self._version = ensemble, info.id
            return
