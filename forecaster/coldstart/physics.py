"""Bandwidth arithmetic for cold-start phases: the prior the learned model starts from.

``phase_seconds`` gives, for each start state, the expected seconds of each
phase (``forecaster.contracts.phases.PHASES``) when ``concurrent`` other
network transfers share the node and the registry. It uses the same
parameters as the simulator (:class:`forecaster.contracts.fleetconfig.FleetConfig`),
so on simulated fleets it is the "known physics" baseline, and on a real fleet
it is a prior whose errors the learned model corrects.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from forecaster.contracts.phases import PHASES, START_STATES
from forecaster.contracts.fleetconfig import FleetConfig


def phase_seconds(image_bytes: np.ndarray, weights_bytes: np.ndarray, state: np.ndarray, *,
                  concurrent: np.ndarray | float = 0.0, registry_pulls: np.ndarray | float = 0.0,
                  hour: np.ndarray | int = 0, node_bytes_per_s: np.ndarray | float | None = None,
                  config: FleetConfig = FleetConfig()) -> dict[str, np.ndarray]:
    """Expected seconds per phase (dict of (N,) arrays keyed by phase name, plus ``total_s``).

    Args:
        image_bytes, weights_bytes: (N,) sizes in bytes.
        state: (N,) start state index into :data:`START_STATES` (0 none .. 3 host).
        concurrent: other network transfers running on the node.
        registry_pulls: other pulls running against the same registry, fleet-wide.
        hour: UTC hour of the start (registries are slower in ``config.peak_hours_utc``).
        node_bytes_per_s: the node's network bandwidth (default ``config.node_nic_bytes_per_s``).
    """
    image_bytes = np.asarray(image_bytes, dtype="float64")
    weights_bytes = np.asarray(weights_bytes, dtype="float64")
    state = np.asarray(state, dtype=np.int64)
    lo, hi = config.peak_hours_utc
    hour = np.asarray(hour)
    factor = np.where((hour >= lo) & (hour < hi), 1.0 / config.peak_slowdown, 1.0)
    nic = np.asarray(config.node_nic_bytes_per_s if node_bytes_per_s is None else node_bytes_per_s,
                     dtype="float64")
    share = 1.0 + np.asarray(concurrent, dtype="float64")
    reg_share = 1.0 + np.asarray(registry_pulls, dtype="float64")
    pull_rate = np.minimum.reduce([np.full_like(image_bytes, config.image_pull_bytes_per_s) * factor,
                                   nic / share + 0 * image_bytes,
                                   config.registry_bytes_per_s * factor / reg_share + 0 * image_bytes])
    fetch_rate = np.minimum.reduce([np.full_like(image_bytes, config.weight_fetch_bytes_per_s) * factor,
                                    nic / share + 0 * image_bytes,
                                    config.bucket_bytes_per_s * factor / reg_share + 0 * image_bytes])
    out = {
        "image_pull_s": np.where(state < 1, image_bytes / pull_rate, 0.0),
        "weight_fetch_s": np.where(state < 2, weights_bytes / fetch_rate, 0.0),
        "weight_load_s": weights_bytes / np.where(state >= 3, config.host_to_gpu_bytes_per_s,
                                                  config.disk_read_bytes_per_s),
        "runtime_init_s": np.full_like(image_bytes, config.runtime_init_s),
        "registration_s": np.full_like(image_bytes, config.registration_s),
    }
    out["total_s"] = sum(out[p] for p in PHASES)
    return out


def physics_latency_table(models: pd.DataFrame, *, concurrent: float = 0.0, registry_pulls: float = 0.0,
                          hour: int = 0, config: FleetConfig = FleetConfig()) -> pd.DataFrame:
    """Planner latency input (``model_id, state, total_s, <phases>``) for every model and start state."""
    n = len(models)
    frames = []
    for k, state in enumerate(START_STATES):
        phases = phase_seconds(models["image_bytes"].to_numpy(), models["weights_bytes"].to_numpy(),
                               np.full(n, k), concurrent=concurrent, registry_pulls=registry_pulls, hour=hour,
                               config=config)
        frame = pd.DataFrame({"model_id": models.index.astype(str), "state": state, **phases})
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)
