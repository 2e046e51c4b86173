"""Actuation: carry out the planner's plan through a backend, and record spec and status of every action.

The actuator applies, it never decides (knative's reconciler split): guardrails
here only refuse or bound what the plan asks (kill switch, actions per minute,
GPU budget, the reactive autoscaler's floor, deadlines). Backends:

* ``dry-run`` (default): records what it would do and why, changes nothing;
* ``agent``: the node agents (``prewarm agent``) pre-pull and pre-load;
* ``kubernetes``: scales Deployments (or their HPA floor) and KServe InferenceServices ahead of time, and
  pre-pulls with per-node Jobs where no agent runs;
* ``composite``: each action kind routed to one of the above (``PREWARM_ACTUATOR_ROUTES``), for whole plans.
"""

from forecaster.actuation.actuator import Actuator, build_backend
from forecaster.actuation.backends.base import Backend, ModelTarget, Outcome, ReplicaState
from forecaster.store.actions import is_paused, set_paused

__all__ = ["Actuator", "Backend", "ModelTarget", "Outcome", "ReplicaState", "build_backend", "is_paused",
           "set_paused"]
