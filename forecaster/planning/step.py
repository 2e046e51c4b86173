"""The one plan step every driver calls: the plan job (store), the fleet simulator and the minute protocol.

``plan_step(now, forecasts, fleet, latency, settings)`` is the pure decider of the control loop (Knative's
scaler, not its reconciler): it reads a forecast frame (:mod:`forecaster.contracts.forecast`), a fleet state
from :func:`forecaster.contracts.fleet.build_fleet` and a latency frame, and returns a
:class:`~forecaster.contracts.actions.Plan`. Drivers differ only in where the inputs come from and where the
plan goes (an actuator with a real, dry-run or simulated backend).

Models it cannot use (a catalogue value the fleet builder refused, a forecast row with NaN or negative values)
are left out, counted in the plan's summary (``skipped``) and logged by name; the rest are planned.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime

import numpy as np
import pandas as pd

from forecaster.contracts.actions import Plan
from forecaster.contracts.fleet import FleetState
from forecaster.contracts.forecast import REQUEST_RATE_COLUMN, float_columns, quantile_levels
from forecaster.planning.budget import BudgetState, WasteBudget, spend_curve_log_factors
from forecaster.planning.fleet import PlannerSettings
from forecaster.planning.planner import plan
from forecaster.settings import Settings

log = logging.getLogger(__name__)


def planner_settings(settings: Settings, **overrides) -> PlannerSettings:
    """The planner's costs and limits from the product's settings (``PREWARM_PLANNER_*``, ``plan_horizon_min``).

    Args:
        settings: the validated settings.
        **overrides: fields of :class:`PlannerSettings` to set instead (a benchmark's grid, ``tiers=False``).
    """
    values = dict(
        horizon_min=settings.plan_horizon_min, gpu_second_cost=settings.planner_gpu_second_cost,
        count_queued_wait=settings.planner_count_queued_wait,
        replica_utilisation=settings.planner_replica_utilisation, gpu_budget=settings.planner_gpu_budget,
        gpu_headroom=settings.planner_gpu_headroom, max_transfers_per_node=settings.planner_max_transfers_per_node,
        max_transfers_per_registry=settings.planner_max_transfers_per_registry, tiers=settings.planner_tiers,
        max_tier_nodes=settings.planner_max_tier_nodes, max_tier_actions=settings.planner_max_tier_actions,
        byte_cost=settings.planner_byte_cost, host_byte_second_cost=settings.planner_host_byte_second_cost,
        lead_margin_s=settings.planner_lead_margin_s, lead_margin_frac=settings.planner_lead_margin_frac,
        release_hold_min=settings.planner_release_hold_min,
        quantile_for_shape=settings.planner_quantile_for_shape,
        cold_cost_weighting=settings.planner_cold_cost_weighting,
    )
    values.update(overrides)
    return PlannerSettings(**values)


def waste_budget(settings: Settings, *, pct: float | None = None, gpu_seconds_per_hour: float | None = None
                 ) -> WasteBudget | None:
    """Budget mode's budget from the settings (``PREWARM_PLANNER_WASTE_BUDGET_*``), or None when none is set.

    ``pct`` / ``gpu_seconds_per_hour`` replace the settings' values (a replay's ``--waste-budget``).
    """
    pct = settings.planner_waste_budget_pct if pct is None else pct
    absolute = settings.planner_waste_budget_gpu_seconds_per_hour if gpu_seconds_per_hour is None \
        else gpu_seconds_per_hour
    if pct is None and absolute is None:
        return None
    return WasteBudget(gpu_seconds_per_hour=absolute, pct=pct,
                       reference_min=settings.planner_waste_budget_reference_min,
                       window_min=settings.planner_waste_budget_window_min, gain=settings.planner_waste_budget_gain,
                       max_factor=settings.planner_waste_budget_max_factor)


def weighted_cold_costs(cold_cost: np.ndarray, request_rate_rpm: np.ndarray, weighting: str) -> np.ndarray:
    """Cold costs under ``weighting`` (``PREWARM_PLANNER_COLD_COST_WEIGHTING``).

    The planner charges a cold start the wait it causes, in request-seconds, times the model's cold cost: left
    alone (``"request"``) a busy model's cold start counts its many waiting requests, a rarely called model's one,
    so the plan minimises the fleet's cold requests and leaves rare models cold most of the time. ``"model"``
    multiplies each model's cold cost by ``mean rate / its rate``: a cold request then weighs as the share of its
    own model's requests it is, every model's cold-start share alike, and the weights average 1 over the fleet's
    traffic (``sum(w * rate) = sum(rate)``), so the cold cost keeps its meaning for a model at the mean rate and a
    fleet of one model plans as under ``"request"``. A model without a known rate (NaN) gets weight 1.

    Measured on the Azure Functions day (1,350 functions, the minute protocol's hold rule in closed form with the
    causal empirical ``p_any``, ``bench/cold_cost_weighting.py``, 2026-12-07): at the hybrid histogram's waste,
    p75 cold % 12.5 under ``"model"`` against 24.8 under ``"request"`` (the hybrid: 20.0), overall cold % 0.27
    against 0.19. ``"model"`` is the default because the product's claim is made, and its SLO commonly set, per
    model; ``"request"`` is the choice where only the fleet's total of cold requests matters.
    """
    cold_cost = np.asarray(cold_cost, dtype="float64")
    if weighting == "request":
        return cold_cost
    if weighting != "model":
        raise ValueError(f"cold_cost_weighting must be 'model' or 'request', got {weighting!r}")
    rate = np.asarray(request_rate_rpm, dtype="float64")
    known = np.isfinite(rate) & (rate > 0)
    if not known.any():
        return cold_cost
    mean = float(rate[known].mean())
    return cold_cost * np.where(known, mean / np.where(known, rate, 1.0), 1.0)


def _request_rates(forecasts: pd.DataFrame, model_ids: pd.Index) -> np.ndarray:
    """Each model's ``request_rate_rpm`` from the forecast frame (its first row), NaN where not given."""
    if REQUEST_RATE_COLUMN not in forecasts.columns or forecasts.empty:
        return np.full(len(model_ids), np.nan)
    ids = forecasts["unique_id"].to_numpy()
    first = np.concatenate([[True], ids[1:] != ids[:-1]])  # frames come grouped by model
    rates = pd.Series(forecasts[REQUEST_RATE_COLUMN].to_numpy(dtype="float64")[first], index=ids[first].astype(str))
    rates = rates[~rates.index.duplicated()]
    return rates.reindex(model_ids.astype(str)).to_numpy(dtype="float64")


def _usable_forecast(forecasts: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, str]]:
    """Rows the planner can read; models with a NaN, infinite or negative value are dropped whole: they are
    planned as without a forecast (no scale or release action; their level held, ``summary["held_no_forecast"]``)
    and named in ``summary["skipped_models"]``."""
    if forecasts.empty:
        return forecasts, {}
    columns = [c for _, c in quantile_levels(forecasts)] + (["p_any"] if "p_any" in forecasts.columns else [])
    values = float_columns(forecasts, columns)
    bad_row = ~np.isfinite(values).all(axis=1) | (values < 0).any(axis=1)
    if "p_any" in forecasts.columns:
        bad_row |= forecasts["p_any"].to_numpy(dtype="float64") > 1
    if not bad_row.any():
        return forecasts, {}
    bad_models = set(forecasts["unique_id"].to_numpy()[bad_row].astype(str))
    keep = ~forecasts["unique_id"].astype(str).isin(bad_models).to_numpy()
    return forecasts[keep], {m: "forecast has NaN, infinite or out-of-range values" for m in sorted(bad_models)}


def plan_step(now: datetime, forecasts: pd.DataFrame, fleet: FleetState, latency: pd.DataFrame,
              settings: PlannerSettings, *, budget: BudgetState | None = None, budget_busy: str = "requests") -> Plan:
    """Plan the next ``settings.horizon_min`` minutes (see the module docstring).

    Args:
        now: the minute planned from (UTC, tz-aware).
        forecasts: the forecast frame (``unique_id, ds, q<level>..., [p_any], [request_rate_rpm]``); its request
            rates weight the cold costs per ``settings.cold_cost_weighting`` (:func:`weighted_cold_costs`).
        fleet: from :func:`~forecaster.contracts.fleet.build_fleet`; its ``skipped`` models are reported.
        latency: ``model_id, state, total_s, <phases>`` per start state.
        settings: from :func:`planner_settings`.
        budget: budget mode's controller state (:mod:`forecaster.planning.budget`), already updated by the driver
            with what was spent up to ``now``: every model's cold cost is multiplied by its factor, and the state
            goes into ``summary["budget"]`` with the plan's spend curve (its predicted idle GPU-seconds in the next
            minute at every factor of the controller's grid), which the next update reads: the plan job reads it
            back from the newest stored plan, the replays with :func:`budget_after`.
        budget_busy: how the driver counts busy replicas when it measures the spend (``"requests"``: the plan job
            and the fleet replay; ``"replicas"``: the minute protocol), so that the curve predicts what it measures.

    Returns:
        The plan; ``summary["skipped"]`` counts the models left out and ``summary["skipped_models"]`` names up to
        20 of them with the reason.
    """
    forecasts, bad_forecasts = _usable_forecast(forecasts)
    skipped = {**fleet.skipped, **bad_forecasts}
    if skipped:
        log.warning("plan step at %s skips %d models it cannot use: %s", now.isoformat(), len(skipped),
                    "; ".join(f"{m}: {why}" for m, why in list(skipped.items())[:5]))
    if settings.cold_cost_weighting != "request":
        fleet = replace(fleet, models=fleet.models.assign(cold_cost=weighted_cold_costs(
            fleet.models["cold_cost"].to_numpy(dtype="float64"), _request_rates(forecasts, fleet.models.index),
            settings.cold_cost_weighting)))
    if budget is not None:
        fleet = replace(fleet, models=fleet.models.assign(cold_cost=budget.cold_cost(
            fleet.models["cold_cost"].to_numpy(dtype="float64"))))
    multipliers = None if budget is None else \
        np.exp(spend_curve_log_factors(np.exp(budget.curve_span)) - budget.log_factor)
    result = plan(forecasts, latency, fleet, settings, now, spend_curve_multipliers=multipliers,
                  spend_curve_busy=budget_busy)
    summary = {**result.summary, "skipped": len(skipped),
               "skipped_models": dict(list(skipped.items())[:20])}
    if budget is not None:
        summary["budget"] = budget.with_curve(summary.pop("spend_curve_gpu_s")).as_dict()
    return Plan(planned_at=result.planned_at, actions=result.actions, summary=summary)


def budget_after(plan: Plan, state: BudgetState | None) -> BudgetState | None:
    """Budget mode's state as the plan left it (with its spend curve), for the driver's next update; ``state``
    itself when the plan carries none."""
    if state is None or "budget" not in plan.summary:
        return state
    return BudgetState.from_dict(plan.summary["budget"])
