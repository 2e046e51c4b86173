"""Budget mode: the operator states a waste budget and the planner's cold cost follows it, causally.

EVALUATION.md section 2 (v2): the policy must meet a stated waste budget by adjusting itself from what it has
spent so far, not by picking a point of a curve after scoring. The planner's one knob is the cold cost (the
value of a second of wait in GPU-seconds); spending more idle GPU-seconds buys fewer cold starts. Budget mode
multiplies every model's cold cost by a factor ``f = exp(u)`` and moves ``u`` after each plan:

* **what was spent** (``spent_gpu_s``, per plan interval): idle GPU-seconds, replicas held but not used
  (:func:`idle_gpu_seconds`). The plan job measures it from the store (replicas the actuator last set vs the
  replica time the stored invocations of the interval kept busy, count / replica_rpm: the fleet simulator's own
  accounting of busy GPU-seconds); the fleet replay the same way with the replicas it held (sampled every tick);
  the minute protocol as it scores, loaded-but-idle minutes x memory.
* **what was allowed** (``allowed_gpu_s``): the absolute budget (GPU-seconds per hour x the interval) and/or
  the normalised one: ``pct`` % of what a fixed keep-alive of ``reference_min`` minutes would have wasted on
  the same invocations in the same interval (:func:`keepalive_idle_gpu_seconds`; causal, it reads only
  minutes that have ended). With both set the smaller allowance holds.
* **what the plan would spend** (the spend curve): every plan in budget mode also predicts the idle GPU-seconds
  of its next minute at :data:`SPEND_CURVE_POINTS` cold-cost factors, log-evenly spaced over
  ``[1 / max_factor, max_factor]`` (:func:`spend_curve_log_factors`): the replicas its own scale and release
  rules would hold at each factor, less the replicas the forecast's quantiles say the minute's requests use
  (:func:`forecaster.planning.planner.plan`, ``spend_curve_multipliers``). The curve rides in the state
  (``curve``) to the next update.
* **the controller** (feed-forward): exponentially discounted totals over a window of ``window_min`` minutes,
  ``S <- l S + spent``, ``A <- l A + allowed``, ``C(f) <- l C(f) + minutes x curve(f)`` and
  ``P <- l P + minutes x curve(f_used)`` with ``l = exp(-dt / window_min)``, and ``S_c``, ``A_c`` the same sums
  of spend and allowance over the intervals a curve predicted. The curves' bias is ``b = S_c / P`` (what was
  spent over what they predicted at the factors used, within 10x either way), the pace error ``A / S`` (within
  4x either way; ``eps = 1e-9 + 0.01 (A + S)`` on both sides). The new factor is the one at which
  ``b^w C(f) = A_c x (A / S)^w``: the constant factor that would have met the allowance of the minutes the
  curves cover, spending less after the window overspent (and more after it underspent) so that the total comes
  back to the budget. ``w = 1 - exp(-t / window_min)``, ``t`` the minutes measured since the state began, is the
  share of the window the sums have read: a ratio read over the first minutes is not extrapolated to the whole
  window. (Without ``w``, and with the allowance of the first interval, which no curve predicted, on the right
  hand side, the demo's fresh fleet, whose replicas were still starting, read 17x under budget at its second plan,
  went to the bound ``max_factor`` for 17 minutes and overspent the next five hours: 108 % of the budget over six.)
  A state saved before ``t`` was kept reads as a full window. Before the first curve (a fresh state, or one
  saved before curves) the factor takes an integral step instead, ``u <- u + gain dt log(A / S)``.

Why feed-forward: the factor the budget needs drifts through the day (on the Azure day from about 0.5 at night
to about 0.3 by day, with the empirical source); an integral step only learns the drift from the spend it has
already made, a window's lag later, and over-shoots; the curve says at once what each factor would spend on the
minutes now coming. Why a long window: a budget is a total, and the cold cost that buys the fewest cold starts
for a total waste is a constant one (the Lagrange multiplier of "fewest cold starts subject to the summed waste"
is the same in every minute), so the factor should follow the drift of the trade-off, not the noise of the last
minutes. The window (240 minutes) was chosen by ``bench/budget_gains.py`` on the Azure day's warm-up minutes
0-239 only, from the fixed set {15, 30, 60, 120, 240} (none longer than the warm-up, which could not judge it),
budget 100 %: the longest whose spend over warm-up minutes 120-239 lands within 5 % of the budget. With the
share-of-window weight ``w`` (2bbca5d): 240: 97.0 %, 120: 97.7 %, 60: 98.7 %, 30: 99.8 %, 15: 100.4 %, so 240
again; before it 240: 100.7 %, 120: 100.1 %, 60: 99.95 %, 30: 100.2 %, 15: 100.5 % (the integral controller
before the curves spent 115 % at 60 minutes and 102.1 % at 30 there).
``max_factor`` (1000) bounds the cold cost to three orders of magnitude either way of the configured one.

Saying when the budget is not met: every update also says where the spend stands (``BudgetState.status``):
``on_budget`` (the discounted spend within :data:`BUDGET_TOLERANCE` of the discounted allowance, or under it),
``settling`` (over it, for less than :data:`OVER_BUDGET_MIN` minutes), ``over_budget`` (over it for that long:
the controller has not brought the spend down) and ``infeasible`` (over it with the cold cost at its lowest
allowed factor, ``1 / max_factor``, both in the interval measured and after the update: the planner cannot spend
less by valuing waits less; what is left is what the fleet holds anyway, e.g. replicas the reactive path keeps).
``over_minutes`` counts the minutes in a row over budget. The plan job logs a warning when the status turns
``over_budget`` or ``infeasible``, and the plan's summary carries it with the rest of the state.

What an operator reads: every state also keeps its last interval undiscounted (``interval_min``,
``interval_spent``, ``interval_allowed`` and ``interval_predicted``, the curve's prediction for it at the factor
used); ``GET /v1/budget``, the ``prewarm_waste_budget_*`` metrics and the dashboard show them plan by plan, so
spend against allowance, and the curves' prediction against the spend, can be followed through the day
(:func:`budget_history`).

Everything here is pure: :class:`BudgetState` is a small frozen value the drivers carry from plan to plan (the
plan job stores it in the plan's summary); :func:`update_budget` never returns NaN or infinity, and ignores a
non-finite or negative measurement (counted in ``ignored``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np


#: Share by which the discounted spend may exceed the discounted allowance and still count as on budget.
BUDGET_TOLERANCE = 0.05
#: Minutes over budget in a row after which the status is ``over_budget`` rather than ``settling`` (two hours: a
#: fixed time, not a number of pacing windows, since the feed-forward step does not settle at the window's pace).
OVER_BUDGET_MIN = 120.0
#: The statuses :func:`update_budget` gives (see the module docstring).
BUDGET_STATUSES = ("on_budget", "settling", "over_budget", "infeasible")
#: Points of the spend curve: cold-cost factors log-evenly spaced over ``[1 / max_factor, max_factor]``.
SPEND_CURVE_POINTS = 25
#: The pace correction of the feed-forward step stays within this ratio either way (see the module docstring).
MAX_PACE_RATIO = 4.0
#: The spend curve's bias (actual over predicted spend) stays within this ratio either way.
MAX_CURVE_BIAS = 10.0


def spend_curve_log_factors(max_factor: float) -> np.ndarray:
    """The fixed grid of log cold-cost factors at which the planner predicts its spend (budget mode)."""
    bound = math.log(max(float(max_factor), 1.0))
    return np.linspace(-bound, bound, SPEND_CURVE_POINTS)


@dataclass(frozen=True)
class WasteBudget:
    """The operator's waste budget and the controller's parameters (see the module docstring).

    Args:
        gpu_seconds_per_hour: idle GPU-seconds allowed per hour (absolute form).
        pct: % of what a ``reference_min``-minute keep-alive would have wasted on the same traffic (normalised).
        reference_min: the reference keep-alive, minutes (10: the protocol's 100 %).
        window_min: pacing window of the discounted totals, minutes.
        gain: integral gain per minute on log(cold cost); default ``1 / window_min``.
        max_factor: the cold cost stays within ``[1 / max_factor, max_factor]`` x the configured one.
    """

    gpu_seconds_per_hour: float | None = None
    pct: float | None = None
    reference_min: int = 10
    window_min: float = 240.0
    gain: float | None = None
    max_factor: float = 1000.0

    def __post_init__(self) -> None:
        for name in ("gpu_seconds_per_hour", "pct"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"waste budget {name} must be a finite number >= 0, got {value!r}")
        if self.gpu_seconds_per_hour is None and self.pct is None:
            raise ValueError("a waste budget needs gpu_seconds_per_hour and/or pct")
        if not (isinstance(self.reference_min, int) and self.reference_min >= 1):
            raise ValueError(f"reference_min must be a whole number of minutes >= 1, got {self.reference_min!r}")
        if not (math.isfinite(self.window_min) and self.window_min > 0):
            raise ValueError(f"window_min must be > 0, got {self.window_min!r}")
        if self.gain is not None and not (math.isfinite(self.gain) and self.gain > 0):
            raise ValueError(f"gain must be > 0, got {self.gain!r}")
        if not (math.isfinite(self.max_factor) and self.max_factor >= 1):
            raise ValueError(f"max_factor must be >= 1, got {self.max_factor!r}")

    @property
    def gain_per_min(self) -> float:
        return self.gain if self.gain is not None else 1.0 / self.window_min

    def allowed(self, minutes: float, reference_idle_gpu_s: float | None) -> float:
        """GPU-seconds the budget allows over ``minutes`` minutes in which the reference wasted the given amount."""
        options = []
        if self.gpu_seconds_per_hour is not None:
            options.append(self.gpu_seconds_per_hour * minutes / 60.0)
        if self.pct is not None and reference_idle_gpu_s is not None and math.isfinite(reference_idle_gpu_s):
            options.append(self.pct / 100.0 * max(reference_idle_gpu_s, 0.0))
        return float(min(options)) if options else 0.0


@dataclass(frozen=True)
class BudgetState:
    """The controller's state between plans (JSON-safe through :meth:`as_dict` / :meth:`from_dict`)."""

    log_factor: float = 0.0
    spent: float = 0.0  # discounted idle GPU-seconds
    allowed: float = 0.0  # discounted allowance
    spent_total: float = 0.0
    allowed_total: float = 0.0
    updates: int = 0
    ignored: int = 0
    over_minutes: float = 0.0  # minutes in a row with the discounted spend over budget
    status: str = "on_budget"
    curve_span: float = math.log(1000.0)  # log(max_factor): the spend curve's grid (spend_curve_log_factors)
    curve: tuple[float, ...] = ()  # the last plan's predicted idle GPU-seconds per minute at each grid factor
    curve_sum: tuple[float, ...] = ()  # discounted sum of the curves of the plans since (x their minutes)
    predicted: float = 0.0  # discounted sum of the curves at the factors used (what the curves predicted)
    # the last update's interval, undiscounted (what an operator reads: spent, allowed and predicted per interval)
    interval_min: float = 0.0
    interval_spent: float = 0.0
    interval_allowed: float = 0.0
    interval_predicted: float | None = None  # the previous plan's curve at its factor, x the minutes; None: no curve
    # the discounted spend and allowance of the intervals a curve predicted (what the curves are compared with)
    covered_spent: float = 0.0
    covered_allowed: float = 0.0
    elapsed_min: float | None = 0.0  # minutes measured since the state began; None: saved before it was kept

    @property
    def factor(self) -> float:
        """The multiplier on every model's cold cost."""
        return float(math.exp(self.log_factor))

    def cold_cost(self, base):
        """``base`` (a number or an array of cold costs) times the factor."""
        return base * self.factor

    def as_dict(self) -> dict:
        return {**asdict(self), "factor": self.factor}

    @classmethod
    def from_dict(cls, values: object) -> "BudgetState":
        """A state read back from a plan's summary; anything unusable starts afresh (never raises)."""
        if not isinstance(values, dict):
            return cls()
        fields = {}
        for name in ("log_factor", "spent", "allowed", "spent_total", "allowed_total"):
            v = values.get(name, 0.0)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                return cls()
            fields[name] = float(v)
        if min(fields["spent"], fields["allowed"], fields["spent_total"], fields["allowed_total"]) < 0:
            return cls()
        for name in ("updates", "ignored"):
            v = values.get(name, 0)
            fields[name] = int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
                else 0
        over = values.get("over_minutes", 0.0)  # states saved before the status have neither: on budget
        fields["over_minutes"] = float(over) if isinstance(over, (int, float)) and not isinstance(over, bool) \
            and math.isfinite(over) and over >= 0 else 0.0
        status = values.get("status", "on_budget")
        fields["status"] = status if status in BUDGET_STATUSES else "on_budget"
        span = values.get("curve_span", math.log(1000.0))
        if isinstance(span, (int, float)) and not isinstance(span, bool) and math.isfinite(span) and span >= 0:
            fields["curve_span"] = float(span)
        predicted = values.get("predicted", 0.0)
        fields["predicted"] = float(predicted) if isinstance(predicted, (int, float)) and not isinstance(
            predicted, bool) and math.isfinite(predicted) and predicted >= 0 else 0.0
        for name in ("curve", "curve_sum"):  # states saved before the feed-forward step have none: no curve yet
            fields[name] = _curve(values.get(name, ()))
        for name in ("interval_min", "interval_spent", "interval_allowed", "interval_predicted"):
            v = values.get(name)  # states saved before the interval fields have none
            if _usable(v):
                fields[name] = float(v)
        # states saved before these were kept: every interval counted as covered, the window as full (the old law)
        for name, fallback in (("covered_spent", "spent"), ("covered_allowed", "allowed")):
            v = values.get(name)
            fields[name] = float(v) if _usable(v) else fields[fallback]
        elapsed = values.get("elapsed_min")
        fields["elapsed_min"] = float(elapsed) if _usable(elapsed) else None
        return cls(**fields)

    def predicted_next_minute(self) -> float | None:
        """Idle GPU-seconds the last plan's spend curve predicts for its next minute at the factor it used."""
        if not self.curve:
            return None
        grid = spend_curve_log_factors(math.exp(self.curve_span))
        return float(np.interp(self.log_factor, grid, np.asarray(self.curve, dtype="float64")))

    def with_curve(self, curve) -> "BudgetState":
        """The state with the spend curve of the plan just made (per minute, at :func:`spend_curve_log_factors`)."""
        return replace(self, curve=_curve(curve))


def _usable(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _curve(values: object) -> tuple[float, ...]:
    """A spend curve as a tuple of :data:`SPEND_CURVE_POINTS` finite non-negative floats, or () when unusable."""
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != SPEND_CURVE_POINTS:
        return ()
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        return ()
    if not all(math.isfinite(v) and v >= 0 for v in out):
        return ()
    return out


def _solve_factor(log_factors: np.ndarray, spend: np.ndarray, target: float) -> float:
    """The log factor at which the (made non-decreasing) ``spend`` curve reaches ``target``, linear between
    grid points; the grid's ends when the target is out of the curve's range."""
    spend = np.maximum.accumulate(spend)
    if target <= spend[0]:
        return float(log_factors[0])
    if target >= spend[-1]:
        return float(log_factors[-1])
    j = int(np.argmax(spend >= target))  # first point at or above the target; j >= 1 here
    lo, hi = spend[j - 1], spend[j]
    frac = (target - lo) / (hi - lo) if hi > lo else 1.0
    return float(log_factors[j - 1] + frac * (log_factors[j] - log_factors[j - 1]))


def update_budget(state: BudgetState, budget: WasteBudget, *, spent_gpu_s: float, reference_idle_gpu_s: float | None,
                  minutes: float = 1.0) -> BudgetState:
    """One controller step after an interval of ``minutes`` minutes (see the module docstring)."""
    values = (spent_gpu_s, minutes) + (() if reference_idle_gpu_s is None else (reference_idle_gpu_s,))
    if not all(isinstance(v, (int, float, np.floating, np.integer)) and math.isfinite(v) and v >= 0 for v in values) \
            or minutes <= 0:
        return replace(state, ignored=state.ignored + 1, interval_min=0.0, interval_spent=0.0, interval_allowed=0.0,
                       interval_predicted=None)
    allowed = budget.allowed(minutes, reference_idle_gpu_s)
    keep = math.exp(-minutes / budget.window_min)
    s = keep * state.spent + float(spent_gpu_s)
    a = keep * state.allowed + allowed
    eps = 1e-9 + 0.01 * (a + s)
    error = math.log((a + eps) / (s + eps))
    bound = math.log(budget.max_factor)
    grid = spend_curve_log_factors(budget.max_factor)
    same_grid = abs(state.curve_span - bound) < 1e-9
    curve_sum = np.asarray(state.curve_sum, dtype="float64") * keep if state.curve_sum and same_grid else None
    predicted = keep * state.predicted if curve_sum is not None else 0.0
    covered_s = keep * state.covered_spent if curve_sum is not None else 0.0
    covered_a = keep * state.covered_allowed if curve_sum is not None else 0.0
    interval_predicted = None
    if state.curve and same_grid:  # the plan made at the start of this interval said what it would spend
        pending = np.asarray(state.curve, dtype="float64") * float(minutes)
        curve_sum = pending if curve_sum is None else curve_sum + pending
        interval_predicted = float(np.interp(state.log_factor, grid, pending))
        predicted += interval_predicted
        covered_s += float(spent_gpu_s)
        covered_a += allowed
    elapsed = None if state.elapsed_min is None else state.elapsed_min + float(minutes)
    fill = 1.0 if elapsed is None else -math.expm1(-elapsed / budget.window_min)
    if curve_sum is not None and predicted > 0 and curve_sum[-1] > 0:
        # feed-forward: the factor that would have met the allowance of the minutes the curves cover, repaying the
        # window's pace error; bias and pace count in proportion to the share of the window they were read over
        eps_c = 1e-9 + 0.01 * (covered_a + covered_s)
        bias = min(max((covered_s + eps_c) / (predicted + eps_c), 1.0 / MAX_CURVE_BIAS), MAX_CURVE_BIAS)
        pace = min(max(math.exp(error), 1.0 / MAX_PACE_RATIO), MAX_PACE_RATIO)
        log_factor = _solve_factor(grid, bias ** fill * curve_sum, covered_a * pace ** fill)
    else:  # no curve yet: the integral step
        log_factor = state.log_factor + budget.gain_per_min * minutes * error
    log_factor = min(max(log_factor, -bound), bound)
    over = s > (1.0 + BUDGET_TOLERANCE) * a + 1e-9
    over_minutes = state.over_minutes + float(minutes) if over else 0.0
    if not over:
        status = "on_budget"
    elif log_factor <= -bound + 1e-9 and state.log_factor <= -bound + 1e-9:  # spent over at the lowest factor
        status = "infeasible"
    elif over_minutes >= OVER_BUDGET_MIN:
        status = "over_budget"
    else:
        status = "settling"
    return BudgetState(log_factor=log_factor, spent=s, allowed=a, spent_total=state.spent_total + float(spent_gpu_s),
                       allowed_total=state.allowed_total + allowed, updates=state.updates + 1, ignored=state.ignored,
                       over_minutes=over_minutes, status=status, curve_span=bound,
                       curve_sum=() if curve_sum is None else tuple(float(v) for v in curve_sum), predicted=predicted,
                       interval_min=float(minutes), interval_spent=float(spent_gpu_s), interval_allowed=allowed,
                       interval_predicted=interval_predicted, covered_spent=covered_s, covered_allowed=covered_a,
                       elapsed_min=elapsed)


@dataclass(frozen=True)
class BudgetPoint:
    """One controller update as an operator follows it (:func:`budget_history`)."""

    planned_at: object  # the plan whose state it is (a datetime from the store)
    factor: float  # the cold-cost multiplier that plan used
    status: str
    interval_min: float  # minutes measured
    spent_gpu_s: float  # idle GPU-seconds held in them
    allowed_gpu_s: float  # what the budget allowed in them
    predicted_gpu_s: float | None  # what the plan before predicted it would spend in them; None: no curve
    window_spent_pct: float | None  # the discounted spend as % of the discounted allowance (what ``status`` reads)


def budget_history(rows) -> list[BudgetPoint]:
    """One point per controller update, oldest first, from ``(planned_at, stored state)`` rows oldest first.

    A plan in the same minute as the one before carries the state unchanged (the same ``updates``): one point for
    both, so no interval is counted twice. Rows whose state is unusable, or a fresh state before any update, give
    no point.
    """
    points: list[BudgetPoint] = []
    last_updates = None
    for planned_at, values in rows:
        state = BudgetState.from_dict(values)
        if state.updates == 0 or state.updates == last_updates:
            continue
        last_updates = state.updates
        points.append(BudgetPoint(
            planned_at=planned_at, factor=state.factor, status=state.status, interval_min=state.interval_min,
            spent_gpu_s=state.interval_spent, allowed_gpu_s=state.interval_allowed,
            predicted_gpu_s=state.interval_predicted,
            window_spent_pct=100.0 * state.spent / state.allowed if state.allowed > 0 else None))
    return points


# --------------------------------------------------------------------------- what was spent, what the reference spent


BUSY_KINDS = ("replicas", "requests")


def _need(counts: np.ndarray, replica_rpm: np.ndarray, busy: str = "replicas") -> np.ndarray:
    """Replicas a minute's requests used (0 for unknown counts).

    ``busy="replicas"``: whole replicas, ceil(count / replica_rpm), at least 1 with any request (the minute
    protocol's accounting: a loaded minute with an invocation is not waste). ``busy="requests"``: the share of
    replica time the requests kept busy, count / replica_rpm (the fleet simulator's accounting, busy GPU-seconds
    = served requests x GPUs / replica_rps, and what the plan job can measure from stored counts).
    """
    if busy not in BUSY_KINDS:
        raise ValueError(f"busy must be one of {BUSY_KINDS}, got {busy!r}")
    c = np.nan_to_num(np.asarray(counts, dtype="float64"), nan=0.0, posinf=0.0, neginf=0.0).clip(min=0.0)
    rpm = np.asarray(replica_rpm, dtype="float64")
    rpm = np.where(np.isfinite(rpm) & (rpm > 0), rpm, np.inf)
    rpm = rpm if c.ndim == 1 else rpm[:, None]
    if busy == "requests":
        return c / rpm
    return np.where(c > 0, np.maximum(1.0, np.ceil(c / rpm)), 0.0)


def idle_gpu_seconds(replicas_held: np.ndarray, counts: np.ndarray, replica_rpm: np.ndarray, gpus: np.ndarray,
                     *, busy: str = "replicas") -> float:
    """Idle GPU-seconds of ``replicas_held`` (per model) over the minutes in ``counts`` (models x minutes, or one
    minute per model): per minute, held replicas beyond what the minute's requests used (``busy``, see
    :func:`_need`), x GPUs x 60 s."""
    counts = np.asarray(counts, dtype="float64")
    counts = counts[:, None] if counts.ndim == 1 else counts
    held = np.nan_to_num(np.asarray(replicas_held, dtype="float64"), nan=0.0).clip(min=0.0)[:, None]
    g = np.nan_to_num(np.asarray(gpus, dtype="float64"), nan=0.0).clip(min=0.0)[:, None]
    idle = np.maximum(held - _need(counts, replica_rpm, busy), 0.0)
    return float((idle * g).sum() * 60.0)


def keepalive_idle_gpu_seconds(counts: np.ndarray, replica_rpm: np.ndarray, gpus: np.ndarray, *, minutes: int = 10,
                               last: int = 1, busy: str = "replicas") -> float:
    """Idle GPU-seconds a fixed keep-alive of ``minutes`` would have held in the last ``last`` columns of ``counts``.

    ``counts`` (models x minutes, ended minutes only) must reach ``minutes`` columns before the scored ones. In a
    scored minute a model is alive when it had requests in one of the ``minutes`` minutes before; it holds as many
    replicas as the busiest of them used (as :class:`~forecaster.simulation.policies.KeepAlivePolicy`; with
    requests in the minute, at least what they need), and what the minute's own requests did not use (``busy``,
    see :func:`_need`) is idle. With one replica per model and ``busy="replicas"`` this is the minute protocol's
    keep-alive waste exactly (loaded and not invoked).
    """
    counts = np.asarray(counts, dtype="float64")
    if counts.ndim != 2 or counts.shape[1] == 0:
        return 0.0
    whole = _need(counts, replica_rpm, "replicas")
    used = whole if busy == "replicas" else _need(counts, replica_rpm, busy)
    g = np.nan_to_num(np.asarray(gpus, dtype="float64"), nan=0.0).clip(min=0.0)
    total = 0.0
    width = counts.shape[1]
    for j in range(max(0, width - last), width):
        window = whole[:, max(0, j - minutes):j]
        if not window.shape[1]:
            continue
        hold = window.max(axis=1)
        hold = np.where(hold > 0, np.maximum(hold, whole[:, j]), 0.0)
        total += float((np.maximum(hold - used[:, j], 0.0) * g).sum() * 60.0)
    return total
