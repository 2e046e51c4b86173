"""Wiring for simulation runs: models for a trace, policies by name, latency inputs, result tables.

Used by ``prewarm simulate`` and ``bench/policies.py`` so that both run the
same policies the same way.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from forecaster.coldstart.model import ColdStartModel
from forecaster.coldstart.physics import physics_latency_table
from forecaster.planning.fleet import PlannerSettings
from forecaster.planning.budget import WasteBudget
from forecaster.planning.step import planner_settings, waste_budget
from forecaster.settings import Settings
from forecaster.planning.forecasts import EmpiricalForecast, OracleForecast
from forecaster.simulation.catalog import assign_models
from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.simulation.engine import FleetSimulator, SimResult, SimView
from forecaster.simulation.policies import HybridHistogramPolicy, KeepAlivePolicy, KnativePolicy, PlannerPolicy
from forecaster.simulation.workload import Workload

log = logging.getLogger(__name__)

POLICY_NAMES = ("keepalive_5", "keepalive_10", "keepalive_20", "keepalive_30", "keepalive_60", "keepalive_120",
                "hybrid_histogram", "reactive", "prewarm", "prewarm_empirical", "prewarm_scale_only", "oracle")
DEFAULT_POLICIES = ("keepalive_10", "hybrid_histogram", "reactive", "prewarm", "prewarm_empirical",
                    "prewarm_scale_only", "oracle")
AZURE_MEMORY = "azure_functions_2019_sample1350/app_memory_1350fn.csv.gz"


def models_for(workload: Workload, *, traces_dir: Path | None = None, entry: str | None = None) -> pd.DataFrame:
    """Catalogue entries for a workload's series (see :func:`~forecaster.simulation.catalog.assign_models`).

    A single series maps to ``entry`` (default ``llama-3-8b-instruct``); many
    series are ordered by the Azure memory file when it covers them (its
    ``HashApp``, which in the 1,350-function sample equals ``HashFunction``),
    else by their request volume (the busiest get the biggest models: a harsher
    fleet). The frame's ``attrs["mapped_by"]`` says which, for the caller to print.
    """
    if workload.n_models == 1 or entry is not None:
        entry = entry or "llama-3-8b-instruct"
        models = assign_models(workload.ids, entry=entry)
        models.attrs["mapped_by"] = f"one catalogue entry ({entry})"
        return models
    order = workload.panel.counts.sum(axis=1)
    mapped_by = f"request volume (no {AZURE_MEMORY} covering every series under {traces_dir or 'no traces folder'})"
    if traces_dir is not None and (traces_dir / AZURE_MEMORY).is_file():
        memory = pd.read_csv(traces_dir / AZURE_MEMORY, usecols=["HashApp", "AverageAllocatedMb"])
        mb = memory.drop_duplicates("HashApp").set_index("HashApp")["AverageAllocatedMb"]
        aligned = mb.reindex(workload.ids.astype(str))
        if aligned.notna().all():
            order = aligned.to_numpy()
            mapped_by = f"memory ({traces_dir / AZURE_MEMORY})"
    models = assign_models(workload.ids, order_by=order)
    models.attrs["mapped_by"] = mapped_by
    return models


class LatencyInput:
    """The planner's latency input in the simulator, refreshed every ``refresh_s`` seconds.

    Uses a fitted :class:`~forecaster.coldstart.model.ColdStartModel` when given,
    else the bandwidth arithmetic of :mod:`forecaster.coldstart.physics`, at the
    current hour and the fleet's current concurrency (transfers per node,
    rounded).

    One input may serve several runs in turn (the benchmarks replay every policy and grid point with the same
    one): the cached table belongs to the run that made it. A table cached at the end of one run is never served
    to the next, whose clock starts again at 0: before that rule, every run after the first was planned with the
    first run's last table for its whole day.
    """

    def __init__(self, config: FleetConfig, model: ColdStartModel | None = None, refresh_s: float = 600.0):
        self.config = config
        self.model = model
        self.refresh_s = refresh_s
        self._cached: pd.DataFrame | None = None
        self._at = -np.inf
        self._view: weakref.ref | None = None

    def __call__(self, view: SimView) -> pd.DataFrame:
        same_run = self._view is not None and self._view() is view
        if self._cached is not None and same_run and 0.0 <= view.now_s - self._at < self.refresh_s:
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
        self._cached, self._at, self._view = table, view.now_s, weakref.ref(view)
        return table


FORECASTERS = ("ensemble", "empirical", "oracle")


class ForecastSources:
    """The forecast sources of one replayed workload, built once and shared by every policy that replays it.

    ``ensemble`` is the product's model (:class:`~forecaster.planning.ensemble_source.EnsembleForecast`: trained
    on the minutes before ``train_until_min``, retrained every ``retrain_every_min`` simulated minutes), so the
    replayed forecasts are the ones production would make; ``empirical`` and ``oracle`` are the reference
    sources of :mod:`forecaster.planning.forecasts`.

    Args:
        panel: the workload's per-minute counts.
        train_until_min: the first fit's minute (the end of the warm-up).
        retrain_every_min: simulated minutes between retrains (production retrains nightly; 360 on a one-day
            replay gives it real retrains).
        members: ensemble members instead of the product default (quick runs and tests only).
        settings: the product settings the ensemble is built with (default: defaults).
    """

    def __init__(self, panel, *, train_until_min: int, retrain_every_min: int = 360, members=None,
                 settings: Settings | None = None, progress: Callable[[str], None] | None = None) -> None:
        self.panel = panel
        self.train_until_min = train_until_min
        self.retrain_every_min = retrain_every_min
        self.members = members
        self.settings = settings or Settings()
        self.progress = progress
        self._sources: dict[str, object] = {}

    def get(self, forecaster: str):
        if forecaster not in FORECASTERS:
            raise ValueError(f"unknown forecaster {forecaster!r}; expected one of {list(FORECASTERS)}")
        if forecaster not in self._sources:
            if forecaster == "ensemble":
                from forecaster.planning.ensemble_source import EnsembleForecast

                self._sources[forecaster] = EnsembleForecast(
                    self.panel, train_until_min=self.train_until_min, retrain_every_min=self.retrain_every_min,
                    members=self.members, settings=self.settings, progress=self.progress)
            elif forecaster == "empirical":
                self._sources[forecaster] = EmpiricalForecast(self.panel)
            else:
                self._sources[forecaster] = OracleForecast(self.panel)
        return self._sources[forecaster]

    def report(self, forecaster: str) -> dict:
        """What the row reports about its forecaster: name, retrains and their cost."""
        source = self._sources.get(forecaster)
        out = {"forecaster": forecaster, "retrains": int(getattr(source, "retrains", 0) or 0)}
        extra = getattr(source, "report", None)
        if callable(extra):
            out["forecaster_report"] = extra()
        return out


def policy_forecaster(name: str, forecaster: str) -> str | None:
    """Which forecaster a policy name plans with (None: not a planner policy)."""
    if name == "prewarm_empirical":
        return "empirical"
    if name in ("prewarm", "prewarm_scale_only"):
        return forecaster
    if name == "oracle":
        return "oracle"
    return None


def make_policy(name: str, workload: Workload, config: FleetConfig, *, latency: LatencyInput | None = None,
                settings: PlannerSettings | None = None, cold_cost: float | None = None, forecaster: str = "ensemble",
                sources: ForecastSources | None = None, product: Settings | None = None,
                budget: WasteBudget | None = None, even_arrivals: bool = False):
    """A policy by its report name (one of :data:`POLICY_NAMES`, or ``keepalive_<minutes>``).

    Planner policies (``prewarm``, ``prewarm_empirical``, ``prewarm_scale_only``, ``oracle``) run the product's
    plan step with the product's settings (``product``, default: defaults) through its actuator; ``forecaster``
    names the source of ``prewarm`` and ``prewarm_scale_only``. ``budget`` puts them (not the oracle) in budget
    mode; default: the product's own budget (``PREWARM_PLANNER_WASTE_BUDGET_*``), if it sets one.
    ``even_arrivals`` plans them with a burst factor of 1 (:class:`~forecaster.simulation.policies.PlannerPolicy`).
    """
    product = product or Settings()
    latency = latency or LatencyInput(config)
    settings = settings or planner_settings(product)
    cold_cost = product.planner_cold_cost if cold_cost is None else cold_cost
    if name.startswith("keepalive_"):
        return KeepAlivePolicy(int(name.split("_", 1)[1]))
    if name == "hybrid_histogram":
        return HybridHistogramPolicy()
    if name == "reactive":
        return KnativePolicy()
    source_name = policy_forecaster(name, forecaster)
    if source_name is None:
        raise ValueError(f"unknown policy {name!r}; expected one of {list(POLICY_NAMES)} or keepalive_<minutes>")
    if sources is None:
        sources = ForecastSources(workload.panel, train_until_min=int(config.score_from_s // 60), settings=product)
    tiers = settings.tiers and name != "prewarm_scale_only"
    budget = waste_budget(product) if budget is None else budget
    return PlannerPolicy(sources.get(source_name), latency, replace(settings, tiers=tiers), name=name,
                         cold_cost=cold_cost, product=product,
                         budget=None if name == "oracle" else budget, even_arrivals=even_arrivals)


def run_policies(workload: Workload, models: pd.DataFrame, config: FleetConfig, names: list[str], *,
                 latency: LatencyInput | None = None, settings: PlannerSettings | None = None,
                 cold_cost: float | None = None, progress: Callable[[str, float], None] | None = None,
                 forecaster: str = "ensemble", sources: ForecastSources | None = None,
                 product: Settings | None = None, budget: WasteBudget | None = None,
                 even_arrivals: bool = False) -> dict[str, SimResult]:
    """Simulate each named policy on the same workload and fleet (planner policies share ``sources``)."""
    product = product or Settings()
    if sources is None:
        sources = ForecastSources(workload.panel, train_until_min=int(config.score_from_s // 60), settings=product)
    results = {}
    for name in names:
        policy = make_policy(name, workload, config, latency=latency, settings=settings, cold_cost=cold_cost,
                             forecaster=forecaster, sources=sources, product=product, budget=budget,
                             even_arrivals=even_arrivals)
        report = (lambda frac, _n=name: progress(_n, frac)) if progress else None
        results[name] = FleetSimulator(workload, models, policy, config, progress=report).run()
        if isinstance(policy, PlannerPolicy):
            s = policy.summaries
            actuation = policy.actuation.report() if policy.actuation is not None else {}
            results[name].extra["plans"] = {
                "plans": len(s), "late": int(sum(x["late"] for x in s)),
                "deferred": int(sum(x["deferred"] for x in s)),
                "budget_denied_replicas": int(sum(x["budget_denied_replicas"] for x in s)),
                "skipped_models": int(max((x.get("skipped", 0) for x in s), default=0)),
                "actions_by_kind": {k: int(sum(x["by_kind"].get(k, 0) for x in s))
                                    for k in ("prepull", "preload", "scale", "release")}}
            results[name].extra.update(sources.report(policy_forecaster(name, forecaster)))
            results[name].extra["cold_cost"] = policy.cold_cost
            results[name].extra["guardrail_refusals"] = actuation.get("guardrail_refusals", {})
            results[name].extra["actuator"] = actuation
            if policy.budget_state is not None:
                factors = policy.budget_factors
                results[name].extra["budget_state"] = {**policy.budget_state.as_dict(), "factor_quantiles": {
                    q: float(np.quantile(factors, q)) for q in (0.0, 0.1, 0.5, 0.9, 1.0)} if factors else {}}
    return results


class ReplayProgress:
    """Progress of long replays: ``name: 25% (simulated minute 360 of 1440, ETA 3m05s)`` every 5 %.

    Args:
        total_minutes: simulated minutes of the replay.
        echo: where lines go (default ``logging.info``).
    """

    def __init__(self, total_minutes: float, echo: Callable[[str], None] | None = None) -> None:
        self.total_minutes = total_minutes
        self.echo = echo or log.info
        self._started: dict[str, float] = {}

    def __call__(self, name: str, fraction: float) -> None:
        now = time.perf_counter()
        started = self._started.setdefault(name, now)
        eta = (now - started) / fraction * (1.0 - fraction) if fraction > 0 else float("nan")
        eta_text = f"{int(eta // 60)}m{int(eta % 60):02d}s" if np.isfinite(eta) else "?"
        self.echo(f"  {name}: {fraction:.0%} (simulated minute {fraction * self.total_minutes:.0f} of "
                  f"{self.total_minutes:.0f}, ETA {eta_text})")


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
