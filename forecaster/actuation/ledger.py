"""Where the actuator keeps its audit trail: the store (production) or memory (replays), one contract.

The actuator's logic (merging a plan's actions with open ones, due times, guardrails, retries, deadlines) is the
same code whichever ledger it writes to; a ledger only stores and finds records. :class:`StoreLedger` runs the
SQL of :mod:`forecaster.store.actions` in one transaction per session. :class:`MemoryLedger` keeps the same
records in memory with the same semantics, so that a replay of a day of 1,350 models passes through the real
actuator at simulator speed; ``tests/test_ledger.py`` holds both to one table of cases.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from sqlalchemy import Connection, Engine

from forecaster.actuation.backends.base import ModelTarget
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, FailureReason, Plan
from forecaster.store import actions as store_actions
from forecaster.store.actions import FINISHED

LOST_GRACE = timedelta(minutes=5)


class LedgerSession(Protocol):
    """One transaction's view of the ledger (see :mod:`forecaster.store.actions` for each call's meaning)."""

    def reap_lost(self, now: datetime) -> int: ...

    def is_paused(self) -> bool: ...

    def started_since(self, since: datetime, until: datetime) -> int: ...

    def due_actions(self, now: datetime, limit: int) -> list[dict]: ...

    def ahead_gpus_total(self, *, excluding: str | None = None) -> int: ...

    def record_plan(self, plan: Plan) -> int: ...

    def submit_action(self, plan_id: int | None, action: Action, *, backend: str, now: datetime
                      ) -> tuple[int, bool]: ...

    def mark(self, action_id: int, status: ActionStatus, *, now: datetime, reason: FailureReason | str | None = None,
             detail: dict | None = None, start: bool = False, next_attempt_at: datetime | None = None) -> None: ...


class ActionLedger(Protocol):
    def session(self) -> Iterator[LedgerSession]: ...  # a context manager: one transaction

    def model_targets(self, ids: set[str]) -> dict[str, ModelTarget]: ...

    def store_observations(self, events: list[dict], *, now: datetime, source: str) -> dict: ...


# --------------------------------------------------------------------------- the store


class _StoreSession:
    """One transaction of the store ledger. What its submits and marks change beyond the actions themselves, the
    GPUs ahead of the models they touch and the action counts, is written together when it ends (:meth:`flush`,
    called by :meth:`StoreLedger.session` before the commit; the GPUs ahead also before they are read): each row
    is locked once, in key order, so two sessions never wait on each other's rows (a session that marks, reads the
    total and marks again would lock in two passes; the actuator's do not)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._ahead_changed: set[str] = set()
        self._counts: dict[tuple[str, str], int] = {}

    def flush(self) -> None:
        self._flush_ahead()
        store_actions.count_actions(self.conn, self._counts)
        self._counts.clear()

    def _flush_ahead(self) -> None:
        if self._ahead_changed:
            store_actions.refresh_ahead(self.conn, self._ahead_changed)
            self._ahead_changed.clear()

    def _move(self, kind: str, was: str | None, now: str) -> None:
        if was is not None:
            self._counts[(kind, was)] = self._counts.get((kind, was), 0) - 1
        self._counts[(kind, now)] = self._counts.get((kind, now), 0) + 1

    def reap_lost(self, now: datetime) -> int:
        reaped = store_actions.reap_lost(self.conn, now, grace=LOST_GRACE)
        self._ahead_changed.update(store_actions.ahead_models(reaped))
        for kind, _ in reaped:
            self._move(kind, str(ActionStatus.RUNNING), str(ActionStatus.FAILED))
        return len(reaped)

    def is_paused(self) -> bool:
        return store_actions.is_paused(self.conn)

    def started_since(self, since: datetime, until: datetime) -> int:
        return store_actions.started_since(self.conn, since, until)

    def due_actions(self, now: datetime, limit: int) -> list[dict]:
        return store_actions.due_actions(self.conn, now, limit)

    def ahead_gpus_total(self, *, excluding: str | None = None) -> int:
        self._flush_ahead()
        return store_actions.ahead_gpus_total(self.conn, excluding=excluding)

    def record_plan(self, plan: Plan) -> int:
        return store_actions.record_plan(self.conn, plan)

    def submit_action(self, plan_id, action, *, backend, now):
        action_id, merged = store_actions.submit_action(self.conn, plan_id, action, backend=backend, now=now)
        if not merged:
            self._move(str(action.kind), None, str(ActionStatus.PENDING))
        return action_id, merged

    def mark(self, action_id, status, *, now, reason=None, detail=None, start=False, next_attempt_at=None):
        marked = store_actions.mark(self.conn, action_id, status, now=now, reason=reason, detail=detail,
                                    start=start, next_attempt_at=next_attempt_at)
        self._ahead_changed.update(store_actions.ahead_models(marked))
        for kind, _, was in marked:
            self._move(kind, was, str(status))


class StoreLedger:
    """The audit trail in PostgreSQL (``plans``, ``actions``, ``actuator_control``); what production uses.

    Args:
        engine: the store.
        observations: where cold-start and transfer observations a backend returns go
            (``events, now, source -> summary``); None drops them with a count.
    """

    def __init__(self, engine: Engine, observations: Callable[..., dict] | None = None) -> None:
        self.engine = engine
        self._observations = observations

    @contextmanager
    def session(self) -> Iterator[LedgerSession]:
        with self.engine.begin() as conn:
            session = _StoreSession(conn)
            yield session
            session.flush()

    def model_targets(self, ids: set[str]) -> dict[str, ModelTarget]:
        with self.engine.connect() as conn:
            rows = store_actions.catalogue_targets(conn, sorted(ids))
        return {r["id"]: ModelTarget(model_id=r["id"], gpus_per_replica=r["gpus_per_replica"],
                                     labels=r["labels"] or {}, image_ref=r["image_ref"], weights_uri=r["weights_uri"])
                for r in rows}

    def store_observations(self, events: list[dict], *, now: datetime, source: str) -> dict:
        if self._observations is None:
            return {"not_stored": len(events)}
        return self._observations(events, now=now, source=source)


# --------------------------------------------------------------------------- memory


@dataclass
class _Record:
    id: int
    plan_id: int | None
    action: Action
    key: str
    backend: str
    not_before: datetime
    deadline: datetime
    status: ActionStatus = ActionStatus.PENDING
    status_reason: str | None = None
    attempts: int = 0
    detail: dict = None  # type: ignore[assignment]
    next_attempt_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    due_version: int = 0

    def row(self) -> dict:
        spec = {**self.action.to_spec(), "not_before": self.not_before.isoformat(),
                "deadline": self.deadline.isoformat(), "key": self.key}
        return {"id": self.id, "plan_id": self.plan_id, "kind": str(self.action.kind),
                "model_id": self.action.model_id, "node_id": self.action.node_id, "target": self.action.target,
                "spec": spec, "not_before": self.not_before, "deadline": self.deadline,
                "reason": str(self.action.reason), "status": str(self.status), "status_reason": self.status_reason,
                "attempts": self.attempts, "key": self.key, "backend": self.backend, "detail": dict(self.detail),
                "next_attempt_at": self.next_attempt_at, "started_at": self.started_at,
                "finished_at": self.finished_at}


class MemoryLedger:
    """The same records and semantics as :class:`StoreLedger`, in memory (replays, tests).

    Due actions sit on a heap by due time, starts in a queue for the per-minute count, and each model's GPUs
    held above its reactive ask are kept up to date on every mark, so each call costs about what it returns.

    Args:
        targets: the catalogue as the backend sees it (model id -> :class:`ModelTarget`).
        paused: the kill switch's state (``set_paused`` changes it).
        keep_finished: keep finished records for :meth:`records` (False for long replays: only counts are kept).
    """

    def __init__(self, targets: dict[str, ModelTarget] | None = None, *, paused: bool = False,
                 keep_finished: bool = True) -> None:
        self.targets = dict(targets or {})
        self.paused = paused
        self.keep_finished = keep_finished
        self.plans: list[dict] = []
        self._records: dict[int, _Record] = {}
        self._open_by_key: dict[str, int] = {}
        self._due: list[tuple[datetime, int, int]] = []  # (due at, id, version)
        self._starts: deque[datetime] = deque()
        self._ahead: dict[str, tuple[tuple, int]] = {}  # model -> (order key, ahead GPUs) of its latest counted
        self._ahead_total = 0
        self._running: set[int] = set()
        self._scales: dict[str, set[int]] = {}  # model -> ids of its scale/release records kept
        self._ids = itertools.count(1)
        self._plan_ids = itertools.count(1)
        self.finished_counts: dict[tuple[str, str, str | None], int] = {}  # (kind, status, reason) -> n
        self.observations: list[dict] = []

    # --- the ActionLedger contract ---------------------------------------------------------------------------

    @contextmanager
    def session(self) -> Iterator["MemoryLedger"]:
        yield self

    def model_targets(self, ids: set[str]) -> dict[str, ModelTarget]:
        return {i: self.targets[i] for i in ids if i in self.targets}

    def store_observations(self, events: list[dict], *, now: datetime, source: str) -> dict:
        self.observations.extend({**e, "source": source} for e in events)
        return {"kept_in_memory": len(events)}

    # --- session calls ---------------------------------------------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        self.paused = paused

    def is_paused(self) -> bool:
        return self.paused

    def reap_lost(self, now: datetime) -> int:
        lost = [self._records[i] for i in self._running if self._records[i].deadline < now - LOST_GRACE]
        for r in lost:
            r.detail["lost"] = "still running past its deadline: the actuator stopped?"
            self._set(r, ActionStatus.FAILED, now=now, reason=FailureReason.TIMEOUT)
        return len(lost)

    def started_since(self, since: datetime, until: datetime) -> int:
        while self._starts and self._starts[0] < since:
            self._starts.popleft()
        return sum(1 for t in self._starts if t <= until)

    def due_actions(self, now: datetime, limit: int) -> list[dict]:
        found: list[_Record] = []
        while self._due and self._due[0][0] <= now:
            _, action_id, version = heapq.heappop(self._due)
            r = self._records.get(action_id)
            if r is not None and r.status is ActionStatus.PENDING and r.due_version == version:
                found.append(r)
        found.sort(key=lambda r: (r.deadline, r.id))
        for r in found:  # still pending until marked (as in the store): due again on the next call
            heapq.heappush(self._due, (self._due_at(r, now), r.id, r.due_version))
        return [r.row() for r in found[:limit]]

    def ahead_gpus_total(self, *, excluding: str | None = None) -> int:
        own = self._ahead.get(excluding, (None, 0))[1] if excluding is not None else 0
        return self._ahead_total - own

    def record_plan(self, plan: Plan) -> int:
        plan_id = next(self._plan_ids)
        if self.keep_finished:
            self.plans.append({"id": plan_id, "planned_at": plan.planned_at,
                               "summary": {**plan.summary, "actions": len(plan.actions)}})
        return plan_id

    def submit_action(self, plan_id: int | None, action: Action, *, backend: str, now: datetime
                      ) -> tuple[int, bool]:
        key = action.key
        open_id = self._open_by_key.get(key)
        if open_id is not None:
            r = self._records[open_id]
            if r.status is ActionStatus.PENDING:  # a running unit keeps its deadline (see the store's)
                r.deadline = max(r.deadline, action.deadline)
                if action.not_before < r.not_before:
                    r.not_before = action.not_before
                    self._schedule(r, now)
            r.detail.setdefault("merged_plans", []).append(plan_id)
            return r.id, True
        r = _Record(id=next(self._ids), plan_id=plan_id, action=action, key=key, backend=backend,
                    not_before=action.not_before, deadline=action.deadline, detail={})
        self._records[r.id] = r
        self._open_by_key[key] = r.id
        if action.kind in (ActionKind.SCALE, ActionKind.RELEASE):
            self._scales.setdefault(action.model_id, set()).add(r.id)
        self._schedule(r, now)
        return r.id, False

    def mark(self, action_id: int, status: ActionStatus, *, now: datetime, reason: FailureReason | str | None = None,
             detail: dict | None = None, start: bool = False, next_attempt_at: datetime | None = None) -> None:
        r = self._records[action_id]
        r.detail.update(detail or {})
        r.next_attempt_at = next_attempt_at
        if start:
            r.attempts += 1
            r.started_at = now
            self._starts.append(now)
        self._set(r, status, now=now, reason=reason)
        if status is ActionStatus.PENDING:
            self._schedule(r, now)

    # --- reading back ----------------------------------------------------------------------------------------

    def records(self) -> list[dict]:
        """Every record kept, oldest first (the same columns as ``forecaster.store.actions.list_actions``)."""
        return [r.row() for r in sorted(self._records.values(), key=lambda r: r.id)]

    def next_due_at(self) -> datetime | None:
        """The earliest time an action may be due (a lower bound: entries may be stale); None when none is."""
        return self._due[0][0] if self._due else None

    def open_count(self) -> int:
        return len(self._open_by_key)

    # --- internals -------------------------------------------------------------------------------------------

    @staticmethod
    def _due_at(r: _Record, now: datetime) -> datetime:
        return r.next_attempt_at or r.not_before or now

    def _schedule(self, r: _Record, now: datetime) -> None:
        r.due_version += 1
        heapq.heappush(self._due, (self._due_at(r, now), r.id, r.due_version))

    def _set(self, r: _Record, status: ActionStatus, *, now: datetime, reason) -> None:
        r.status = status
        r.status_reason = None if reason is None else str(reason)
        if status is ActionStatus.RUNNING:
            self._running.add(r.id)
        else:
            self._running.discard(r.id)
        if status in FINISHED:
            r.finished_at = now
            if self._open_by_key.get(r.key) == r.id:
                del self._open_by_key[r.key]
            k = (str(r.action.kind), str(status), r.status_reason)
            self.finished_counts[k] = self.finished_counts.get(k, 0) + 1
        if r.action.kind in (ActionKind.SCALE, ActionKind.RELEASE):
            self._count_ahead(r)
        if status in FINISHED and not self.keep_finished and r.action.kind not in (ActionKind.SCALE,
                                                                                   ActionKind.RELEASE):
            del self._records[r.id]

    def _count_ahead(self, r: _Record) -> None:
        """Keep the model's GPUs above its reactive ask: its latest succeeded or running scale/release counts."""
        model = r.action.model_id
        counts = r.status in (ActionStatus.SUCCEEDED, ActionStatus.RUNNING) and "ahead_gpus" in r.detail
        order = (r.finished_at or r.started_at or datetime.min.replace(tzinfo=r.deadline.tzinfo), r.id)
        held = self._ahead.get(model)
        if counts:
            if held is None or order >= held[0]:
                self._set_ahead(model, order, int(r.detail["ahead_gpus"] or 0))
        elif held is not None and held[0][1] == r.id:
            # the record that counted no longer does (it failed or was dropped): the latest other one counts
            self._set_ahead(model, None, 0)
            best = None
            for other_id in self._scales.get(model, ()):
                other = self._records[other_id]
                if other.id == r.id or "ahead_gpus" not in other.detail:
                    continue
                if other.status not in (ActionStatus.SUCCEEDED, ActionStatus.RUNNING):
                    continue
                key = (other.finished_at or other.started_at, other.id)
                if best is None or key > best[0]:
                    best = (key, int(other.detail["ahead_gpus"] or 0))
            if best is not None:
                self._set_ahead(model, *best)
        if not self.keep_finished:
            self._prune_scales(model)

    def _set_ahead(self, model: str, order, gpus: int) -> None:
        old = self._ahead.pop(model, (None, 0))[1]
        self._ahead_total += gpus - old
        if order is not None:
            self._ahead[model] = (order, gpus)

    def _prune_scales(self, model: str) -> None:
        """Drop the model's finished scale/release records that can never count again.

        The counted record, and while it is still running (it may yet fail), the latest finished one that counts:
        that one would count again, as the store's history says. A newer counted record that has finished can
        never stop counting, so everything finished before it goes.
        """
        held = self._ahead.get(model)
        if held is None:
            return
        keep = {held[0][1]}
        ids = self._scales.get(model, set())
        if self._records[held[0][1]].status not in FINISHED:
            fallback = [(r.finished_at or r.started_at, r.id) for r in (self._records[i] for i in ids)
                        if r.id != held[0][1] and r.status is ActionStatus.SUCCEEDED and "ahead_gpus" in r.detail]
            if fallback:
                keep.add(max(fallback)[1])
        stale = [i for i in ids if i not in keep and self._records[i].status in FINISHED]
        for i in stale:
            del self._records[i]
            ids.discard(i)
