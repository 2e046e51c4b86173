"""Members used by tests/test_distributed.py: importable by pool processes and Dask workers (pickled by reference)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from forecaster.forecast.ensemble import Ensemble
from forecaster.forecast.members import Naive


class SlowNaive(Naive):
    """Naive that announces its worker's pid in ``marker_dir`` and then takes ``seconds`` to fit."""

    name = "slow_naive"

    def __init__(self, marker_dir: str, seconds: float):
        self.marker_dir = marker_dir
        self.seconds = seconds

    def _fit(self, panel) -> None:
        Path(self.marker_dir, f"{os.getpid()}-{panel.ids[0]}").touch()
        time.sleep(self.seconds)


class PoisonedEnsemble(Ensemble):
    """An ensemble whose fit raises (outside any member) when its shard holds a series named in ``poison``."""

    def __init__(self, *args, poison: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.poison = poison

    def fit_panel(self, panel):
        if set(self.poison) & set(panel.ids):
            raise MemoryError(f"worker out of memory on {sorted(set(self.poison) & set(panel.ids))} (simulated)")
        return super().fit_panel(panel)


def flaky_square(marker: str, x: int) -> int:
    """Fails (exception) the first time it sees a fresh ``marker`` path, then squares."""
    if marker and not os.path.exists(marker):
        Path(marker).touch()
        raise RuntimeError("transient failure (simulated)")
    return x * x


def dies_once(marker: str, x: int) -> int:
    """Kills its own process the first time it sees a fresh ``marker`` path, then squares."""
    if marker and not os.path.exists(marker):
        Path(marker).touch()
        os._exit(3)
    return x * x


def always_fails(x: int) -> int:
    raise ValueError(f"shard {x} is broken (simulated)")


def native_threads(_: int) -> dict:
    """The thread counts of this process's BLAS and OpenMP pools and torch's, after loading scipy, LightGBM, torch."""
    import lightgbm  # noqa: F401 - loads its OpenMP runtime
    import scipy.linalg  # noqa: F401 - scipy's own OpenBLAS, loaded here unless something loaded it before
    import torch
    from threadpoolctl import threadpool_info

    pools = {"torch": [torch.get_num_threads()]}
    for pool in threadpool_info():
        pools.setdefault(pool["user_api"], []).append(pool["num_threads"])
    return pools


class SlowNaiveEnds(SlowNaive):
    """:class:`SlowNaive` that also leaves ``<pid>-<first id>.end`` in ``marker_dir`` when its fit is done."""

    name = "slow_naive"

    def _fit(self, panel) -> None:
        super()._fit(panel)
        Path(self.marker_dir, f"{os.getpid()}-{panel.ids[0]}.end").touch()


class HangingEnsemble(Ensemble):
    """An ensemble whose forecast blocks (a native call that never returns) while ``marker`` exists, in the shards
    that hold a series named in ``poison``; removing the marker releases it."""

    def __init__(self, *args, marker: str = "", poison: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.marker = marker
        self.poison = tuple(poison)

    def forecast(self, panel, origins, h, *, members=False):
        if set(self.poison) & set(panel.ids):
            while os.path.exists(self.marker):
                time.sleep(0.02)
        return super().forecast(panel, origins, h, members=members)
