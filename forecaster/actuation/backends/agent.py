"""The ``agent`` backend: pre-pulls and pre-loads through the node agents' HTTP API.

The agent's answer carries the phase timings of the transfer it did, which
become transfer observations (``kind`` prepull | preload, bytes, seconds and
``image_pull_s``, ``weight_fetch_s``, ``weight_load_s``) stored in the
``transfers`` table, never as cold starts: no replica waited on them. The
latency model learns the pull and fetch rates from them.
"""

from __future__ import annotations

import httpx

from forecaster.actuation.backends.base import ModelTarget, Outcome, ReplicaState, unsupported
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, FailureReason

PHASES = ("image_pull_s", "weight_fetch_s", "weight_load_s")


def observation_event(observation: dict, model_id: str, tier: str | None = None) -> dict | None:
    """An agent observation as a transfer event (see :func:`forecaster.ingest.service.push_transfers`).

    Args:
        observation: the agent's ``detail.observation`` (kind, ref, node_id, started_at, size_bytes, timings).
        model_id: the action's model, when the agent did not echo one.
        tier: the action's tier (a pre-load's disk | host | gpu); a pre-pull's is ``image``.

    Returns:
        The event with ``kind`` ``prepull`` or ``preload`` (what the actuator routes on), or None when the
        agent measured no phase.
    """
    phases = {p: observation[p] for p in PHASES if observation.get(p) is not None}
    kind = observation.get("kind")
    if not phases or kind not in ("prepull", "preload"):
        return None
    tier = "image" if kind == "prepull" else (observation.get("tier") or tier or "disk")
    return {"kind": kind, "model_id": observation.get("model_id") or model_id, "node_id": observation["node_id"],
            "ref": observation.get("ref"), "tier": str(tier), "bytes": observation.get("size_bytes"),
            "started_at": observation["started_at"], "seconds": round(sum(phases.values()), 4), **phases,
            "cache_state": observation.get("cache_state")}


class AgentBackend:
    """Calls ``POST /v1/prepull`` and ``/v1/preload`` on the node's agent.

    Args:
        url_template: agent base URL with ``{node}`` for the node id.
        token: the agents' bearer token.
        connect_timeout_s: seconds to connect; the read timeout follows the action's deadline.
        transport: an ``httpx`` transport (tests may route to an in-process app).
    """

    name = "agent"
    #: the action kinds it carries out (the others come back ``unsupported``)
    actions = frozenset((ActionKind.PREPULL, ActionKind.PRELOAD))

    def __init__(self, *, url_template: str, token: str | None, connect_timeout_s: float = 5.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url_template = url_template
        self.connect_timeout_s = connect_timeout_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(headers=headers, transport=transport)

    def close(self) -> None:
        self.http.close()

    def replica_state(self, model: ModelTarget) -> ReplicaState | None:
        return None

    def carry_out(self, action: Action, *, model: ModelTarget, replicas: int | None, deadline_s: float) -> Outcome:
        if action.kind is ActionKind.PREPULL:
            path, body = "/v1/prepull", {"image": action.target}
        elif action.kind is ActionKind.PRELOAD:
            path, body = "/v1/preload", {"weights_uri": action.target, "tier": str(action.tier)}
        else:
            return unsupported(self.name, action)
        deadline_s = max(0.001, deadline_s)
        body.update(deadline_s=round(deadline_s, 3), model_id=action.model_id)
        url = self.url_template.format(node=action.node_id).rstrip("/") + path
        try:
            response = self.http.post(url, json=body, timeout=httpx.Timeout(deadline_s + 10.0,
                                                                            connect=self.connect_timeout_s))
        except httpx.TimeoutException as exc:
            return Outcome.failed(FailureReason.TIMEOUT, f"agent {url}: {exc}", temporary=True)
        except httpx.TransportError as exc:
            return Outcome.failed(FailureReason.RUNTIME_UNAVAILABLE, f"agent {url} unreachable: {exc}",
                                  temporary=True)
        if response.status_code == 401:
            return Outcome.failed(FailureReason.UNAUTHORISED, f"agent {url} refused the token")
        try:
            answer = response.json()
        except ValueError:
            return Outcome.failed(FailureReason.INTERNAL, f"agent {url}: HTTP {response.status_code} "
                                  f"{response.text[:200]}", temporary=response.status_code >= 500)
        if response.status_code == 422 or "status" not in answer:
            return Outcome.failed(FailureReason.INTERNAL, f"agent {url} rejected the request: "
                                  f"{str(answer)[:300]}")
        detail = {k: answer.get(k) for k in ("already_present", "deduplicated", "timings", "size_bytes", "node")}
        detail.update({k: v for k, v in (answer.get("detail") or {}).items() if k != "observation"})
        observations = ()
        observation = (answer.get("detail") or {}).get("observation")
        if observation:
            event = observation_event(observation, action.model_id,
                                      None if action.tier is None else str(action.tier))
            observations = (event,) if event else ()
        if answer["status"] == "succeeded":
            return Outcome(status=ActionStatus.SUCCEEDED, message=answer.get("message", ""), detail=detail,
                           observations=observations)
        try:
            reason = FailureReason(answer.get("reason") or "internal")
        except ValueError:
            reason = FailureReason.INTERNAL
        return Outcome(status=ActionStatus.FAILED, reason=reason, temporary=bool(answer.get("temporary")),
                       message=answer.get("message", ""), detail=detail)
