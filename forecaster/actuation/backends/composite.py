"""The ``composite`` backend: one plan, each action kind carried out by the backend that can.

A real GPU fleet needs two backends at once: the Kubernetes API scales (Deployments, HPA floors, KServe
``minReplicas``) and the node agents pre-pull and pre-load (or, where no agent runs, pre-pull Jobs). The
composite routes each action kind to its backend (``PREWARM_ACTUATOR_ROUTES``, parsed and checked by
:func:`forecaster.settings.parse_actuator_routes`), so one :class:`~forecaster.actuation.actuator.Actuator`
with one ledger and the same guardrails carries out the whole plan:

* ``replica_state`` is asked of the backend that owns scale and release (one backend for both);
* ``carry_out`` hands the action to its kind's backend and adds ``carried_by`` (that backend's name) to the
  outcome's detail, so each ledger row says who carried it out;
* :meth:`carrier` tells the actuator the same name before the call: the ledger's ``backend`` column reads
  ``composite:<backend>`` and observations are stored with the source ``actuator-<backend>``, as they would be
  from that backend alone;
* cold-start observation goes to the scale backend, Job cleanup to the pre-pull backend, when they offer them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime

from forecaster.actuation.backends.base import Backend, ModelTarget, Outcome, ReplicaState
from forecaster.contracts.actions import Action, ActionKind
from forecaster.settings import Settings


class CompositeBackend:
    """Routes each action kind to one of ``backends``.

    Args:
        routes: backend name for every action kind (scale and release the same one).
        backends: the backends by name; every name in ``routes`` must be there. A backend that serves
            several kinds is one instance (one HTTP client, one API client).

    Raises:
        ValueError: a kind without a route, a route to a backend not given or that cannot carry the kind
            out, or scale and release routed apart.
    """

    name = "composite"

    def __init__(self, routes: Mapping[ActionKind | str, str], backends: Mapping[str, Backend]) -> None:
        self.routes = {ActionKind(kind): name for kind, name in routes.items()}
        missing = [str(kind) for kind in ActionKind if kind not in self.routes]
        if missing:
            raise ValueError(f"no backend routed for {', '.join(missing)}")
        for kind, name in self.routes.items():
            if name not in backends:
                raise ValueError(f"{kind} is routed to {name!r}, which is not among the backends given")
            able = getattr(backends[name], "actions", None)
            if able is not None and kind not in able:
                raise ValueError(f"the {name} backend cannot {kind}")
        if self.routes[ActionKind.SCALE] != self.routes[ActionKind.RELEASE]:
            raise ValueError("scale and release must go to the same backend")
        self.backends = {name: backends[name] for name in dict.fromkeys(self.routes.values())}
        self.actions = frozenset(ActionKind)
        # in-process members (the simulator) must see their calls in order
        self.sequential = any(getattr(b, "sequential", False) for b in self.backends.values())

    @classmethod
    def from_settings(cls, settings: Settings, build: Callable[..., Backend],
                      members: Mapping[str, Backend] | None = None) -> "CompositeBackend":
        """The composite ``settings.actuator_routes`` describes.

        Args:
            build: ``build(name, settings)`` makes a single backend (the actuator's ``build_backend`` for it).
            members: backends already made, by name (tests pass a Kubernetes backend on a fake API server);
                the others are built from ``settings``.
        """
        routes = settings.actuator_route_map
        given = dict(members or {})
        backends = {name: given[name] if name in given else build(name, settings)
                    for name in dict.fromkeys(routes.values())}
        return cls(routes, backends)

    def backend_for(self, kind: ActionKind | str) -> Backend:
        return self.backends[self.routes[ActionKind(kind)]]

    def carrier(self, kind: ActionKind | str) -> str:
        """Name of the backend that carries out actions of ``kind``."""
        return self.routes[ActionKind(kind)]

    def replica_state(self, model: ModelTarget) -> ReplicaState | None:
        return self.backend_for(ActionKind.SCALE).replica_state(model)

    def carry_out(self, action: Action, *, model: ModelTarget, replicas: int | None, deadline_s: float) -> Outcome:
        outcome = self.backend_for(action.kind).carry_out(action, model=model, replicas=replicas,
                                                          deadline_s=deadline_s)
        return Outcome(status=outcome.status, reason=outcome.reason, temporary=outcome.temporary,
                       message=outcome.message, detail={**outcome.detail, "carried_by": self.carrier(action.kind)},
                       observations=outcome.observations)

    def observe_cold_starts(self, *, since: datetime | None = None) -> list[dict] | None:
        """Replica cold starts, from the scale backend when it can see them (Kubernetes); None when it cannot (the
        collector then reports the run skipped, not an empty cluster)."""
        observe = getattr(self.backend_for(ActionKind.SCALE), "observe_cold_starts", None)
        return None if observe is None else observe(since=since)

    @property
    def coldstart_drops(self) -> dict[str, int]:
        """The scale backend's counts of pods its last :meth:`observe_cold_starts` left out (Kubernetes)."""
        return dict(getattr(self.backend_for(ActionKind.SCALE), "coldstart_drops", None) or {})

    def cleanup(self, *, now: datetime) -> list[str]:
        """The pre-pull backend's cleanup of finished or expired pre-pull Jobs (Kubernetes); else nothing."""
        cleanup = getattr(self.backend_for(ActionKind.PREPULL), "cleanup", None)
        return [] if cleanup is None else cleanup(now=now)

    def close(self) -> None:
        for backend in self.backends.values():
            close = getattr(backend, "close", None)
            if close is not None:
                close()
