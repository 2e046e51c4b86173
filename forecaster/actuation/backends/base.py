"""What every backend takes and returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from forecaster.contracts.actions import Action, ActionStatus, FailureReason


@dataclass(frozen=True)
class ModelTarget:
    """Where a serving model runs, from the catalogue (``serving_models``).

    ``labels`` may name the workload: ``k8s_kind`` (``Deployment`` or ``InferenceService``),
    ``k8s_name`` (default: the model id) and ``k8s_namespace`` (default: the setting).
    """

    model_id: str
    gpus_per_replica: int = 1
    labels: dict = field(default_factory=dict)
    image_ref: str | None = None
    weights_uri: str | None = None


@dataclass(frozen=True)
class ReplicaState:
    """Replicas of a model as the cluster has them now.

    Attributes:
        current: replicas asked for now (a Deployment's ``spec.replicas``, an HPA's or ISVC's floor).
        reactive_ask: what the reactive autoscaler (HPA, Knative/KPA) currently wants; never go below it.
        floor_kind: what ``current`` is: ``replicas`` (set directly) or ``min_replicas`` (an autoscaler's floor).
    """

    current: int
    reactive_ask: int
    floor_kind: str = "replicas"


@dataclass(frozen=True)
class Outcome:
    """What happened when a backend carried out (or would have carried out) one action."""

    status: ActionStatus  # SUCCEEDED or FAILED
    reason: FailureReason | None = None
    temporary: bool = False  # worth retrying later
    message: str = ""
    detail: dict = field(default_factory=dict)
    observations: tuple[dict, ...] = ()  # to store: transfers (kind prepull/preload) or cold starts (no kind)

    @classmethod
    def ok(cls, message: str, **detail) -> "Outcome":
        return cls(status=ActionStatus.SUCCEEDED, message=message, detail=detail)

    @classmethod
    def failed(cls, reason: FailureReason, message: str, *, temporary: bool = False, **detail) -> "Outcome":
        return cls(status=ActionStatus.FAILED, reason=reason, temporary=temporary, message=message, detail=detail)


class Backend(Protocol):
    """Carries out actions; never decides what to do.

    ``replica_state`` is asked before a scale or release so that the actuator's
    guardrails can bound the target; ``carry_out`` then gets the bounded target
    in ``replicas`` (absolute) for scale and release, and a deadline in seconds
    from now.
    """

    name: str

    def replica_state(self, model: ModelTarget) -> ReplicaState | None: ...

    def carry_out(self, action: Action, *, model: ModelTarget, replicas: int | None,
                  deadline_s: float) -> Outcome: ...


def unsupported(backend: str, action: Action) -> Outcome:
    return Outcome.failed(FailureReason.UNSUPPORTED, f"the {backend} backend cannot {action.kind}")
