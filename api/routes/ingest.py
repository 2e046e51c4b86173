"""Push ingest: batches of per-minute counts and of observed cold starts.

A bad row rejects the whole batch with 422 naming the row and field; a batch
sent twice is a no-op; when the database is unreachable the answer is 503 with
``Retry-After`` and nothing is lost, because nothing was accepted.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError

from api.errors import database_problem
from api.deps import ClockDep, EngineDep, IngestToken, SettingsDep
from api.schemas import ColdStartBatch, ColdStartResultPublic, IngestResultPublic, InvocationBatch, ProblemPublic
from forecaster.contracts.batches import IngestError
from forecaster.ingest.service import push_cold_starts, push_counts
from forecaster.store.db import DatabaseUnavailable

router = APIRouter(prefix="/v1", tags=["ingest"])

_PROBLEMS = {422: {"model": ProblemPublic, "description": "Rejected batch: nothing was written"},
             503: {"description": "Database unavailable: retry after the Retry-After seconds"}}


#: Longest ``value`` echoed in a 422 (characters): enough to recognise it, never the input back.
MAX_ECHO = 80


def _rejected(exc: IngestError) -> JSONResponse:
    content = {"detail": str(exc)[:1000], **{k: v for k, v in exc.as_dict().items() if k != "message"}}
    for key in ("value", "field", "detail"):
        if isinstance(content.get(key), str):
            limit = MAX_ECHO if key != "detail" else 1000
            content[key] = content[key][:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse(status_code=422, content=content)


def _push(request, push, engine, settings, items, now, source):
    """Run one push with few, quick retries: 422 for bad input, 503 when the database is away (or refuses)."""
    fast = settings.model_copy(update={"db_retry_attempts": max(2, min(settings.db_retry_attempts, 3)),
                                       "db_retry_base_delay_s": 0.2})
    try:
        return push(engine, fast, items, now=now, source=source)
    except IngestError as exc:
        return _rejected(exc)
    except (DatabaseUnavailable, DBAPIError) as exc:
        return database_problem(request, exc)


@router.post("/invocations", response_model=IngestResultPublic, responses=_PROBLEMS)
def post_invocations(request: Request, body: InvocationBatch, engine: EngineDep, settings: SettingsDep,
                     clock: ClockDep, _: IngestToken):
    """Replace the counts of the batch's models inside its windows; ``warnings`` says which stored minutes
    became zeros because the batch left them out."""
    outcome = _push(request, push_counts, engine, settings, body.rows, clock(), body.source)
    return outcome if isinstance(outcome, JSONResponse) else IngestResultPublic(**outcome.as_dict())


@router.post("/coldstarts", response_model=ColdStartResultPublic, responses=_PROBLEMS)
def post_coldstarts(request: Request, body: ColdStartBatch, engine: EngineDep, settings: SettingsDep,
                    clock: ClockDep, _: IngestToken):
    outcome = _push(request, push_cold_starts, engine, settings, body.events, clock(), body.source)
    return outcome if isinstance(outcome, JSONResponse) else ColdStartResultPublic(**outcome)
