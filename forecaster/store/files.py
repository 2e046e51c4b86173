"""Durable publication of a folder of files: once the database names a folder, a power loss must not empty it.

The model registry writes a version's files into a hidden staging folder, renames it into place and then commits
its ``model_versions`` row (and promotes it), which PostgreSQL makes durable at once. Without ``fsync`` the file
system may still hold the files' data (and the rename) only in the page cache: after a power loss the committed row
names a folder that is missing, or whose files are empty or cut short. :func:`publish_dir` orders it: every file's
data and every directory entry under the staging folder reach the disk first, then the rename, then the parent's
entry of the rename, all before the caller goes on to the database.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """``fsync`` one file or directory (its data, or its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(staging: str | Path, final: str | Path) -> Path:
    """Sync everything under ``staging``, rename it to ``final``, sync ``final``'s parent; returns ``final``.

    Files are synced before the directories that hold them (deepest first), so that each directory's sync records
    entries whose data is on disk. ``final`` must not exist (or be an empty directory, as ``os.rename`` allows);
    ``staging`` and ``final`` must be on the same file system (siblings, as the registry keeps them).
    """
    staging, final = Path(staging), Path(final)
    for root, _dirs, files in os.walk(staging, topdown=False):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(root)
    os.rename(staging, final)
    fsync_path(final.parent)
    return final
