"""The simulated cluster behind the actuator: the fleet simulator as an actuator backend.

A replay's plans go through the same :class:`~forecaster.actuation.actuator.Actuator` as production's (merging
with open actions, deadlines, kill switch, actions per minute, the GPU budget, never below the reactive ask,
retries); only the last step differs: instead of Kubernetes or a node agent, :class:`SimulatedBackend` applies
the bounded action to the :class:`~forecaster.simulation.engine.FleetSimulator`.

* ``replica_state``: ``current`` is the replicas the actuator last set (the simulator's floor, as a
  Deployment's ``spec.replicas`` or an HPA's minimum); ``reactive_ask`` is what the serving layer's reactive
  path wants now (replicas the recent request rate keeps busy, at least one while requests queue).
* ``carry_out``: scale and release set the floor to the actuator's bounded target; pre-pull and pre-load start
  the simulator's transfers (an unknown model or node is ``not_found``).
"""

from __future__ import annotations

from forecaster.actuation.backends.base import ModelTarget, Outcome, ReplicaState
from forecaster.contracts.actions import Action, ActionKind, FailureReason


class SimulatedBackend:
    """Carries actions out on a running :class:`~forecaster.simulation.engine.FleetSimulator`."""

    name = "simulated"
    sequential = True  # one simulator, called in order from the actuator's thread

    def __init__(self, sim) -> None:
        self.sim = sim

    def replica_state(self, model: ModelTarget) -> ReplicaState | None:
        index = self.sim.model_index(model.model_id)
        if index is None:
            return ReplicaState(current=0, reactive_ask=0)
        return ReplicaState(current=int(self.sim.floor[index]), reactive_ask=int(self.sim.reactive_ask[index]),
                            floor_kind="min_replicas")

    def carry_out(self, action: Action, *, model: ModelTarget, replicas: int | None, deadline_s: float) -> Outcome:
        why = self.sim.apply_action(action, replicas)
        if why is not None:
            return Outcome.failed(FailureReason.NOT_FOUND, f"simulated cluster: {why} for {action.kind}")
        if action.kind in (ActionKind.SCALE, ActionKind.RELEASE):
            return Outcome.ok(f"floor set to {replicas}")
        return Outcome.ok(f"{action.kind} started on {action.node_id}")
