"""Guardrails: pure checks that refuse or bound what a plan asks, never add to it.

* :func:`admit`: deadline passed, kill switch, actions per minute;
* :func:`bound_replicas`: a scale never below the reactive autoscaler's ask and within the scale-ahead GPU
  budget; a release never below the reactive ask;
* :func:`retry_at`: exponential back-off for temporary errors, none for permanent ones or past the deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from forecaster.actuation.backends.base import ReplicaState
from forecaster.contracts.actions import Action, ActionKind, FailureReason

MAX_BACKOFF_S = 300.0


def admit(action: Action, *, now: datetime, paused: bool, started_last_minute: int,
          max_actions_per_minute: int) -> FailureReason | None:
    """Why ``action`` must be dropped now, or None to go ahead. Checked in this order."""
    if now > action.deadline:
        return FailureReason.DEADLINE_PASSED
    if paused:
        return FailureReason.KILL_SWITCH
    if started_last_minute >= max_actions_per_minute:
        return FailureReason.RATE_LIMITED
    return None


@dataclass(frozen=True)
class ReplicaBound:
    """The replicas to set, or why nothing is set.

    Attributes:
        target: absolute replicas to set; None when dropped or nothing to do.
        dropped: the reason when the action cannot be carried out at all.
        noop: True when the cluster already has what the action asks.
        ahead_gpus: GPUs above the reactive ask once ``target`` is set.
        detail: the numbers behind the decision, for the audit trail.
    """

    target: int | None
    dropped: FailureReason | None = None
    noop: bool = False
    ahead_gpus: int = 0
    detail: dict = field(default_factory=dict)


def bound_replicas(action: Action, state: ReplicaState, *, gpus_per_replica: int, gpus_ahead_elsewhere: int,
                   gpu_budget: int | None) -> ReplicaBound:
    """Bound a scale or release by the reactive ask and the scale-ahead GPU budget.

    Args:
        action: a SCALE (have at least ``replicas``) or RELEASE (give back ``replicas``).
        state: the cluster's current replicas and reactive ask.
        gpus_per_replica: GPUs one replica holds.
        gpus_ahead_elsewhere: GPUs other models already hold above their reactive asks.
        gpu_budget: GPUs all scale-ahead together may hold above the reactive asks (None: no cap).
    """
    g = max(0, gpus_per_replica)
    floor = max(0, state.reactive_ask)
    info = {"planned": action.replicas, "current": state.current, "reactive_ask": floor,
            "gpus_per_replica": g, "gpus_ahead_elsewhere": gpus_ahead_elsewhere, "gpu_budget": gpu_budget}

    def ahead(replicas: int) -> int:
        return max(0, replicas - floor) * g

    if action.kind is ActionKind.SCALE:
        want = max(int(action.replicas or 0), floor)
        if want <= state.current:
            return ReplicaBound(target=None, noop=True, ahead_gpus=ahead(state.current),
                                detail={**info, "why": f"already {state.current} >= {want}"})
        if gpu_budget is not None and gpus_ahead_elsewhere + ahead(want) > gpu_budget:
            room = max(0, gpu_budget - gpus_ahead_elsewhere)
            allowed = floor + (room // g if g else 0)
            if allowed <= state.current:
                return ReplicaBound(target=None, dropped=FailureReason.GPU_BUDGET,
                                    detail={**info, "why": f"no GPU budget left for more than {allowed} replicas"})
            return ReplicaBound(target=allowed, ahead_gpus=ahead(allowed),
                                detail={**info, "clamped_from": want, "clamped_by": str(FailureReason.GPU_BUDGET)})
        return ReplicaBound(target=want, ahead_gpus=ahead(want), detail=info)

    if action.kind is ActionKind.RELEASE:
        want = state.current - int(action.replicas or 0)
        if want < floor:
            if floor >= state.current:
                return ReplicaBound(target=None, dropped=FailureReason.BELOW_REACTIVE,
                                    detail={**info, "why": f"the reactive autoscaler asks for {floor}"})
            return ReplicaBound(target=floor, ahead_gpus=0,
                                detail={**info, "clamped_from": want, "clamped_by": str(FailureReason.BELOW_REACTIVE)})
        if want >= state.current:
            return ReplicaBound(target=None, noop=True, ahead_gpus=ahead(state.current),
                                detail={**info, "why": "nothing to release"})
        return ReplicaBound(target=want, ahead_gpus=ahead(want), detail=info)

    raise ValueError(f"{action.kind} has no replicas to bound")


def retry_at(*, now: datetime, attempts: int, max_attempts: int, base_delay_s: float, deadline: datetime,
             temporary: bool) -> datetime | None:
    """When to try again after a failed attempt, or None (permanent error, attempts used up, or past deadline).

    Back-off doubles from ``base_delay_s`` (attempt 1 -> base, 2 -> 2x base, ...), capped at 300 s.
    """
    if not temporary or attempts >= max_attempts:
        return None
    delay = min(MAX_BACKOFF_S, base_delay_s * 2 ** (attempts - 1))
    when = now + timedelta(seconds=delay)
    return when if when < deadline else None
