"""The default backend: says what it would do and why, and changes nothing."""

from __future__ import annotations

from collections.abc import Mapping

from forecaster.actuation.backends.base import ModelTarget, Outcome, ReplicaState
from forecaster.contracts.actions import Action, ActionKind


class DryRunBackend:
    """Records intent only.

    Its paper cluster keeps what it would have set: after a scale or release
    a model's ``current`` is the level it reported, so the next release is
    bounded from there (before, every release met 0 replicas and was dropped
    as below the reactive ask, and the plan job went on reading the last
    scale's level). The paper cluster lives as long as the backend object.

    Args:
        fleet: replica states by model id, when known (for example from the
            simulator or a read-only look at the cluster); unknown models count
            as 0 replicas with a reactive ask of 0.
    """

    name = "dry-run"
    #: the action kinds it carries out: all of them, on paper
    actions = frozenset(ActionKind)

    def __init__(self, fleet: Mapping[str, ReplicaState] | None = None) -> None:
        self.fleet = dict(fleet or {})

    def replica_state(self, model: ModelTarget) -> ReplicaState | None:
        return self.fleet.get(model.model_id, ReplicaState(current=0, reactive_ask=0))

    def carry_out(self, action: Action, *, model: ModelTarget, replicas: int | None, deadline_s: float) -> Outcome:
        why = f"reason {action.reason}, expected benefit {action.expected_benefit_s:g} s"
        if action.kind is ActionKind.PREPULL:
            would = f"pre-pull {action.target} on node {action.node_id}"
        elif action.kind is ActionKind.PRELOAD:
            would = f"pre-load {action.target} into {action.tier} on node {action.node_id}"
        else:
            kind = model.labels.get("k8s_kind", "Deployment")
            name = model.labels.get("k8s_name", model.model_id)
            would = f"set {kind} {name} to {replicas} replicas ({action.kind}, planned {action.replicas})"
            if replicas is not None:
                was = self.replica_state(model)
                self.fleet[action.model_id] = ReplicaState(current=int(replicas), reactive_ask=was.reactive_ask,
                                                           floor_kind=was.floor_kind)
        return Outcome.ok(f"dry-run: would {would}; {why}", would=would, deadline_s=round(deadline_s, 3))
