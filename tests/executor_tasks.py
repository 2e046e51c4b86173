"""Shard functions for the executor tests in tests/test_distributed.py: the standard library only, so that a spawned
pool worker (or a Dask worker) imports this module in milliseconds, and pickled by reference."""

from __future__ import annotations

import os
import time
from pathlib import Path


class TwoArgError(Exception):
    """Pickles (its ``args`` are the one formatted message) but cannot be unpickled: ``__init__`` takes two."""

    def __init__(self, what: str, detail: str):
        super().__init__(f"{what}: {detail}")


def behave(mode: str, x: int, seconds: float = 0.0, marker: str = "") -> int:
    """``x * x`` after ``seconds``, or misbehave: ``die`` (the process exits at once), ``two-arg`` (raises a
    :class:`TwoArgError`), ``hang`` (writes its pid to ``marker.pid`` and blocks while ``marker`` exists, like a
    native call that never returns; removing the marker releases it)."""
    if mode == "die":
        os._exit(3)
    if mode == "two-arg":
        raise TwoArgError("native library failure", f"shard {x} (simulated)")
    if mode == "hang":
        Path(marker + ".pid").write_text(str(os.getpid()))
        while os.path.exists(marker):
            time.sleep(0.02)
    time.sleep(seconds)
    return x * x


def timed(folder: str, label: str, seconds: float) -> str:
    """Writes ``label.start`` and, ``seconds`` later, ``label.end`` (each holding ``time.time()``) into ``folder``."""
    Path(folder, f"{label}.start").write_text(repr(time.time()))
    time.sleep(seconds)
    Path(folder, f"{label}.end").write_text(repr(time.time()))
    return label
