"""The plan: what the planner decides and the actuator carries out (spec), and what happened (status).

Shared contract between the planner (a pure decider, never talks to the
cluster) and the actuator (applies, never decides), after kube-fledged's and
OpenKruise's spec/status split. Reasons and failures come from fixed sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum


class ActionKind(StrEnum):
    PREPULL = "prepull"  # pull the model's image onto a node
    PRELOAD = "preload"  # fetch the model's weights into a node's cache tier
    SCALE = "scale"  # have at least `replicas` ready replicas (ahead of demand)
    RELEASE = "release"  # give back replicas no longer needed


class Tier(StrEnum):
    """Where pre-loaded weights sit on a node, from cheapest to warmest."""

    DISK = "disk"
    HOST = "host"
    GPU = "gpu"


class Reason(StrEnum):
    """Why the planner asked for an action."""

    FORECAST_SPIKE = "forecast_spike"  # the high quantile exceeds current capacity
    FORECAST_DEMAND = "forecast_demand"  # demand expected where none is served now
    SLO_COVER = "slo_cover"  # predicted cold start would break the model's SLO
    CACHE_WARM = "cache_warm"  # cheap tier warmed so a later scale-up is fast
    IDLE_RELEASE = "idle_release"  # forecast demand below capacity for long enough
    BUDGET_PREEMPT = "budget_preempt"  # GPUs moved to a model that avoids more wait per GPU-second


class ActionStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # permanent failure, see FailureReason
    DROPPED = "dropped"  # not attempted: guardrail or deadline, see FailureReason


class FailureReason(StrEnum):
    """Why an action failed or was dropped (the agent's and the actuator's fixed set)."""

    NOT_FOUND = "not_found"
    UNAUTHORISED = "unauthorised"
    NO_SPACE = "no_space"
    TIMEOUT = "timeout"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    RUNTIME_UNAVAILABLE = "runtime_unavailable"
    NO_GPU = "no_gpu"
    DEADLINE_PASSED = "deadline_passed"
    KILL_SWITCH = "kill_switch"
    RATE_LIMITED = "rate_limited"
    GPU_BUDGET = "gpu_budget"
    BELOW_REACTIVE = "below_reactive"
    UNSUPPORTED = "unsupported"  # the configured backend cannot carry out this kind of action
    INTERNAL = "internal"


@dataclass(frozen=True)
class Action:
    """One unit of pre-warm work with a deadline.

    Attributes:
        kind: what to do.
        model_id: the serving model it is for.
        reason: why (from :class:`Reason`).
        not_before: do not start before this time (UTC).
        deadline: pointless after this time: the demand it serves has arrived.
        node_id: target node (prepull, preload); None for scale/release.
        target: image reference (prepull) or weights URI (preload).
        tier: cache tier for preload.
        replicas: desired ready replicas (scale) or replicas to give back (release).
        expected_benefit_s: cold-start seconds of waiting expected to be avoided.
        expected_cost: GPU-seconds (scale) or bytes moved (prepull, preload).
    """

    kind: ActionKind
    model_id: str
    reason: Reason
    not_before: datetime
    deadline: datetime
    node_id: str | None = None
    target: str | None = None
    tier: Tier | None = None
    replicas: int | None = None
    expected_benefit_s: float = 0.0
    expected_cost: float = 0.0

    def __post_init__(self) -> None:
        if self.deadline < self.not_before:
            raise ValueError(f"{self.kind} for {self.model_id}: deadline before not_before")
        if self.kind in (ActionKind.PREPULL, ActionKind.PRELOAD) and (not self.node_id or not self.target):
            raise ValueError(f"{self.kind} for {self.model_id} needs node_id and target")
        if self.kind is ActionKind.PRELOAD and self.tier is None:
            raise ValueError(f"preload for {self.model_id} needs a tier")
        if self.kind in (ActionKind.SCALE, ActionKind.RELEASE) and (self.replicas is None or self.replicas < 0):
            raise ValueError(f"{self.kind} for {self.model_id} needs replicas >= 0")

    @property
    def key(self) -> str:
        """Idempotency key: the same work on the same node is one unit, whatever plan asked for it."""
        return ":".join(str(p) for p in (self.kind, self.model_id, self.node_id or "-", self.target or "-",
                                         self.tier or "-", self.replicas if self.replicas is not None else "-"))

    def to_spec(self) -> dict:
        return {
            "kind": str(self.kind), "model_id": self.model_id, "reason": str(self.reason),
            "not_before": self.not_before.isoformat(), "deadline": self.deadline.isoformat(),
            "node_id": self.node_id, "target": self.target, "tier": None if self.tier is None else str(self.tier),
            "replicas": self.replicas, "expected_benefit_s": self.expected_benefit_s,
            "expected_cost": self.expected_cost,
        }

    @classmethod
    def from_spec(cls, spec: dict) -> "Action":
        return cls(
            kind=ActionKind(spec["kind"]), model_id=spec["model_id"], reason=Reason(spec["reason"]),
            not_before=datetime.fromisoformat(spec["not_before"]), deadline=datetime.fromisoformat(spec["deadline"]),
            node_id=spec.get("node_id"), target=spec.get("target"),
            tier=None if spec.get("tier") is None else Tier(spec["tier"]), replicas=spec.get("replicas"),
            expected_benefit_s=float(spec.get("expected_benefit_s", 0.0)),
            expected_cost=float(spec.get("expected_cost", 0.0)),
        )


@dataclass(frozen=True)
class Plan:
    """The planner's output at ``planned_at``: actions plus a summary for the audit trail."""

    planned_at: datetime
    actions: tuple[Action, ...] = ()
    summary: dict = field(default_factory=dict)

    def with_actions(self, actions: tuple[Action, ...]) -> "Plan":
        return replace(self, actions=actions)


def classify_pull_message(detail: str, *, not_found_code: bool = False) -> tuple[FailureReason, bool]:
    """(reason, temporary) for a runtime's pull error text (CRI status details, kubelet ErrImagePull messages)."""
    text = detail.lower()
    if "no space left" in text:
        return FailureReason.NO_SPACE, False
    if any(s in text for s in ("401 unauthorized", "403 forbidden", "unauthorized", "authorization failed",
                               "authentication required", "denied")):
        return FailureReason.UNAUTHORISED, False
    if not_found_code or ": not found" in text or "manifest unknown" in text or "name unknown" in text \
            or "notfound" in text:
        return FailureReason.NOT_FOUND, False
    if any(s in text for s in ("connection refused", "i/o timeout", "connection reset", "tls handshake timeout",
                               "503 service unavailable", "502 bad gateway", "eof", "deadline exceeded")):
        return FailureReason.INTERNAL, True
    return FailureReason.INTERNAL, False
