"""Push ingest: batches of per-minute counts and of observed cold starts.

A bad row rejects the whole batch with 422 naming the row and field; a batch
sent twice is a no-op; when the database is unreachable the answer is 503 with
``Retry-After`` and nothing is lost, because nothing was accepted.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from api.deps import ClockDep, EngineDep, IngestToken, SettingsDep
from api.schemas import ColdStartBatch, ColdStartResultPublic, IngestResultPublic, InvocationBatch, ProblemPublic
from forecaster.contracts.batches import IngestError
from forecaster.ingest.service import push_cold_starts, push_counts
from forecaster.store.db import DatabaseUnavailable

router = APIRouter(prefix="/v1", tags=["ingest"])

_PROBLEMS = {422: {"model": ProblemPublic, "description": "Rejected batch: nothing was written"},
             503: {"description": "Database unavailable: retry after the Retry-After seconds"}}


def _rejected(exc: IngestError) -> JSONResponse:
    return JSONResponse(status_code=422, content={"detail": str(exc), **{k: v for k, v in exc.as_dict().items()
                                                                          if k != "message"}})


def _unavailable(settings) -> HTTPException:
    return HTTPException(503, "database unavailable; the batch was not accepted, send it again",
                         headers={"Retry-After": str(settings.ingest_retry_after_s)})


def _push(push, engine, settings, items, now, source):
    """Run one push with few, quick retries: a 422 for bad input, a 503 (raised) when the database is away."""
    fast = settings.model_copy(update={"db_retry_attempts": 2, "db_retry_base_delay_s": 0.2})
    try:
        return push(engine, fast, items, now=now, source=source)
    except IngestError as exc:
        return _rejected(exc)
    except (DatabaseUnavailable, OperationalError):
        raise _unavailable(settings) from None


@router.post("/invocations", response_model=IngestResultPublic, responses=_PROBLEMS)
def post_invocations(body: InvocationBatch, engine: EngineDep, settings: SettingsDep, clock: ClockDep,
                     _: IngestToken):
    outcome = _push(push_counts, engine, settings, body.rows, clock(), body.source)
    return outcome if isinstance(outcome, JSONResponse) else IngestResultPublic(**outcome.as_dict())


@router.post("/coldstarts", response_model=ColdStartResultPublic, responses=_PROBLEMS)
def post_coldstarts(body: ColdStartBatch, engine: EngineDep, settings: SettingsDep, clock: ClockDep,
                    _: IngestToken):
    outcome = _push(push_cold_starts, engine, settings, body.events, clock(), body.source)
    return outcome if isinstance(outcome, JSONResponse) else ColdStartResultPublic(**outcome)
