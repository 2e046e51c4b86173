"""Per-node latency tables kept as files beside the saved models, so that a table is computed once per hour for
the fleet rather than once per process.

The plan job, each API worker and each restarted process used to compute the same
:class:`~forecaster.contracts.latency.NodeLatencyTable` for the same latency champion, hour, catalogue and nodes:
17 s at 100,000 models x 64 nodes on an idle 2-core machine, 70-160 s under load (docs/scale.md), about a
gigabyte while it runs, and most of the first plan after every start. Every process that computes one now writes
it under ``<models_dir>/latency-tables/`` (the directory every process already shares for the champion's own
files), and a process that misses its in-memory cache reads the file instead of computing.

A table is a pure function of what names its file: the champion's version id (a new version is a new file; the
nightly retrain makes one), the UTC hour, the models' sizes, the node ids, the code (a digest of the package's
source files, :func:`code_fingerprint`: a deploy that changes any of them computes its tables afresh, as its
restarted processes did before), the versions of Python and the libraries it predicts with (:func:`runtime`) and
:data:`FORMAT`. The prior (no version saved) is never written: it is what a
fleet uses only until its first training, and it has no version to name it by.

A process about to compute a table holds a lock file for it (:func:`build_lock`), so that the plan job and the
API's workers asking at the same hour turn compute it once: the others wait, then read the file.

Files are written to a hidden directory and renamed into place, so a reader sees a whole table or none; a
table that cannot be read (truncated, another format, a different key behind the same digest) is logged, removed
where the directory is writable, and computed again. A directory that cannot be written (the API mounts the models
volume read-only in deploy/base) only means this process does not share its tables: it still reads those the
plan job wrote. The newest ``kept`` tables by modification time stay (a read touches its file); a table is about
110 MB at 100,000 models x 64 nodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd

from forecaster.contracts.latency import NodeLatencyTable

log = logging.getLogger(__name__)

#: the layout of a table's directory; a reader ignores (and replaces) any other
FORMAT = 1
#: subdirectory of the models directory that holds the tables
DIRNAME = "latency-tables"
#: a hidden directory (or lock file) older than this is a writer that died mid-write, and is removed
_STALE_PARTIAL_S = 3600.0
#: seconds a process waits for another one computing the same table before it computes the table itself (a
#: build at 100,000 models x 64 nodes took 17 s on an idle 2-core machine, 130-160 s beside the plans under load)
BUILD_WAIT_S = 300.0
_LOCK_POLL_S = 0.2
_META = "meta.json"


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 of the ``forecaster`` package's Python sources (paths and bytes, in path order), once per process.

    Broader than the latency model's own modules on purpose: their imports reach across the package, and a deploy
    recomputing its tables once is what every deploy did before the files.
    """
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def runtime() -> str:
    """The versions a table's numbers also depend on: Python and the libraries the latency model predicts with."""
    import platform

    import lightgbm

    from forecaster import __version__

    return (f"prewarm {__version__}; python {platform.python_version()}; lightgbm {lightgbm.__version__}; "
            f"numpy {np.__version__}; pandas {pd.__version__}")


def table_key(*, version: str, hour: int, n_models: int, sizes_digest: int, node_ids: tuple[str, ...]) -> dict:
    """What a table file answers for, as stored in its ``meta.json`` and compared on every read."""
    return {"format": FORMAT, "runtime": runtime(), "code": code_fingerprint(), "version": version,
            "hour": int(hour), "n_models": int(n_models), "sizes_digest": int(sizes_digest),
            "nodes_sha256": hashlib.sha256("\n".join(node_ids).encode("utf-8", "surrogatepass")).hexdigest(),
            "n_nodes": len(node_ids)}


def _name(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in key["version"])[:80]
    return f"{safe}-h{key['hour']:02d}-{digest}"


@contextlib.contextmanager
def build_lock(models_dir: Path, key: dict, *, wait_s: float | None = None):
    """Single-flight across processes: hold ``key``'s lock file while computing its table.

    Yields whether this process waited for another holder (which has then, in all likelihood, written the file:
    read it before computing). An advisory ``flock`` on ``<models_dir>/latency-tables/.<name>.lock``, released by
    the kernel when its holder exits, so a crashed builder never blocks the others. Without it, the plan job and
    every API worker computed the same table at once each hour turn and each prefetch window (about a gigabyte
    each while it runs, at 100,000 models). A lock that cannot be had within ``wait_s`` (default
    :data:`BUILD_WAIT_S`) is logged and the table computed anyway; a directory where no lock file can be made or
    opened (a read-only volume that has none yet) means no waiting.
    """
    path = Path(models_dir) / DIRNAME / f".{_name(key)}.lock"
    fd = _open_lock(path)
    if fd is None:
        yield False
        return
    locked = waited = False
    try:
        deadline = time.monotonic() + (BUILD_WAIT_S if wait_s is None else wait_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                waited = True
                if time.monotonic() >= deadline:
                    log.warning("latency table for hour %02d: another process has been computing it for over "
                                "%.0f s; computing it here too", key["hour"], BUILD_WAIT_S if wait_s is None
                                else wait_s)
                    break
                time.sleep(_LOCK_POLL_S)
            except OSError as exc:  # no locks on this file system (some network volumes): no waiting
                log.info("latency table lock %s unavailable (%s)", path, exc)
                break
        yield waited
    finally:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _open_lock(path: Path) -> int | None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        try:
            return os.open(path, os.O_RDONLY)  # a read-only volume: wait on the writer's lock where it made one
        except OSError:
            return None


def read_table(models_dir: Path, key: dict) -> NodeLatencyTable | None:
    """The table written for ``key``, or None when there is none (or it cannot be read; it is then removed)."""
    path = Path(models_dir) / DIRNAME / _name(key)
    meta_path = path / _META
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("key") != key:
            raise ValueError(f"written for {meta.get('key')}, asked for {key}")

        def array(name: str) -> np.ndarray:
            return np.load(path / name, allow_pickle=False)

        table = NodeLatencyTable(
            model_ids=pd.Index(meta["model_ids"], dtype=object),
            node_ids=pd.Index(meta["node_ids"], dtype=object),
            per_node={name: array(f"per_node.{i}.npy") for i, name in enumerate(meta["per_node"])},
            per_model={name: array(f"per_model.{i}.npy") for i, name in enumerate(meta["per_model"])},
        )
        if len(table.model_ids) != key["n_models"] or tuple(table.node_ids) != tuple(meta["node_ids"]):
            raise ValueError("its ids do not match its key")
    except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:
        log.warning("latency table file %s cannot be read (%s); computing the table again", path, exc)
        shutil.rmtree(path, ignore_errors=True)
        return None
    try:
        os.utime(path)  # in use: the pruning keeps the most recently used
    except OSError:
        pass  # a read-only models volume: the writer's pruning decides
    return table


def write_table(models_dir: Path, key: dict, table: NodeLatencyTable, *, kept: int) -> Path | None:
    """Write ``table`` for ``key`` (atomically: a hidden directory renamed into place), then keep the newest
    ``kept`` tables. Returns the table's directory, or None when it could not be written (logged; never raises
    for a file system error: a table that is not shared is computed again by the next process, nothing else)."""
    root = Path(models_dir) / DIRNAME
    final = root / _name(key)
    partial = root / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        partial.mkdir(parents=True)
        names = {"per_node": list(table.per_node), "per_model": list(table.per_model)}
        for group, arrays in (("per_node", table.per_node), ("per_model", table.per_model)):
            for i, values in enumerate(arrays.values()):
                np.save(partial / f"{group}.{i}.npy", np.ascontiguousarray(values), allow_pickle=False)
        meta = {"key": key, **names, "model_ids": [str(m) for m in table.model_ids],
                "node_ids": [str(n) for n in table.node_ids], "written_at": time.time()}
        (partial / _META).write_text(json.dumps(meta), encoding="utf-8")
        try:
            partial.rename(final)
        except OSError:
            if not (final / _META).is_file():
                raise
            shutil.rmtree(partial, ignore_errors=True)  # another process wrote the same table first
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        log.info("latency table not written to %s (%s); other processes compute their own", root, exc)
        return None
    prune(root, kept=kept)
    return final


def prune(root: Path, *, kept: int) -> None:
    """Remove all but the ``kept`` most recently modified tables, hidden directories left by dead writers, and lock
    files not touched for an hour (a build takes minutes; the kernel's lock dies with its holder, the file stays)."""
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return
    now = time.time()
    tables = []
    for entry in entries:
        try:
            mtime = entry.stat().st_mtime
        except OSError:
            continue  # removed meanwhile by another process
        if entry.name.startswith("."):
            if now - mtime > _STALE_PARTIAL_S:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        elif entry.is_dir():
            tables.append((mtime, entry))
    for _, entry in sorted(tables, reverse=True)[kept:]:
        shutil.rmtree(entry, ignore_errors=True)
