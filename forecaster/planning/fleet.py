"""The planner's cost settings and the latency table it reads (the fleet state is in :mod:`forecaster.contracts.fleet`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from forecaster.contracts.phases import PHASES, START_STATES


@dataclass(frozen=True)
class PlannerSettings:
    """Cost settings and guardrails of the planner.

    Attributes:
        horizon_min: minutes ahead to plan (forecast horizons used).
        gpu_second_cost: price of one idle GPU-second (the unit of all costs).
        count_queued_wait: charge a cold start for every request that queues
            behind it (D + lambda D^2 / 2 seconds of wait) rather than for the
            first request only (D seconds).
        replica_utilisation: share of a replica's capacity planned to be used.
        gpu_budget: GPUs the planner may hold warm across all models (None: the
            fleet's GPUs in use by models plus the free ones, less ``gpu_headroom``).
        gpu_headroom: share of those GPUs left for the reactive path when the
            budget is not set.
        max_transfers_per_node: concurrent pulls/fetches per node.
        max_transfers_per_registry: concurrent pulls per image registry or
            weights bucket (the thundering herd guard).
        tiers: plan prepull/preload (False: scale-ahead only).
        max_tier_nodes: nodes prepared per model at most.
        max_tier_actions: prepull/preload actions per plan at most, the most
            valuable first (the rest wait for a later plan).
        byte_cost: GPU-second equivalent of moving one byte from a registry/S3.
        host_byte_second_cost: GPU-second equivalent of holding one byte of host
            memory for one second (disk is taken as free).
        lead_margin_s, lead_margin_frac: start actions this much earlier than the
            predicted latency (absolute + relative safety margin).
        release_hold_min: minutes of forecast below the current replicas before
            a release (hysteresis; 0 releases as soon as the next minute allows).
        quantile_for_shape: level used to size replicas beyond the first when the
            newsvendor level falls outside the forecast's levels.
    """

    horizon_min: int = 5
    gpu_second_cost: float = 1.0
    count_queued_wait: bool = True
    replica_utilisation: float = 0.8
    gpu_budget: float | None = None
    gpu_headroom: float = 0.1
    max_transfers_per_node: int = 2
    max_transfers_per_registry: int = 48
    tiers: bool = True
    max_tier_nodes: int = 8
    max_tier_actions: int = 64
    byte_cost: float = 2e-10
    host_byte_second_cost: float = 2e-13
    lead_margin_s: float = 5.0
    lead_margin_frac: float = 0.2
    release_hold_min: int = 0
    quantile_for_shape: float = 0.9

    def lead(self, seconds: np.ndarray | float) -> np.ndarray | float:
        """Lead time for an action predicted to take ``seconds``."""
        return np.asarray(seconds) * (1.0 + self.lead_margin_frac) + self.lead_margin_s


def latency_table(latency: pd.DataFrame, model_ids: pd.Index) -> dict[str, np.ndarray]:
    """Per start state, (N,) predicted totals and phases aligned to ``model_ids`` (NaN where missing)."""
    missing = [c for c in ("model_id", "state", "total_s") if c not in latency.columns]
    if missing:
        raise ValueError(f"latency lacks columns {missing}")
    out: dict[str, np.ndarray] = {}
    for state in START_STATES:
        rows = latency[latency["state"] == state].drop_duplicates("model_id").set_index("model_id")
        aligned = rows.reindex(model_ids)
        out[state] = aligned["total_s"].to_numpy(dtype="float64")
        for phase in PHASES:
            if phase in aligned.columns:
                out[f"{state}:{phase}"] = aligned[phase].to_numpy(dtype="float64")
    # a state missing from the table costs what the next colder state costs
    for colder, warmer in zip(START_STATES, START_STATES[1:]):
        out[warmer] = np.where(np.isnan(out[warmer]), out[colder], out[warmer])
    return out
