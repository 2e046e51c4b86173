"""Wiring for simulation runs: models for a trace, policies by name, latency inputs, result tables.

Used by ``prewarm simulate`` and ``bench/policies.py`` so that both run the
same policies the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from forecaster.coldstart.model import ColdStartModel
from forecaster.coldstart.physics import physics_latency_table
from forecaster.planning.fleet import PlannerSettings
from forecaster.planning.forecasts import EmpiricalForecast, OracleForecast
from forecaster.simulation.catalog import assign_models
from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.simulation.engine import FleetSimulator, SimResult, SimView
from forecaster.simulation.policies import HybridHistogramPolicy, KeepAlivePolicy, KnativePolicy, PlannerPolicy
from forecaster.simulation.workload import Workload

log = logging.getLogger(__name__)

POLICY_NAMES = ("keepalive_5", "keepalive_10", "keepalive_20", "keepalive_30", "keepalive_60", "keepalive_120",
                "hybrid_histogram", "reactive", "prewarm", "prewarm_scale_only", "oracle")
DEFAULT_POLICIES = ("keepalive_10", "hybrid_histogram", "reactive", "prewarm", "prewarm_scale_only", "oracle")
AZURE_MEMORY = "azure_functions_2019_sample1350/app_memory_1350fn.csv.gz"


def models_for(workload: Workload, *, traces_dir: Path | None = None, entry: str | None = None) -> pd.DataFrame:
    """Catalogue entries for a workload's series (see :func:`~forecaster.simulation.catalog.assign_models`).

    A single series maps to ``entry`` (default ``llama-3-8b-instruct``); many
    series are ordered by the Azure memory file when it covers them (its
    ``HashApp``, which in the 1,350-function sample equals ``HashFunction``),
    else by their request volume.
    """
    if workload.n_models == 1 or entry is not None:
        return assign_models(workload.ids, entry=entry or "llama-3-8b-instruct")
    order = workload.panel.counts.sum(axis=1)
    if traces_dir is not None and (traces_dir / AZURE_MEMORY).is_file():
        memory = pd.read_csv(traces_dir / AZURE_MEMORY, usecols=["HashApp", "AverageAllocatedMb"])
        mb = memory.drop_duplicates("HashApp").set_index("HashApp")["AverageAllocatedMb"]
        aligned = mb.reindex(workload.ids.astype(str))
        if aligned.notna().all():
            order = aligned.to_numpy()
    return assign_models(workload.ids, order_by=order)


class LatencyInput:
    """The planner's latency input in the simulator, refreshed every ``refresh_s`` seconds.

    Uses a fitted :class:`~forecaster.coldstart.model.ColdStartModel` when given,
    else the bandwidth arithmetic of :mod:`forecaster.coldstart.physics`, at the
    current hour and the fleet's current concurrency (transfers per node,
    rounded).
    """

    def __init__(self, config: FleetConfig, model: ColdStartModel | None = None, refresh_s: float = 600.0):
        self.config = config
        self.model = model
        self.refresh_s = refresh_s
        self._cached: pd.DataFrame | None = None
        self._at = -np.inf

    def __call__(self, view: SimView) -> pd.DataFrame:
        if self._cached is not None and view.now_s - self._at < self.refresh_s:
            return self._cached
        hour = int((view.start + pd.Timedelta(seconds=view.now_s)).hour)
        transfers = view.fleet_frames()["transfers"]
        network = transfers[transfers["registry"] != "-"]
        concurrent = float(round(len(network) / max(network["node_id"].nunique(), 1))) if len(network) else 0.0
        models = view.models
        if self.model is not None:
            table = self.model.latency_table(models, hour=hour, concurrent=concurrent)
        else:
            table = physics_latency_table(models, concurrent=concurrent, hour=hour, config=self.config)
        self._cached, self._at = table, view.now_s
        return table


def make_policy(name: str, workload: Workload, config: FleetConfig, *, latency: LatencyInput | None = None,
                settings: PlannerSettings | None = None, cold_cost: float = 1.0,
                normalise_by_rate: bool | None = None):
    """A policy by its report name (one of :data:`POLICY_NAMES`, or ``keepalive_<minutes>``)."""
    latency = latency or LatencyInput(config)
    settings = settings or PlannerSettings()
    normalise = workload.n_models > 1 if normalise_by_rate is None else normalise_by_rate
    if name.startswith("keepalive_"):
        return KeepAlivePolicy(int(name.split("_", 1)[1]))
    if name == "hybrid_histogram":
        return HybridHistogramPolicy()
    if name == "reactive":
        return KnativePolicy()
    if name in ("prewarm", "prewarm_scale_only"):
        tiers = name == "prewarm"
        return PlannerPolicy(EmpiricalForecast(workload.panel), latency,
                             PlannerSettings(**{**settings.__dict__, "tiers": tiers and settings.tiers}),
                             name=name, cold_cost=cold_cost, normalise_by_rate=normalise)
    if name == "oracle":
        return PlannerPolicy(OracleForecast(workload.panel), latency, settings, name=name, cold_cost=cold_cost,
                             normalise_by_rate=normalise)
    raise ValueError(f"unknown policy {name!r}; expected one of {list(POLICY_NAMES)} or keepalive_<minutes>")


def run_policies(workload: Workload, models: pd.DataFrame, config: FleetConfig, names: list[str], *,
                 latency: LatencyInput | None = None, settings: PlannerSettings | None = None,
                 cold_cost: float = 1.0, progress: Callable[[str, float], None] | None = None
                 ) -> dict[str, SimResult]:
    """Simulate each named policy on the same workload and fleet."""
    results = {}
    for name in names:
        policy = make_policy(name, workload, config, latency=latency, settings=settings, cold_cost=cold_cost)
        report = (lambda frac, _n=name: progress(_n, frac)) if progress else None
        results[name] = FleetSimulator(workload, models, policy, config, progress=report).run()
        if isinstance(policy, PlannerPolicy):
            s = policy.summaries
            results[name].extra["plans"] = {
                "plans": len(s), "late": int(sum(x["late"] for x in s)),
                "deferred": int(sum(x["deferred"] for x in s)),
                "budget_denied_replicas": int(sum(x["budget_denied_replicas"] for x in s)),
                "actions_by_kind": {k: int(sum(x["by_kind"].get(k, 0) for x in s))
                                    for k in ("prepull", "preload", "scale", "release")}}
    return results


def summary_table(results: dict[str, SimResult], baseline: str = "keepalive_10") -> dict[str, dict]:
    """Per policy: the run's summary plus ``wasted_norm_pct`` (wasted GPU-seconds, ``baseline`` = 100)."""
    table = {name: r.summary() | r.extra for name, r in results.items()}
    base = results[baseline].wasted_gpu_seconds if baseline in results else None
    for name, row in table.items():
        row["wasted_norm_pct"] = (100.0 * results[name].wasted_gpu_seconds / base) if base else None
    return table


def format_table(table: dict[str, dict], columns: tuple[str, ...] = (
        "cold_pct_p75", "cold_pct_overall", "wait_p50_s", "wait_p99_s", "slo_attainment", "gpu_seconds",
        "wasted_norm_pct", "bytes_registry", "bytes_object_store", "peak_concurrent_pulls")) -> str:
    """A fixed-width text table, one row per policy."""
    head = f"{'policy':<22}" + "".join(f"{c[:16]:>17}" for c in columns)
    lines = [head, "-" * len(head)]
    for name, row in table.items():
        cells = []
        for c in columns:
            v = row.get(c)
            if v is None:
                cells.append(f"{'-':>17}")
            elif c.startswith("bytes"):
                cells.append(f"{v / 1e12:>15.2f}TB")
            elif isinstance(v, float):
                cells.append(f"{v:>17.3f}" if abs(v) < 1000 else f"{v:>17.0f}")
            else:
                cells.append(f"{v!s:>17}")
        lines.append(f"{name:<22}" + "".join(cells))
    return "\n".join(lines)
