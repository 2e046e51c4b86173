"""The newest replay on a simulated cluster: prewarm against a reactive autoscaler on the same requests.

``prewarm demo`` stores, per model, what both simulators measured (:mod:`forecaster.store.replays`); the
dashboard shows it beside the fleet table and on each model's page. "No replay stored" is a normal answer:
``replay`` is null and ``data`` empty.

``data`` is one page of models, ordered by id (``limit``, default :data:`DEFAULT_LIMIT`, and ``offset``);
``count`` counts them all (1 or 0 with ``model_id``). Until paging came, ``data`` held every model unless
``limit`` said otherwise; the response's keys are unchanged.
"""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, Field
from sqlalchemy.exc import OperationalError

from api.deps import EngineDep, ReadToken, SettingsDep
from forecaster.store.replays import ModelComparison, read_latest_replay

router = APIRouter(prefix="/v1", tags=["dashboard"])

#: Model rows per page by default: before paging every model came back (2.75 MB at 10,000 models).
DEFAULT_LIMIT = 100


class OutcomePublic(BaseModel):
    """What one simulator measured for one model (or the whole fleet) over the scored minutes."""

    requests: int = Field(description="Requests that arrived.")
    cold_requests: int = Field(description="Requests that arrived while the model had no ready replica.")
    replica_starts: int = Field(description="Replicas that started and became ready (cold starts).")
    wait_total_s: float = Field(description="Seconds requests waited before service, summed.")
    wait_max_s: float = Field(description="Longest wait of one request, seconds.")


class ReplayModelPublic(BaseModel):
    model_id: str
    prewarm: OutcomePublic
    reactive: OutcomePublic
    cold_requests_avoided: int = Field(description="Reactive cold requests minus prewarm's (negative: more).")
    wait_saved_s: float = Field(description="Reactive total wait minus prewarm's, seconds.")

    @classmethod
    def of(cls, row: ModelComparison) -> "ReplayModelPublic":
        return cls(model_id=row.model_id, prewarm=OutcomePublic(**row.subject),
                   reactive=OutcomePublic(**row.baseline), cold_requests_avoided=row.cold_requests_avoided,
                   wait_saved_s=row.wait_saved_s)


class ReplayInfoPublic(BaseModel):
    id: int
    source: str
    window_start: datetime = Field(description="First replayed minute (UTC).")
    window_end: datetime = Field(description="End of the replayed minutes, exclusive (UTC).")
    scored_until: datetime = Field(description="Both simulators have measured the minutes before this.")
    subject: str = Field(description="The policy compared (prewarm).")
    baseline: str = Field(description="The policy it is compared with (reactive: Knative's autoscaler).")
    totals: dict[str, OutcomePublic] = Field(description="Per policy, the whole fleet.")
    summary: dict = Field(description="Cluster size, fleet totals (wait p99, GPU-seconds) and guardrail refusals.")


class ReplayPublic(BaseModel):
    replay: ReplayInfoPublic | None = Field(description="Null when no replay is stored.")
    count: int = Field(description="Models with a row in the replay (only model_id's when given), every page.")
    data: list[ReplayModelPublic] = Field(description="This page's models, ordered by id.")


@router.get("/replays/latest", response_model=ReplayPublic,
            responses={503: {"description": "Database unavailable: retry after the Retry-After seconds"}})
def get_latest_replay(engine: EngineDep, settings: SettingsDep, _: ReadToken,
                      model_id: str | None = Query(None, max_length=256, description="Only this model's row."),
                      limit: int = Query(DEFAULT_LIMIT, ge=0, le=1_000_000,
                                         description="Model rows per page, ordered by model id (0: totals only; "
                                                     "the fleet table carries its page's rows)."),
                      offset: int = Query(0, ge=0, le=10_000_000, description="Model rows to skip."),
                      ) -> ReplayPublic:
    """The newest replay's comparison per model (one page of models; ``count`` is all of them): cold-start
    requests and wait, prewarm vs reactive. ``replay.totals`` cover every model whatever the page."""
    try:
        with engine.connect() as conn:
            view = read_latest_replay(conn, model_id=model_id, limit=limit, offset=offset)
    except OperationalError:
        raise HTTPException(503, "database unavailable",
                            headers={"Retry-After": str(settings.ingest_retry_after_s)}) from None
    if view is None:
        return ReplayPublic(replay=None, count=0, data=[])
    info = ReplayInfoPublic(id=view.id, source=view.source, window_start=view.window_start,
                            window_end=view.window_end, scored_until=view.scored_until, subject=view.subject,
                            baseline=view.baseline,
                            totals={name: OutcomePublic(**figures) for name, figures in view.totals.items()},
                            summary=view.summary)
    return ReplayPublic(replay=info, count=view.model_count, data=[ReplayModelPublic.of(row) for row in view.models])
