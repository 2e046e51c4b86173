"""The actuator: record a plan's actions, then carry out those that are due, through one backend (which may be
the composite, routing each action kind to its own backend).

The records live in an :class:`~forecaster.actuation.ledger.ActionLedger`: the store in production
(:class:`~forecaster.actuation.ledger.StoreLedger`), memory in replays
(:class:`~forecaster.actuation.ledger.MemoryLedger`); the logic below is the same for both.

``submit(plan, now)`` records the plan and each action as pending (the same
work still open from an earlier plan is merged, not repeated).
``run_due(now)`` takes the pending actions whose time has come and, in one
transaction per batch, drops those that must not run (deadline passed, kill
switch, actions-per-minute limit) and marks the rest running; it then bounds
scale and release targets (reactive ask, GPU budget), calls the backend for
each (in parallel up to ``actuator_parallelism``), and records the outcome:
succeeded, failed with a reason, or pending again with a retry time for a
temporary error. Observations the backend returns go to the ledger's observation
sink: in the store, pre-pull and pre-load timings to ``transfers`` and replica
cold starts to ``cold_starts``. ``apply(plan, now)`` does both.

``now`` is passed in: tests step a clock, the scheduler passes the wall clock.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Engine

from forecaster.actuation import guardrails
from forecaster.actuation.backends.base import Backend, ModelTarget, Outcome
from forecaster.actuation.ledger import ActionLedger, StoreLedger
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, FailureReason, Plan
from forecaster.settings import Settings

log = logging.getLogger(__name__)

BATCH = 500


@dataclass(frozen=True)
class ActionReport:
    """What ``run_due`` did with one action."""

    action_id: int
    kind: str
    status: ActionStatus
    reason: FailureReason | None = None
    message: str = ""
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Submitted:
    plan_id: int
    action_ids: tuple[int, ...]
    merged: tuple[int, ...]  # ids of open actions the plan's actions were merged into


def build_backend(settings: Settings, **overrides) -> Backend:
    """The backend named by ``settings.actuator_backend``.

    For ``composite``, ``overrides`` may hold ``members``: backends already made, by name (the rest are built
    from ``settings`` as each would be alone); see :mod:`forecaster.actuation.backends.composite`.
    """
    if settings.actuator_backend == "composite":
        from forecaster.actuation.backends.composite import CompositeBackend

        return CompositeBackend.from_settings(settings, build=_single_backend, **overrides)
    return _single_backend(settings.actuator_backend, settings, **overrides)


def _single_backend(name: str, settings: Settings, **overrides) -> Backend:
    if name == "dry-run":
        from forecaster.actuation.backends.dryrun import DryRunBackend

        return DryRunBackend(**overrides)
    token = None if settings.agent_token is None else settings.agent_token.get_secret_value()
    if name == "agent":
        from forecaster.actuation.backends.agent import AgentBackend

        return AgentBackend(url_template=settings.agent_url_template, token=token,
                            connect_timeout_s=settings.agent_connect_timeout_s, **overrides)
    if name == "kubernetes":
        from forecaster.actuation.backends.kubernetes import KubernetesBackend

        return KubernetesBackend.from_settings(settings, **overrides)
    raise ValueError(f"unknown actuator backend {name!r}")


class Actuator:
    """Applies plans through ``backend`` and keeps the audit trail in a ledger.

    Args:
        ledger: where records go: an :class:`ActionLedger`, or an ``Engine`` for the store's
            (:class:`StoreLedger`, with observations pushed through the ingest path).
        settings: guardrail settings (``actuator_*``).
        backend: dry-run, agent, kubernetes, composite (each action kind routed to one of those) or simulated.
    """

    def __init__(self, ledger: ActionLedger | Engine, settings: Settings, backend: Backend) -> None:
        if isinstance(ledger, Engine):
            ledger = StoreLedger(ledger, observations=_push_observations(ledger, settings))
        self.ledger = ledger
        self.settings = settings
        self.backend = backend
        #: what the guardrails refused or bounded, by reason (kept for the replay reports)
        self.refusals: dict[str, int] = {}

    # --- recording ---------------------------------------------------------------------------------------------

    def submit(self, plan: Plan, *, now: datetime) -> Submitted:
        ids: list[int] = []
        merged: list[int] = []
        with self.ledger.session() as ledger:
            plan_id = ledger.record_plan(plan)
            for action in plan.actions:
                action_id, was_merged = ledger.submit_action(plan_id, action, backend=self._label(action.kind),
                                                             now=now)
                ids.append(action_id)
                if was_merged:
                    merged.append(action_id)
        return Submitted(plan_id=plan_id, action_ids=tuple(ids), merged=tuple(merged))

    def apply(self, plan: Plan, *, now: datetime) -> tuple[Submitted, list[ActionReport]]:
        """Record ``plan`` and carry out every action of it (and any other) that is due."""
        submitted = self.submit(plan, now=now)
        return submitted, self.run_due(now=now)

    # --- carrying out ------------------------------------------------------------------------------------------

    def run_due(self, *, now: datetime) -> list[ActionReport]:
        """Carry out the due actions (see the module docstring).

        What can fail before the backend is called (the catalogue read, the GPU budget's read, a mark) either
        happens before the batch is marked running, in its transaction, or puts the action back to pending with
        a retry time: an error there never leaves an action ``running`` with no one carrying it out (the job's
        rerun would not see it, and only the reaper, past its deadline, would). Each action reads the kill switch
        again just before its backend call, so a pause stops a batch already under way.
        """
        reports: list[ActionReport] = []
        dispatched: list[tuple[dict, Action]] = []
        with self.ledger.session() as ledger:
            lost = ledger.reap_lost(now)
            if lost:
                log.warning("%d actions were still running past their deadline; marked failed", lost)
            paused = self.settings.actuator_kill_switch or ledger.is_paused()
            started = ledger.started_since(now - timedelta(seconds=60), now)
            for row in ledger.due_actions(now, BATCH):
                action = action_from_row(row)
                dropped = guardrails.admit(action, now=now, paused=paused, started_last_minute=started,
                                           max_actions_per_minute=self.settings.actuator_max_actions_per_minute)
                if dropped is not None:
                    message = {FailureReason.DEADLINE_PASSED: f"deadline {action.deadline.isoformat()} passed",
                               FailureReason.KILL_SWITCH: "the actuator is paused (kill switch)",
                               FailureReason.RATE_LIMITED: f"{started} actions started in the last minute, limit "
                                                           f"{self.settings.actuator_max_actions_per_minute}",
                               }[dropped]
                    ledger.mark(row["id"], ActionStatus.DROPPED, now=now, reason=dropped, detail={"message": message})
                    self._refused(dropped)
                    reports.append(ActionReport(row["id"], row["kind"], ActionStatus.DROPPED, dropped, message))
                    continue
                ledger.mark(row["id"], ActionStatus.RUNNING, now=now, start=True, reason=row["status_reason"])
                started += 1
                dispatched.append((row, action))
            # read before the marks commit: failing here leaves the batch pending, as it was
            models = self.ledger.model_targets({a.model_id for _, a in dispatched}) if dispatched else {}
        if not dispatched:
            return reports
        # Scale and release are bounded one after another (they share the GPU budget); the rest run in parallel.
        ready: list[tuple[dict, Action, int | None, dict]] = []
        for row, action in dispatched:
            model = models.get(action.model_id) or ModelTarget(model_id=action.model_id)
            if action.kind in (ActionKind.SCALE, ActionKind.RELEASE):
                try:
                    bounded = self._bound(row, action, model, now)
                except Exception as exc:  # noqa: BLE001 - the store failed under the bound: try it again later
                    reports.append(self._requeue(row, now, exc))
                    continue
                if isinstance(bounded, ActionReport):
                    reports.append(bounded)
                    continue
                ready.append((row, action, *bounded))
            else:
                ready.append((row, action, None, {}))
        if getattr(self.backend, "sequential", False) or len(ready) <= 1:
            # in-process backends (the simulator) gain nothing from threads and must see calls in order
            reports.extend(self._carry_out(row, action, models, replicas, extra, now)
                           for row, action, replicas, extra in ready)
            return reports
        with ThreadPoolExecutor(max_workers=self.settings.actuator_parallelism,
                                thread_name_prefix="actuate") as pool:
            futures = [pool.submit(self._carry_out, row, action, models, replicas, extra, now)
                       for row, action, replicas, extra in ready]
            reports.extend(f.result() for f in futures)
        return reports

    def _carrier(self, kind: ActionKind | str) -> str:
        """Name of the backend that carries out ``kind``: a composite's member, else the backend itself."""
        carrier = getattr(self.backend, "carrier", None)
        return self.backend.name if carrier is None else carrier(kind)

    def _label(self, kind: ActionKind | str) -> str:
        """The ledger's ``backend`` of an action: ``composite:kubernetes`` for a routed one, else the name."""
        carrier = self._carrier(kind)
        return self.backend.name if carrier == self.backend.name else f"{self.backend.name}:{carrier}"

    def _refused(self, reason: FailureReason | str) -> None:
        self.refusals[str(reason)] = self.refusals.get(str(reason), 0) + 1

    def _bound(self, row: dict, action: Action, model: ModelTarget, now: datetime):
        try:
            state = self.backend.replica_state(model)
        except Exception as exc:  # noqa: BLE001 - the cluster could not be read: a temporary failure
            return self._finish(row, action, Outcome.failed(FailureReason.INTERNAL, f"reading replicas: {exc}",
                                                            temporary=True), now)
        if state is None:
            return None, {}
        with self.ledger.session() as ledger:
            elsewhere = ledger.ahead_gpus_total(excluding=action.model_id)
        bound = guardrails.bound_replicas(action, state, gpus_per_replica=model.gpus_per_replica,
                                          gpus_ahead_elsewhere=elsewhere, gpu_budget=self.settings.actuator_gpu_budget)
        # the level the model is left at, which the plan job's fleet read takes as its replicas
        # (:func:`forecaster.store.fleet.read_fleet_inputs`): a release's ``replicas`` are the ones it gives back
        extra = {"guardrails": bound.detail, "ahead_gpus": bound.ahead_gpus,
                 "replicas_after": state.current if bound.target is None else bound.target}
        if "clamped_by" in bound.detail:
            self._refused(f"{bound.detail['clamped_by']}_clamped")
        if bound.dropped is not None:
            self._refused(bound.dropped)
            with self.ledger.session() as ledger:
                ledger.mark(row["id"], ActionStatus.DROPPED, now=now, reason=bound.dropped, detail=extra)
            return ActionReport(row["id"], row["kind"], ActionStatus.DROPPED, bound.dropped,
                                bound.detail.get("why", ""), extra)
        if bound.noop:
            return self._finish(row, action, Outcome.ok(f"nothing to do: {bound.detail.get('why')}", noop=True,
                                                        **extra), now)
        # Recorded before the call: a concurrent scale in this batch sees this model's share of the budget.
        with self.ledger.session() as ledger:
            ledger.mark(row["id"], ActionStatus.RUNNING, now=now, reason=row["status_reason"],
                        detail={"target_replicas": bound.target, **extra})
        return bound.target, extra

    def _paused_now(self) -> bool:
        """The kill switch, read again just before a backend call (one indexed read; calls take far longer)."""
        if self.settings.actuator_kill_switch:
            return True
        with self.ledger.session() as ledger:
            return ledger.is_paused()

    def _requeue(self, row: dict, now: datetime, exc: BaseException) -> ActionReport:
        """Put an action marked running but not carried out back to pending, due again after the retry delay
        (the attempt it was marked with counts). If even that cannot be written, the reaper fails it past its
        deadline."""
        message = f"not carried out: {type(exc).__name__}: {exc}"
        log.warning("action %s %s; pending again", row["id"], message)
        next_at = now + timedelta(seconds=self.settings.actuator_retry_base_delay_s)
        try:
            with self.ledger.session() as ledger:
                ledger.mark(row["id"], ActionStatus.PENDING, now=now, reason=FailureReason.INTERNAL,
                            detail={"message": message, "temporary": True, "retry_at": next_at.isoformat()},
                            next_attempt_at=next_at)
        except Exception:  # noqa: BLE001 - logged; the row stays running until the reaper takes it
            log.exception("could not put action %s back to pending", row["id"])
        return ActionReport(row["id"], row["kind"], ActionStatus.PENDING, FailureReason.INTERNAL, message)

    def _carry_out(self, row: dict, action: Action, models: dict, replicas: int | None, extra: dict,
                   now: datetime) -> ActionReport:
        try:
            paused = self._paused_now()
        except Exception as exc:  # noqa: BLE001 - the switch could not be read: do not act blind
            return self._requeue(row, now, exc)
        if paused:
            message = "the actuator was paused (kill switch) before this action's turn"
            self._refused(FailureReason.KILL_SWITCH)
            try:
                with self.ledger.session() as ledger:
                    ledger.mark(row["id"], ActionStatus.DROPPED, now=now, reason=FailureReason.KILL_SWITCH,
                                detail={"message": message})
            except Exception as exc:  # noqa: BLE001
                return self._requeue(row, now, exc)
            return ActionReport(row["id"], row["kind"], ActionStatus.DROPPED, FailureReason.KILL_SWITCH, message)
        model = models.get(action.model_id) or ModelTarget(model_id=action.model_id)
        deadline_s = (action.deadline - now).total_seconds()
        try:
            outcome = self.backend.carry_out(action, model=model, replicas=replicas, deadline_s=deadline_s)
        except Exception as exc:  # noqa: BLE001 - a backend bug must not lose the record
            log.exception("backend %s failed on action %s", self.backend.name, row["id"])
            outcome = Outcome.failed(FailureReason.INTERNAL, f"{type(exc).__name__}: {exc}")
        if extra:
            detail = {**extra, **outcome.detail}
            if "replicas_after" in extra and isinstance(outcome.detail.get("replicas"), int):
                detail["replicas_after"] = outcome.detail["replicas"]  # what the backend set (an HPA's own floor)
            outcome = Outcome(status=outcome.status, reason=outcome.reason, temporary=outcome.temporary,
                              message=outcome.message, detail=detail, observations=outcome.observations)
        return self._finish(row, action, outcome, now)

    def _finish(self, row: dict, action: Action, outcome: Outcome, now: datetime) -> ActionReport:
        detail = {"message": outcome.message, **outcome.detail}
        if outcome.observations:
            detail["observations"] = self.ledger.store_observations(
                list(outcome.observations), now=now, source=f"actuator-{self._carrier(action.kind)}")
        attempts = (row["attempts"] or 0) + 1
        if outcome.status is ActionStatus.SUCCEEDED:
            status, reason, next_at = ActionStatus.SUCCEEDED, None, None
        else:
            next_at = guardrails.retry_at(now=now, attempts=attempts, max_attempts=self.settings.actuator_max_attempts,
                                          base_delay_s=self.settings.actuator_retry_base_delay_s,
                                          deadline=action.deadline, temporary=outcome.temporary)
            status = ActionStatus.PENDING if next_at is not None else ActionStatus.FAILED
            reason = outcome.reason or FailureReason.INTERNAL
            detail["temporary"] = outcome.temporary
            if next_at is not None:
                detail["retry_at"] = next_at.isoformat()
        with self.ledger.session() as ledger:
            ledger.mark(row["id"], status, now=now, reason=reason, detail=detail, next_attempt_at=next_at)
        return ActionReport(row["id"], row["kind"], status, reason, outcome.message, detail)

    def collect_observations(self, *, now: datetime, since: datetime | None = None) -> dict:
        """Store cold starts the backend can observe in the cluster (Kubernetes: pod status and events).

        The scheduler's ``coldstarts`` job calls it every minute (:mod:`forecaster.jobs.coldstarts`) with ``since``,
        its watermark: pods that became Ready before it are not pushed again.

        Returns:
            The sink's counts with ``observed`` (rows the backend returned) and the backend's counts of pods it
            left out (Kubernetes: ``dropped_long_start``, Ready later than ``PREWARM_KUBERNETES_COLDSTART_MAX_START_S``
            after creation: not stored, not learned); ``{"skipped": why}`` when the
            backend cannot observe cold starts (``dry-run``, ``agent``, a composite whose scale backend is one).
        """
        observe = getattr(self.backend, "observe_cold_starts", None)
        events = None if observe is None else observe(since=since)
        if events is None:
            return {"skipped": f"the {self.backend.name} backend cannot observe cold starts"}
        drops = dict(getattr(self.backend, "coldstart_drops", None) or {})
        if not events:
            return {"observed": 0, "inserted": 0, "already_stored": 0, "rejected": 0, **drops}
        stored = self.ledger.store_observations(events, now=now, source=f"actuator-{self._carrier(ActionKind.SCALE)}")
        return {"observed": len(events), **stored, **drops}


def action_from_row(row: dict) -> Action:
    """The action a ledger row holds: its spec, less the idempotency key, with the row's not-before and deadline.

    A later plan asking for the same work merges into the open row by moving those two columns, not the spec
    (:func:`forecaster.store.actions.submit_action`), so the columns are the unit's: the guardrails' deadline, the
    retry cut-off and the ``deadline_s`` the backend gets."""
    spec = {k: v for k, v in row["spec"].items() if k != "key"}
    for column in ("not_before", "deadline"):
        if row.get(column) is not None:
            spec[column] = row[column].isoformat()
    return Action.from_spec(spec)


def _push_observations(engine: Engine, settings: Settings):
    """The store's observation sink: what a backend observed, validated through the ingest path, routed by kind.

    ``prepull`` / ``preload`` events are transfers the backend carried out (``transfers`` table, never
    ``cold_starts``); events without a kind, or with kind ``cold_start``, are replica cold starts. The sink
    returns the cold-start write's counts, with the transfers' under ``"transfers"`` when there were any.

    Cold starts are stored row by row (:func:`~forecaster.ingest.service.store_observed_cold_starts`): a bad row
    is rejected and counted with its reason, never the whole batch, and the first observation of a cold start
    wins (a pod seen again, or restarted, does not rewrite it); the REST push stays all or nothing, re-sends
    updating.
    """

    def push(events: list[dict], *, now: datetime, source: str) -> dict:
        from forecaster.contracts.batches import IngestError
        from forecaster.ingest.service import push_transfers, store_observed_cold_starts

        transfers = [e for e in events if e.get("kind") in ("prepull", "preload")]
        cold_starts = [{k: v for k, v in e.items() if k != "kind"} for e in events
                       if e.get("kind") in (None, "cold_start")]
        result: dict = {"inserted": 0, "already_stored": 0, "rejected": 0}
        if len(transfers) + len(cold_starts) < len(events):
            log.warning("%d observations of an unknown kind not stored",
                        len(events) - len(transfers) - len(cold_starts))
        if cold_starts:
            result = store_observed_cold_starts(engine, settings, cold_starts, now=now, source=source)
        if transfers:
            try:
                result["transfers"] = push_transfers(engine, settings, transfers, now=now, source=source)
            except IngestError as exc:
                log.warning("transfer observations not stored: %s", exc)
                result["transfers"] = {"error": str(exc)}
        return result

    return push
