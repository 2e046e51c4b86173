"""The minute-level keep-alive protocol of ``../shared/EVALUATION.md`` section 2.

Each series is one function. A policy yields a boolean ``loaded`` matrix
(functions x minutes); minutes ``0 .. warmup - 1`` are warm-up, the rest are
scored:

* an invocation minute is a cold start when the function is not loaded in it
  (one cold start per cold minute, however many invocations it has);
* per-function cold % = cold minutes / invocations in the scored window; the
  headline is the 75th percentile over functions with invocations there;
* wasted memory time = loaded minutes without invocations x the function's
  memory, normalised by the 10-minute keep-alive (= 100 %).

Policies here: fixed keep-alive, the hybrid histogram
(:class:`~forecaster.simulation.policies.HybridHistogram`), the reactive
autoscaler at minute resolution (Knative keeps a replica for its 60 s stable
window plus the 30 s scale-to-zero grace: a 2-minute keep-alive), the oracle
(loaded exactly in invocation minutes; the first invocation of the trace is
cold), and prewarm: the planner of :mod:`forecaster.planning.planner` run once
a minute on the forecast for that minute, on a fleet with no GPU limit whose
"GPUs per replica" is the function's memory in GB and whose cold start costs
one minute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import pandas as pd

from forecaster.actuation.backends.base import ModelTarget, Outcome, ReplicaState
from forecaster.contracts.actions import Action, FailureReason
from forecaster.contracts.fleet import build_fleet
from forecaster.contracts.forecast import TrailingRequestRates, with_request_rates
from forecaster.contracts.phases import START_STATES
from forecaster.planning.budget import BudgetState, WasteBudget, idle_gpu_seconds, keepalive_idle_gpu_seconds, \
    update_budget
from forecaster.planning.fleet import PlannerSettings
from forecaster.planning.forecasts import CountPanel, EmpiricalForecast
from forecaster.planning.step import budget_after, plan_step
from forecaster.settings import Settings
from forecaster.simulation.policies import HybridHistogram, ReplayActuation

WARMUP_MIN = 240


@dataclass(frozen=True)
class MinuteScore:
    """Scores of one policy under the minute-level protocol."""

    cold_pct_p75: float
    cold_pct_overall: float
    wasted_memory_mb_min: float
    loaded_memory_mb_min: float
    cold_minutes: int
    invocations: int

    def as_dict(self, wasted_norm_pct: float | None = None) -> dict:
        out = {"cold_pct_p75": self.cold_pct_p75, "cold_pct_overall": self.cold_pct_overall,
               "wasted_memory_mb_min": self.wasted_memory_mb_min, "loaded_memory_mb_min": self.loaded_memory_mb_min,
               "cold_minutes": self.cold_minutes, "invocations": self.invocations}
        if wasted_norm_pct is not None:
            out["wasted_norm_pct"] = wasted_norm_pct
        return out


def score_loaded(counts: np.ndarray, memory_mb: np.ndarray, loaded: np.ndarray, warmup: int = WARMUP_MIN
                 ) -> MinuteScore:
    """Score a ``loaded`` matrix against ``counts`` (both functions x minutes)."""
    invoked = counts > 0
    scored = slice(warmup, None)
    cold = (invoked & ~loaded)[:, scored].sum(axis=1)
    n = counts[:, scored].sum(axis=1)
    active = n > 0
    pct = cold[active] / n[active] * 100.0
    idle = (loaded & ~invoked)[:, scored].sum(axis=1)
    held = (loaded | invoked)[:, scored].sum(axis=1)
    return MinuteScore(
        cold_pct_p75=float(np.percentile(pct, 75)) if active.any() else 0.0,
        cold_pct_overall=float(cold.sum() / n.sum() * 100.0) if n.sum() else 0.0,
        wasted_memory_mb_min=float((idle * memory_mb).sum()),
        loaded_memory_mb_min=float((held * memory_mb).sum()),
        cold_minutes=int(cold.sum()), invocations=int(n.sum()))


# --------------------------------------------------------------------------- reference policies


def keepalive_loaded(counts: np.ndarray, minutes: int) -> np.ndarray:
    """Loaded for ``minutes`` minutes after each invocation minute (``[t + 1, t + K]``)."""
    invoked = counts > 0
    n, t_count = counts.shape
    loaded = np.zeros_like(invoked)
    last = np.full(n, -10 ** 9)
    for t in range(t_count):
        loaded[:, t] = (t - last) <= minutes
        last = np.where(invoked[:, t], t, last)
    return loaded


def hybrid_loaded(counts: np.ndarray, **histogram_args) -> np.ndarray:
    """The hybrid histogram policy: the window decided after each invocation minute holds until the next."""
    invoked = counts > 0
    n, t_count = counts.shape
    state = HybridHistogram(n, **histogram_args)
    loaded = np.zeros_like(invoked)
    for t in range(t_count):
        loaded[:, t] = state.loaded(t)
        state.observe(t, invoked[:, t])
    return loaded


def oracle_loaded(counts: np.ndarray) -> np.ndarray:
    """Loaded exactly in invocation minutes, except each function's first invocation (nothing foretold it)."""
    invoked = counts > 0
    loaded = invoked.copy()
    first = np.argmax(invoked, axis=1)
    has = invoked.any(axis=1)
    loaded[np.flatnonzero(has), first[has]] = False
    return loaded


def reactive_loaded(counts: np.ndarray, stable_window_s: float = 60.0, grace_s: float = 30.0) -> np.ndarray:
    """Knative at minute resolution: a keep-alive of the stable window plus the scale-to-zero grace."""
    return keepalive_loaded(counts, int(np.ceil((stable_window_s + grace_s) / 60.0)))


# --------------------------------------------------------------------------- prewarm through the planner


class MinuteCluster:
    """The minute protocol's cluster behind the actuator: one replica count per function, set by the actuator.

    ``reactive_ask`` is 0: the protocol's reactive path loads a function only inside a minute it is invoked in,
    which the planner's floor never needs to cover.
    """

    name = "simulated-minute"
    sequential = True

    def __init__(self, ids: np.ndarray):
        self.index = {str(m): i for i, m in enumerate(ids)}
        self.current = np.zeros(len(ids), dtype=np.int64)

    def replica_state(self, model: ModelTarget) -> ReplicaState | None:
        i = self.index.get(model.model_id)
        return ReplicaState(current=0 if i is None else int(self.current[i]), reactive_ask=0)

    def carry_out(self, action: Action, *, model: ModelTarget, replicas: int | None, deadline_s: float) -> Outcome:
        i = self.index.get(action.model_id)
        if i is None or replicas is None:
            return Outcome.failed(FailureReason.NOT_FOUND, f"no function {action.model_id}")
        self.current[i] = int(replicas)
        return Outcome.ok(f"{action.model_id} at {replicas}")


def planner_loaded(counts: np.ndarray, memory_mb: np.ndarray, *, cold_cost: float,
                   source_factory: Callable[[CountPanel], object] | None = None, source: object | None = None,
                   start: pd.Timestamp = pd.Timestamp("2019-07-15", tz="UTC"), product: Settings | None = None,
                   progress: Callable[[float], None] | None = None, budget: WasteBudget | None = None
                   ) -> tuple[np.ndarray, dict]:
    """Drive the plan step once a minute, through the actuator, and read back whether each function is loaded.

    Each minute ``t`` the forecast source (``source``, else ``source_factory(panel)``, default
    :class:`~forecaster.planning.forecasts.EmpiricalForecast`; all causal) gives the quantiles and ``p_any`` of
    minute ``t`` from minutes before it, with each function's invocations per minute over the minutes before
    ``t`` (the look-back the forecast job stores with a run); the planner sees each function as a model with
    ``gpus`` = memory in GB and ``cold_cost`` = ``cold_cost``, weighted by the plan step as the product's
    ``planner_cold_cost_weighting`` says (by default ``model``: every function's cold-start percentage weighs the
    same, as in the protocol's per-function headline); a cold start costs 60 s.
    The plan goes through the production actuator (the ``actuator_*`` guardrails of ``product``) onto a
    :class:`MinuteCluster`: ``scale`` loads the function for minute ``t``, ``release`` unloads it.

    With a ``budget`` (budget mode, :mod:`forecaster.planning.budget`) the cold costs carry the controller's
    factor, updated before each minute's plan from the minute before: spent = loaded-but-idle minutes x memory
    (GB-seconds), and the normalised budget's reference = what a ``budget.reference_min``-minute keep-alive
    would have held idle in that minute on the same invocations (for 10 minutes, the protocol's 100 % exactly,
    minute by minute), so ``pct`` is the protocol's normalised waste, met causally.

    Returns:
        ``loaded`` (functions x minutes) and a summary (actions by reason, the actuator's report).
    """
    n, t_count = counts.shape
    ids = np.array([f"f{i}" for i in range(n)], dtype=object)
    panel = CountPanel(ids=ids, start=start, counts=counts)
    if source is None:
        source = (source_factory or EmpiricalForecast)(panel)
    product = product or Settings()
    settings = PlannerSettings(horizon_min=1, tiers=False, count_queued_wait=False, lead_margin_s=0.0,
                               lead_margin_frac=0.0, replica_utilisation=1.0,
                               cold_cost_weighting=product.planner_cold_cost_weighting)
    gpus = memory_mb / 1024.0
    latency = pd.DataFrame([{"model_id": i, "state": s, "total_s": 60.0} for i in ids for s in START_STATES])
    nodes = pd.DataFrame({"gpus_free": [1e12], "host_free_bytes": [0.0], "disk_free_bytes": [0.0]},
                         index=pd.Index(["minute-protocol"], name="node_id"))
    cluster = MinuteCluster(ids)
    targets = {str(i): ModelTarget(model_id=str(i), gpus_per_replica=int(np.ceil(g))) for i, g in zip(ids, gpus)}
    actuation = ReplayActuation(cluster, targets, product)
    loaded = np.zeros((n, t_count), dtype=bool)
    invoked = counts > 0
    rates = TrailingRequestRates(counts, product.forecast_lookback_min)
    reasons: dict[str, int] = {}
    base = pd.DataFrame({"image_ref": None, "image_bytes": 0.0, "weights_uri": None, "weights_bytes": 0.0,
                         "gpus": gpus, "replica_rpm": 1e12, "slo_s": np.nan}, index=pd.Index(ids, name="model_id"))
    state = BudgetState() if budget is not None else None
    factors: list[float] = []
    one_each = np.full(n, np.inf)
    for t in range(t_count):
        now = (start + timedelta(minutes=t)).to_pydatetime()
        if state is not None and t > 0:
            spent = idle_gpu_seconds(loaded[:, t - 1], counts[:, t - 1], one_each, gpus)
            window = counts[:, max(0, t - 1 - budget.reference_min):t]
            reference = keepalive_idle_gpu_seconds(window, one_each, gpus, minutes=budget.reference_min)
            state = update_budget(state, budget, spent_gpu_s=spent, reference_idle_gpu_s=reference)
            factors.append(state.factor)
        models = base.assign(cold_cost=cold_cost, replicas=cluster.current)
        forecast = with_request_rates(source.quantiles(now, 1), ids, rates.at(t))
        result = plan_step(now, forecast, build_fleet(models, nodes), latency, settings, budget=state,
                           budget_busy="replicas")
        state = budget_after(result, state)
        for action in result.actions:
            reasons[action.reason.value] = reasons.get(action.reason.value, 0) + 1
        actuation.submit(result, now)
        actuation.run_due(now)
        loaded[:, t] = cluster.current > 0
        # an invoked function is loaded during its minute whatever the plan said (the reactive path); the
        # protocol's replica stays until a release
        cluster.current = np.where(invoked[:, t], np.maximum(cluster.current, 1), cluster.current)
        if progress is not None and t % 120 == 0:
            progress(t / t_count)
    info = {"actions_by_reason": reasons, **actuation.report()}
    if state is not None:
        info["budget"] = {**state.as_dict(), "factor_quantiles": {
            q: float(np.quantile(factors, q)) for q in (0.0, 0.1, 0.5, 0.9, 1.0)} if factors else {}}
    return loaded, info
