"""The plan job (every minute): store -> planner -> actuator.

Collects what the pure planner needs from the store (the newest forecast run
per model, the fleet: catalogue, nodes, node caches, replicas as last set by
the actuator, and predicted cold-start latencies from the latency model
trained on observed cold starts), plans, and hands the plan to the actuator,
which records it and carries out what is due through the configured backend
(``dry-run`` by default). In the last minutes of an hour it then starts
building the next hour's latency table in the background (:func:`prefetch_latency`),
so the first plan of the hour does not pay it.

Budget mode (``PREWARM_PLANNER_WASTE_BUDGET_*``, see :mod:`forecaster.planning.budget`): before planning, the
job measures what was spent since the newest stored plan and updates the controller state stored in that plan's
summary (:func:`budget_state`); the plan's cold costs carry the new factor and its summary the new state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from forecaster.contracts.fleet import FleetState, build_fleet
from forecaster.contracts.forecast import REQUEST_RATE_COLUMN
from forecaster.contracts.latency import NodeLatencyTable
from forecaster.planning.budget import BudgetState, idle_gpu_seconds, keepalive_idle_gpu_seconds, update_budget
from forecaster.planning.step import plan_step, planner_settings, waste_budget
from forecaster.settings import Settings
from forecaster.store.actions import newest_plan_budget
from forecaster.store.fleet import read_fleet_inputs
from forecaster.store.forecasts import newest_issued_at, read_newest_runs
from forecaster.store.invocations import read_grid

log = logging.getLogger(__name__)


def stored_forecast(engine: Engine, *, now: datetime, horizon_min: int) -> pd.DataFrame:
    """The newest run per model issued at or before ``now``, minutes ``now .. now + horizon``, for the planner.

    With each model's ``request_rate_rpm`` as its run stored it (NaN for runs from before migration 0017).

    Each model's run is one primary-key probe; only the planned minutes of its
    arrays are read (see :func:`forecaster.store.forecasts.read_newest_runs`).
    Quantile columns are the levels every run has.
    """
    first = now.replace(second=0, microsecond=0)
    with engine.connect() as conn:
        runs = read_newest_runs(conn, issued_at_most=now, targets_from=first,
                                targets_before=first + timedelta(minutes=horizon_min), with_p_any=True,
                                with_request_rate=True)
    if not len(runs) or not runs.offsets[-1]:
        return pd.DataFrame(columns=["unique_id", "ds", "p_any"])
    common = sorted(set.intersection(*(set(levels) for levels in runs.levels)))
    if any(len(levels) != len(common) for levels in runs.levels):
        log.warning("forecast runs disagree on quantile levels; planning with the common ones %s", common)
    run = np.repeat(np.arange(len(runs)), runs.lengths)
    frame = pd.DataFrame({"unique_id": np.asarray(runs.model_ids, dtype=object)[run],
                          "ds": pd.to_datetime(runs.target_minutes_s(), unit="s", utc=True),
                          "p_any": runs.p_any, REQUEST_RATE_COLUMN: runs.request_rate_rpm[run]})
    # element e of run r, level l sits at quantile_offsets[r] + column(l) * T[r] + (e - offsets[r])
    within = np.arange(int(runs.offsets[-1])) - runs.offsets[:-1][run]
    columns = [f"q{level!r}" for level in common]
    for name, level in zip(columns, common):
        column = np.array([levels.index(level) for levels in runs.levels], dtype=np.int64)
        frame[name] = runs.quantile_values[runs.quantile_offsets[:-1][run] + column[run] * runs.lengths[run] + within]
    frame = frame[~np.isnan(runs.point)].sort_values(["unique_id", "ds"], ignore_index=True)
    # quantiles must not cross (the planner checks); tiny float noise is sorted out here
    if columns:
        frame[columns] = np.maximum.accumulate(frame[columns].to_numpy(dtype="float64"), axis=1)
    frame["p_any"] = frame["p_any"].astype("float64").clip(0.0, 1.0).fillna(1.0)
    return frame


def fleet_from_store(engine: Engine, *, now: datetime, default_cold_cost: float = 1.0,
                     model_ids: Sequence[str] | None = None) -> FleetState:
    """Catalogue, nodes and caches from the store, through the one fleet builder the simulator uses too.

    A model without a numeric ``cold_cost`` label gets ``default_cold_cost`` (``PREWARM_PLANNER_COLD_COST``).
    ``model_ids``: only those models (and every node), each as it is in the whole fleet's state
    (:func:`~forecaster.store.fleet.read_fleet_inputs`).
    """
    with engine.connect() as conn:
        models, nodes, artefacts = read_fleet_inputs(conn, now=now, model_ids=model_ids)
    models["cold_cost"] = models["cold_cost"].fillna(default_cold_cost)
    return build_fleet(models, nodes, artefacts)


def predicted_latency(engine: Engine, fleet: FleetState, *, now: datetime, settings: Settings | None = None
                      ) -> "pd.DataFrame | NodeLatencyTable":
    """Cold-start seconds per model, node of ``fleet`` and start state from the saved latency model.

    A :class:`~forecaster.contracts.latency.NodeLatencyTable` (float32 models x
    nodes x states; a frame per (model, state) when the fleet has no nodes): the planner reads,
    per model and state, the nodes a start from that state would use
    (:func:`forecaster.planning.fleet.node_latency`). The prior answers when no
    model is saved; a node without history falls back to the model's and tier's.
    No refit here: the nightly retrain trains the model (see
    :func:`forecaster.coldstart.service.train_latency_model`); this loads it
    once per version and predicts once per (version, hour, catalogue).
    """
    from forecaster.coldstart.service import latency_table

    return latency_table(engine, settings or Settings(), fleet.models, hour=now.astimezone(timezone.utc).hour, now=now,
                         nodes=_latency_nodes(fleet))


def _latency_nodes(fleet: FleetState) -> list[str] | None:
    """The node ids the latency table is asked for (None: a fleet without nodes gets the node-less frame)."""
    return list(fleet.nodes.index.astype(str)) if len(fleet.nodes) else None


def prefetch_latency(engine: Engine, fleet: FleetState, *, now: datetime, settings: Settings) -> bool:
    """After a plan in the hour's last minutes, build the next hour's latency table in the background.

    The same models, sizes and nodes as this plan's table, for the next UTC hour (see
    :func:`forecaster.coldstart.service.prefetch_next_hour`): the plan of minute :00 then finds its table
    cached (or waits for the build still running) instead of building it inside its minute (70 s at 100,000
    models x 64 nodes). Never fails the plan: an error starting it is logged, and the plan of :00 builds.

    Returns:
        Whether a build was started by this call.
    """
    from forecaster.coldstart.service import prefetch_next_hour

    try:
        return prefetch_next_hour(engine, settings, fleet.models, now=now, nodes=_latency_nodes(fleet)) is not None
    except Exception:  # noqa: BLE001 - an optimisation for the next hour must not fail this minute's plan
        log.exception("could not start the next hour's latency table; the first plan of that hour builds it")
        return False


def _no_events() -> pd.DataFrame:
    return pd.DataFrame(columns=["model_id", "node_id", "started_at", "total_seconds", "cache_state",
                                 "image_bytes", "weights_bytes", "concurrent_node_transfers",
                                 "concurrent_registry_pulls"])


MAX_BUDGET_GAP_MIN = 60


def budget_state(engine: Engine, settings: Settings, fleet: FleetState, *, now: datetime) -> BudgetState | None:
    """Budget mode's controller state for the plan at ``now`` (None when no budget is set).

    What was spent, measured from the store over the whole minutes since the newest plan with a budget state
    (at most :data:`MAX_BUDGET_GAP_MIN`; the first plan measures the minute before ``now``): per model and
    minute, the replicas the actuator last set (``fleet.models.replicas``, taken as held through those minutes)
    beyond the replica time the stored invocations of the minute kept busy (``count / replica_rpm``), x its
    GPUs x 60 s. Minutes the store has no counts for count as no requests. The
    normalised budget's reference is what a keep-alive of ``reference_min`` minutes would have held idle on
    the same stored invocations. A plan in the same minute as the newest one leaves the state as it was.
    """
    budget = waste_budget(settings)
    if budget is None:
        return None
    first = now.replace(second=0, microsecond=0)
    with engine.connect() as conn:
        previous = newest_plan_budget(conn)
    if previous is None:
        state, minutes = BudgetState(), 1
    else:
        planned_at, values = previous
        state = BudgetState.from_dict(values)
        gap = (first - planned_at.replace(second=0, microsecond=0)).total_seconds() / 60.0
        minutes = int(min(max(gap, 0.0), MAX_BUDGET_GAP_MIN))
    if minutes < 1 or not len(fleet.models):
        return state
    ids = [str(m) for m in fleet.models.index]
    width = minutes + budget.reference_min
    grid_ids, _, grid = read_grid(engine, ids, first - timedelta(minutes=width), first)
    order = pd.Index(grid_ids).get_indexer(ids)
    counts = np.nan_to_num(grid[order], nan=0.0)
    models = fleet.models
    rpm, gpus = models["replica_rpm"].to_numpy(dtype="float64"), models["gpus"].to_numpy(dtype="float64")
    spent = idle_gpu_seconds(models["replicas"].to_numpy(dtype="float64"), counts[:, -minutes:], rpm, gpus,
                             busy="requests")
    reference = keepalive_idle_gpu_seconds(counts, rpm, gpus, minutes=budget.reference_min, last=minutes,
                                           busy="requests")
    updated = update_budget(state, budget, spent_gpu_s=spent, reference_idle_gpu_s=reference, minutes=float(minutes))
    if updated.status in ("over_budget", "infeasible") and updated.status != state.status:
        share = (f"{100.0 * updated.spent / updated.allowed:.0f}% of the allowance" if updated.allowed >= 1.0
                 else f"{updated.spent:.0f} with {updated.allowed:.2g} allowed")
        log.warning("waste budget %s: the discounted idle GPU-seconds are %s after %.0f minutes over it, cold cost "
                    "at %.3g x the configured (lowest allowed %.3g x); GET /v1/budget shows the spend plan by plan",
                    updated.status.replace("_", " "), share, updated.over_minutes, updated.factor,
                    1.0 / budget.max_factor)
    return updated


def plan_job(engine: Engine, settings: Settings, now: datetime, *, actuator=None) -> dict:
    """Plan the next minutes from the stored forecasts and carry the plan out through the actuator.

    Args:
        actuator: the :class:`~forecaster.actuation.actuator.Actuator` to hand the plan to (default: one over
            the store with the backend ``settings.actuator_backend`` names; ``prewarm demo`` passes one whose
            backend is a simulated cluster).
    """
    from forecaster.actuation.actuator import Actuator, build_backend

    started = time.perf_counter()
    forecast = stored_forecast(engine, now=now, horizon_min=settings.plan_horizon_min)
    newest = newest_issued_at(engine, now=now)
    age_s = None if newest is None else round((now - newest).total_seconds(), 1)
    if forecast.empty:
        if newest is None:
            return {"skipped": "no forecasts yet"}
        log.warning("plan job at %s: forecasts expired (the newest run, issued %s, is %.0f s old and reaches no "
                    "planned minute); nothing planned, every model's replicas held (is the forecast job running?)",
                    now.isoformat(), newest.isoformat(), age_s)
        return {"skipped": "forecasts expired", "forecast_issued_at": newest.isoformat(), "forecast_age_s": age_s}
    if age_s is not None and age_s > settings.forecast_fresh_s:
        log.warning("plan job at %s: planning from a forecast run %.0f s old (PREWARM_FORECAST_FRESH_S=%g s; is the "
                    "forecast job running?)", now.isoformat(), age_s, settings.forecast_fresh_s)
    fleet = fleet_from_store(engine, now=now, default_cold_cost=settings.planner_cold_cost)
    latency = predicted_latency(engine, fleet, now=now, settings=settings)
    budget = budget_state(engine, settings, fleet, now=now)
    planned = plan_step(now, forecast, fleet, latency, planner_settings(settings), budget=budget)
    actuator = actuator or Actuator(engine, settings, build_backend(settings))
    submitted, reports = actuator.apply(planned, now=now)
    statuses: dict[str, int] = {}
    for report in reports:
        statuses[str(report.status)] = statuses.get(str(report.status), 0) + 1
    prefetched = prefetch_latency(engine, fleet, now=now, settings=settings)
    summary = {**planned.summary, "forecast_issued_at": None if newest is None else newest.isoformat(),
               "forecast_age_s": age_s,
               "forecast_stale": age_s is not None and age_s > settings.forecast_fresh_s}
    return {"actions": len(planned.actions), "carried_out": statuses, "summary": summary,
            "seconds": round(time.perf_counter() - started, 3), "latency_prefetch_started": prefetched}
