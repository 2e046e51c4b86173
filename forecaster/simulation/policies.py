"""Policies the fleet simulator runs, all through one interface.

A policy has ``name``, ``decide_every_s`` (how often ``decide`` is called),
``idle_grace_s`` (the serving layer keeps a model's last replica at least
this long after it last served; replicas beyond the floor and the recent
traffic's use stop as soon as nothing is queued, whatever the grace),
``reactive_overload`` (whether the serving layer adds replicas when a backlog
outgrows the ready ones) and
``decide(view) -> Decision | None`` returning replicas wanted per model
(``floor``) and/or planned actions. Every policy also gets the serving layer's
activator: a request that finds no replica, ready or starting, starts one.

* :class:`KeepAlivePolicy`: fixed keep-alive of ``K`` minutes after the last request.
* :class:`HybridHistogramPolicy`: "Serverless in the Wild" (Shahrad et al., ATC'20), see
  :class:`HybridHistogram`.
* :class:`KnativePolicy`: Knative's KPA: concurrency target, 60 s stable and
  6 s panic windows, panic at 200 %, scale to zero after a 30 s grace.
* :class:`PlannerPolicy`: prewarm's planner with any forecast source (tiered,
  scale-only, or the oracle with :class:`~forecaster.planning.forecasts.OracleForecast`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

import numpy as np
import pandas as pd

from forecaster.actuation.actuator import Actuator
from forecaster.actuation.backends.base import ModelTarget
from forecaster.actuation.ledger import MemoryLedger
from forecaster.contracts.actions import Plan
from forecaster.contracts.fleet import FleetState, build_fleet
from forecaster.contracts.forecast import ForecastSource, TrailingRequestRates, with_request_rates
from forecaster.planning.budget import BudgetState, WasteBudget, idle_gpu_seconds, keepalive_idle_gpu_seconds, \
    update_budget
from forecaster.planning.fleet import PlannerSettings
from forecaster.planning.step import budget_after, plan_step
from forecaster.settings import Settings
from forecaster.simulation.backend import SimulatedBackend
from forecaster.simulation.engine import Decision, SimView

HISTOGRAM_RANGE_MIN = 240


class HybridHistogram:
    """The hybrid histogram keep-alive policy's state for ``n`` functions (minute resolution).

    After each invocation minute ``t`` a function gets a loaded window
    ``[t + s, t + e]`` from its idle-time (IT) histogram, 1-minute bins over
    ``range_min`` minutes (EVALUATION.md section 2):

    * most ITs out of range: predict the next IT as the mean of the last three
      out-of-range ITs (the paper fits ARIMA to them; with at most a handful of
      such ITs in a day the mean is what an ARIMA(0,0,0) would give) and load
      from 85 % to 115 % of it;
    * fewer than ``min_its`` ITs, or the bin counts' coefficient of variation
      below ``cv_threshold``: fixed keep-alive of ``range_min`` minutes;
    * else pre-warm at 90 % of the 5th-percentile IT and keep alive until 110 %
      of the 99th (``s >= 1``: at least the minute after the invocation).
    """

    def __init__(self, n: int, range_min: int = HISTOGRAM_RANGE_MIN, min_its: int = 5, cv_threshold: float = 2.0):
        self.range_min = range_min
        self.min_its = min_its
        self.cv_threshold = cv_threshold
        self.hist = np.zeros((n, range_min + 1))
        self.oob: list[list[int]] = [[] for _ in range(n)]
        self.last = np.full(n, -1, dtype=np.int64)
        self.s = np.ones(n, dtype=np.int64)
        self.e = np.full(n, range_min, dtype=np.int64)

    def observe(self, t: int, invoked: np.ndarray) -> None:
        """Absorb minute ``t``: idle times of the functions invoked in it, and their new windows."""
        rows = np.flatnonzero(invoked)
        if not len(rows):
            return
        seen = rows[self.last[rows] >= 0]
        it = t - self.last[seen]
        inside = it <= self.range_min
        self.hist[seen[inside], it[inside]] += 1
        for i, gap in zip(seen[~inside], it[~inside]):
            self.oob[i].append(int(gap))
        self.last[rows] = t
        self._windows(rows)

    def _windows(self, rows: np.ndarray) -> None:
        hist = self.hist[rows, 1:]
        n_in = hist.sum(axis=1)
        n_oob = np.array([len(self.oob[i]) for i in rows])
        n_all = n_in + n_oob
        mean = hist.mean(axis=1)
        cv = np.where(mean > 0, hist.std(axis=1) / np.where(mean > 0, mean, 1), 0.0)
        s = np.ones(len(rows), dtype=np.int64)
        e = np.full(len(rows), self.range_min, dtype=np.int64)
        cdf = np.cumsum(hist, axis=1) / np.maximum(n_in, 1)[:, None]
        p5 = np.argmax(cdf >= 0.05, axis=1) + 1
        p99 = np.argmax(cdf >= 0.99, axis=1) + 1
        histogram = (n_all >= self.min_its) & (cv >= self.cv_threshold) & (n_in > 0)
        # (the small offsets keep 1.1 * 100 = 110.00000000000001 from rounding up to 111)
        s = np.where(histogram, np.maximum(1, np.floor(0.9 * p5 + 1e-9)).astype(np.int64), s)
        e = np.where(histogram, np.maximum(s, np.ceil(1.1 * p99 - 1e-9)).astype(np.int64), e)
        mostly_oob = (n_all > 0) & (n_oob > n_all / 2)
        for j in np.flatnonzero(mostly_oob):
            predicted = float(np.mean(self.oob[rows[j]][-3:]))
            s[j] = max(1, int(np.floor(0.85 * predicted + 1e-9)))
            e[j] = max(s[j], int(np.ceil(1.15 * predicted - 1e-9)))
        self.s[rows] = s
        self.e[rows] = e

    def loaded(self, t: int) -> np.ndarray:
        """(n,) whether each function is loaded during minute ``t`` (after its last invocation)."""
        age = t - self.last
        return (self.last >= 0) & (age >= self.s) & (age <= self.e)


# --------------------------------------------------------------------------- fleet policies


def _model_column(policy, view: SimView, column: str) -> np.ndarray:
    """``view.models[column]`` as float64, read once per models table (a pandas column read costs more than the
    rest of a tick's decision, and the table does not change during a run)."""
    cache = policy.__dict__.setdefault("_columns", {})
    models = view.models
    held = cache.get(column)
    if held is None or held[0] is not models:
        held = cache[column] = (models, models[column].to_numpy(dtype="float64"))
    return held[1]


def _replicas_for(counts_per_min: np.ndarray, rps: np.ndarray) -> np.ndarray:
    """Replicas a minute's requests keep busy: ceil(count / (rps * 60)), at least 1 when any."""
    return np.where(counts_per_min > 0, np.maximum(1, np.ceil(counts_per_min / (rps[:, None] * 60.0))), 0)


class KeepAlivePolicy:
    """Keep each model's replicas for ``minutes`` after its last request (as many as any minute in it needed)."""

    reactive_overload = True
    idle_grace_s = 0.0

    def __init__(self, minutes: int, decide_every_s: float = 1.0):
        self.minutes = minutes
        self.name = f"keepalive_{minutes}"
        self.decide_every_s = decide_every_s
        self._minute = -1
        self._window_need: np.ndarray | None = None

    def decide(self, view: SimView) -> Decision:
        rps = _model_column(self, view, "replica_rps")
        if view.minute != self._minute:
            self._minute = view.minute
            window = view.counts[:, max(0, view.minute - self.minutes):view.minute]
            self._window_need = (_replicas_for(window, rps).max(axis=1).astype(np.int64) if window.shape[1]
                                 else np.zeros(len(rps), dtype=np.int64))
        alive = view.now_s - view.last_arrival_s <= self.minutes * 60.0
        return Decision(floor=np.where(alive, np.maximum(self._window_need, 1), 0))


class HybridHistogramPolicy:
    """The hybrid histogram policy on the fleet: windows anchored at each model's last request."""

    reactive_overload = True
    idle_grace_s = 0.0
    name = "hybrid_histogram"

    def __init__(self, decide_every_s: float = 1.0, **histogram_args):
        self.decide_every_s = decide_every_s
        self.histogram_args = histogram_args
        self._state: HybridHistogram | None = None
        self._minute = 0

    def decide(self, view: SimView) -> Decision:
        n = len(view.models)
        if self._state is None:
            self._state = HybridHistogram(n, **self.histogram_args)
        while self._minute < view.minute:
            self._state.observe(self._minute, view.counts[:, self._minute] > 0)
            self._minute += 1
        age_min = (view.now_s - view.last_arrival_s) / 60.0
        st = self._state
        loaded = np.isfinite(view.last_arrival_s) & (age_min >= st.s - 1) & (age_min <= st.e)
        # the window opens at the start of minute t + s, i.e. (s - 1) minutes after the invocation minute ends
        return Decision(floor=loaded.astype(np.int64))


class KnativePolicy:
    """Knative's pod autoscaler (KPA), on observed concurrency (in service + queued at the activator).

    Args:
        target_utilisation: of a replica's concurrency capacity (``replica_rps x request_s``); Knative's
            default container-concurrency target utilisation is 70 %.
        stable_window_s: 60 s; the panic window is ``panic_window_pct`` % of it (10 % = 6 s).
        panic_threshold: panic when the panic-window desired replicas reach this multiple of the ready ones.
        scale_to_zero_grace_s: keep the last replica this long after the desired count reaches zero.
        tick_s: how often the autoscaler evaluates (2 s, as Knative).
    """

    reactive_overload = False
    idle_grace_s = 0.0
    name = "reactive"

    def __init__(self, target_utilisation: float = 0.7, stable_window_s: float = 60.0,
                 panic_window_pct: float = 10.0, panic_threshold: float = 2.0,
                 scale_to_zero_grace_s: float = 30.0, tick_s: float = 2.0):
        self.target_utilisation = target_utilisation
        self.stable_n = max(1, int(round(stable_window_s / tick_s)))
        self.panic_n = max(1, int(round(stable_window_s * panic_window_pct / 100.0 / tick_s)))
        self.panic_threshold = panic_threshold
        self.grace_s = scale_to_zero_grace_s
        self.decide_every_s = tick_s
        self._samples: np.ndarray | None = None
        self._k = 0
        self._panic_until: np.ndarray | None = None
        self._zero_since: np.ndarray | None = None
        self._desired: np.ndarray | None = None

    def decide(self, view: SimView) -> Decision:
        n = len(view.models)
        rps = _model_column(self, view, "replica_rps")
        request_s = _model_column(self, view, "request_s")
        if self._samples is None:
            self._samples = np.zeros((n, self.stable_n))
            self._panic_until = np.full(n, -1.0)
            self._zero_since = np.full(n, np.nan)
            self._desired = np.zeros(n, dtype=np.int64)
        tick = view.config.tick_s
        concurrency = view.served_last_tick / tick * request_s + view.queue
        self._samples[:, self._k % self.stable_n] = concurrency
        self._k += 1
        filled = min(self._k, self.stable_n)
        recent = [(self._k - 1 - j) % self.stable_n for j in range(min(self.panic_n, filled))]
        # means as sum / count (what ndarray.mean computes, without its per-call checks: this runs every 2 s)
        stable = np.add.reduce(self._samples[:, :filled], axis=1) / filled  # the ring fills from slot 0
        panic = np.add.reduce(self._samples[:, recent], axis=1) / len(recent)
        per_replica = np.maximum(self.target_utilisation * rps * request_s, 1e-9)
        want_stable = np.ceil(stable / per_replica - 1e-9).astype(np.int64)
        want_panic = np.ceil(panic / per_replica - 1e-9).astype(np.int64)
        ready = view.ready
        now = view.now_s
        entering = want_panic >= self.panic_threshold * np.maximum(ready, 1)
        entering &= want_panic > ready
        self._panic_until = np.where(entering, now + self.stable_n * self.decide_every_s, self._panic_until)
        in_panic = now < self._panic_until
        desired = np.where(in_panic, np.maximum(self._desired, want_panic), want_stable)
        # scale to zero only after the grace period
        zero = desired == 0
        self._zero_since = np.where(zero & np.isnan(self._zero_since), now, self._zero_since)
        self._zero_since = np.where(~zero, np.nan, self._zero_since)
        since = np.where(np.isnan(self._zero_since), now, self._zero_since)  # (no infinities: nan or a time)
        hold = zero & (now - since < self.grace_s) & (view.ready + view.starting > 0)
        desired = np.where(hold, 1, desired)
        self._desired = desired
        return Decision(floor=desired)


LatencyProvider = Callable[[SimView], pd.DataFrame]


class ReplayActuation:
    """The production actuator over an in-memory ledger, for a replay: what a policy's plans go through.

    Args:
        backend: the simulated cluster (:class:`~forecaster.simulation.backend.SimulatedBackend` or the
            minute protocol's).
        targets: the catalogue as the actuator sees it (GPUs per replica, for the GPU budget).
        settings: the product's settings (``actuator_*`` guardrails).
    """

    def __init__(self, backend, targets: dict[str, ModelTarget], settings: Settings) -> None:
        self.ledger = MemoryLedger(targets, paused=settings.actuator_kill_switch, keep_finished=False)
        self.actuator = Actuator(self.ledger, settings, backend)
        self.submitted = 0
        self.merged = 0

    def submit(self, plan: Plan, now: datetime) -> None:
        done = self.actuator.submit(plan, now=now)
        self.submitted += len(done.action_ids)
        self.merged += len(done.merged)

    def run_due(self, now: datetime) -> None:
        due = self.ledger.next_due_at()
        if due is not None and due <= now:
            self.actuator.run_due(now=now)

    def report(self) -> dict:
        """Actions by final status and the guardrails' refusals, for the benchmark's rows."""
        by_status: dict[str, int] = {}
        for (_kind, status, _reason), count in self.ledger.finished_counts.items():
            by_status[status] = by_status.get(status, 0) + count
        return {"submitted": self.submitted, "merged": self.merged, "by_status": by_status,
                "still_open": self.ledger.open_count(), "guardrail_refusals": dict(self.actuator.refusals)}


def model_targets(models: pd.DataFrame) -> dict[str, ModelTarget]:
    """Catalogue targets of the simulated models (GPUs per replica rounded up: the budget counts whole GPUs)."""
    gpus = np.ceil(models["gpus"].to_numpy(dtype="float64")).astype(int)
    return {str(i): ModelTarget(model_id=str(i), gpus_per_replica=int(g)) for i, g in zip(models.index, gpus)}


class PlannerPolicy:
    """prewarm in the loop, as in production: once a minute forecast -> fleet -> latency -> plan step, and the
    plan through the actuator (guardrails, merging, deadlines) onto the simulated cluster.

    Args:
        source: a :class:`~forecaster.contracts.forecast.ForecastSource`.
        latency: ``view -> latency frame`` (``model_id, state, total_s, <phases>``).
        settings: planner settings (``tiers=False`` for scale-ahead only), from
            :func:`~forecaster.planning.step.planner_settings`.
        name: reported policy name.
        cold_cost: value of one second of cold-start wait, GPU-seconds (the product's ``planner_cold_cost``).
            The plan step weights it per ``settings.cold_cost_weighting`` with each model's request rate, which
            the replay gives the forecast as the forecast job does (:meth:`with_request_rates`).
        product: the product settings whose ``actuator_*`` guardrails the replay applies (default: defaults).
        record_plans: keep every plan made (tests; off for long replays).
        even_arrivals: plan with a burst factor of 1, as the plan job does for a model whose counts come with no
            sub-minute data (Prometheus, pushes) and whose catalogue entry declares none.
        budget: budget mode (:mod:`forecaster.planning.budget`): before each plan the controller is updated with
            the minute before, as the plan job measures it: mean replicas held (ready + starting, sampled every
            tick) beyond the replica time the minute's requests kept busy (count / replica_rpm, the simulator's
            busy GPU-seconds), x GPUs x 60 s; the normalised budget's reference is a keep-alive of
            ``budget.reference_min`` minutes on the same counts, accounted the same way.
    """

    reactive_overload = True
    decide_every_s = 1.0  # the actuator runs due actions every tick; plans are made once a minute
    idle_grace_s = 60.0  # keep an on-demand start (the last replica) until the next plan decides

    def __init__(self, source: ForecastSource, latency: LatencyProvider, settings: PlannerSettings = PlannerSettings(),
                 *, name: str = "prewarm", cold_cost: float = 1.0, product: Settings | None = None, record_plans: bool = False, budget: WasteBudget | None = None,
                 even_arrivals: bool = False):
        self.source = source
        self.even_arrivals = even_arrivals
        self.budget = budget
        self.budget_state: BudgetState | None = BudgetState() if budget is not None else None
        self.budget_factors: list[float] = []
        self._held_replica_s: np.ndarray | None = None
        self._held_minute = -1
        self.latency = latency
        self.settings = settings
        self.name = name
        self.cold_cost = cold_cost
        self.product = product or Settings()
        self.summaries: list[dict] = []
        self.plans: list[Plan] | None = [] if record_plans else None
        self.actuation: ReplayActuation | None = None
        self._next_plan_s = 0.0

    def bind(self, sim) -> None:
        self.actuation = ReplayActuation(SimulatedBackend(sim), model_targets(sim.models), self.product)
        self.decide_every_s = sim.config.tick_s

    def model_frame(self, view: SimView) -> pd.DataFrame:
        """The catalogue rows the plan job reads from the store. The burst factor is the serving layer's running
        measurement. The plan job reads the same definition from the catalogue (:mod:`forecaster.contracts.bursts`),
        measured there from an ingested per-request trace or declared by the user."""
        m = view.models
        cold = np.full(len(m), self.cold_cost)
        return pd.DataFrame({
            "image_ref": m["image_ref"].to_numpy(), "image_bytes": m["image_bytes"].to_numpy(),
            "weights_uri": m["weights_uri"].to_numpy(), "weights_bytes": m["weights_bytes"].to_numpy(),
            "gpus": m["gpus"].to_numpy(dtype="float64"), "replica_rpm": m["replica_rps"].to_numpy() * 60.0,
            "cold_cost": cold, "slo_s": np.nan, "replicas": view.ready + view.starting,
            "burst_factor": 1.0 if self.even_arrivals else view.burst_factor,
        }, index=m.index.astype(str))

    def with_request_rates(self, forecast: pd.DataFrame, view: SimView) -> pd.DataFrame:
        """The forecast with each model's request rate over the minutes served so far, as the forecast job stores
        it with a run (:class:`~forecaster.contracts.forecast.TrailingRequestRates` over the product's look-back)."""
        rates = getattr(self, "_rates", None)
        if rates is None or rates.counts is not view.counts:  # running sums once per workload
            rates = self._rates = TrailingRequestRates(view.counts, self.product.forecast_lookback_min)
        return with_request_rates(forecast, view.models.index, rates.at(view.minute))

    def fleet(self, view: SimView, now: datetime) -> FleetState:
        """The simulated cluster through the one fleet builder (as the store feeds the plan job)."""
        inputs = view.fleet_inputs()
        transfers = inputs["transfers"]
        if len(transfers):  # (the fleet builder takes no rows as no frame)
            transfers = transfers.assign(ends_at=[now + timedelta(seconds=s - view.now_s)
                                                  for s in transfers["ends_at_s"]]).drop(columns="ends_at_s")
        return build_fleet(self.model_frame(view), inputs["nodes"], inputs["artefacts"], transfers)

    def _measure(self, view: SimView) -> None:
        """Budget mode: sample what is held this tick; at a new minute, update the controller with the last one."""
        models = view.models
        if self._held_replica_s is None:
            self._held_replica_s = np.zeros(len(models))
            self._held_minute = view.minute
        if view.minute != self._held_minute:
            m = self._held_minute
            gpus = models["gpus"].to_numpy(dtype="float64")
            rpm = models["replica_rps"].to_numpy(dtype="float64") * 60.0
            held = self._held_replica_s / 60.0
            spent = idle_gpu_seconds(held, view.counts[:, m], rpm, gpus, busy="requests")
            window = view.counts[:, max(0, m - self.budget.reference_min):m + 1]
            reference = keepalive_idle_gpu_seconds(window, rpm, gpus, minutes=self.budget.reference_min,
                                                   busy="requests")
            self.budget_state = update_budget(self.budget_state, self.budget, spent_gpu_s=spent,
                                              reference_idle_gpu_s=reference,
                                              minutes=float(view.minute - m))
            self.budget_factors.append(self.budget_state.factor)
            self._held_replica_s = np.zeros(len(models))
            self._held_minute = view.minute
        self._held_replica_s += (view.ready + view.starting) * self.decide_every_s

    def _moment(self, view: SimView) -> datetime:
        """``view.start + now_s`` as a datetime; whole seconds by datetime arithmetic (exact, and a pandas
        Timestamp + Timedelta per tick costs more than the rest of a tick's decision)."""
        seconds = float(view.now_s)
        if not seconds.is_integer():
            return (view.start + pd.Timedelta(seconds=seconds)).to_pydatetime()
        start = getattr(self, "_start", None)
        if start is None or start[0] is not view.start:
            start = self._start = (view.start, view.start.to_pydatetime())
        return start[1] + timedelta(seconds=int(seconds))

    def decide(self, view: SimView) -> None:
        if self.actuation is None:
            raise RuntimeError("PlannerPolicy acts through the simulator's actuator: run it in a FleetSimulator")
        now = self._moment(view)
        if self.budget is not None:
            self._measure(view)
        if view.now_s + 1e-9 >= self._next_plan_s:
            self._next_plan_s += 60.0
            forecast = self.with_request_rates(self.source.quantiles(now, self.settings.horizon_min), view)
            result = plan_step(now, forecast, self.fleet(view, now), self.latency(view), self.settings,
                               budget=self.budget_state)
            self.budget_state = budget_after(result, self.budget_state)
            self.summaries.append(result.summary)
            if self.plans is not None:
                self.plans.append(result)
            self.actuation.submit(result, now)
        self.actuation.run_due(now)
        return None
