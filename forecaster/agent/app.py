"""The node agent's HTTP API (FastAPI), bearer-token authenticated.

The agent is its own small service on every GPU node (a DaemonSet), not a
part of the central API in ``api/``; so its routes live with it.

Routes (all under ``/v1`` need ``Authorization: Bearer <token>``):

* ``POST /v1/prepull`` ``{image, deadline_s?, model_id?}``
* ``POST /v1/preload`` ``{weights_uri, tier, deadline_s?, sha256?, model_id?}``
* ``GET /v1/state``
* ``DELETE /v1/weights?uri=...&tier=...&force=...``
* ``GET /v1/observations?since=N``
* ``GET /healthz`` (no auth)

A failed pre-pull or pre-load answers with the HTTP status below and a body
whose ``reason`` is one of the fixed set; clients should read ``reason``.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator

from forecaster.agent.service import NodeAgent, WorkResult
from forecaster.contracts.actions import FailureReason

STATUS_BY_REASON = {
    FailureReason.NOT_FOUND: 404,
    FailureReason.UNAUTHORISED: 403,  # the registry or S3 refused our credentials (401 = the agent's token)
    FailureReason.NO_SPACE: 507,
    FailureReason.TIMEOUT: 504,
    FailureReason.CHECKSUM_MISMATCH: 502,
    FailureReason.RUNTIME_UNAVAILABLE: 503,
    FailureReason.NO_GPU: 409,
}

MAX_DEADLINE_S = 86_400.0


class PrepullRequest(BaseModel):
    image: str = Field(min_length=1, max_length=512, description="Image reference, as a pod spec names it.")
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S, description="Seconds from now.")
    model_id: str | None = Field(default=None, max_length=256)

    @field_validator("image")
    @classmethod
    def _no_spaces(cls, value: str) -> str:
        if any(c.isspace() for c in value.strip()):
            raise ValueError("an image reference has no spaces")
        return value.strip()


class PreloadRequest(BaseModel):
    weights_uri: str = Field(min_length=6, max_length=2048, pattern=r"^s3://[^/]+/.+")
    tier: Literal["disk", "host", "gpu"] = "disk"
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    model_id: str | None = Field(default=None, max_length=256)


def _answer(result: WorkResult) -> JSONResponse:
    if result.status == "succeeded":
        return JSONResponse(result.as_dict(), status_code=200)
    reason = FailureReason(result.reason) if result.reason else FailureReason.INTERNAL
    return JSONResponse(result.as_dict(), status_code=STATUS_BY_REASON.get(reason, 500))


def create_app(agent: NodeAgent, *, token: str) -> FastAPI:
    """The agent's app; ``token`` is the bearer token every ``/v1`` request must carry."""
    if not token:
        raise ValueError("the node agent needs a token (PREWARM_AGENT_TOKEN)")
    expected = token.encode()

    def authorised(authorization: Annotated[str | None, Header()] = None) -> None:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    app = FastAPI(title="prewarm node agent", version="1")
    app.state.agent = agent
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorised)])

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True, "node": agent.node_name}

    @v1.post("/prepull")
    def prepull(body: PrepullRequest) -> JSONResponse:
        return _answer(agent.prepull(body.image, deadline_s=body.deadline_s, model_id=body.model_id))

    @v1.post("/preload")
    def preload(body: PreloadRequest) -> JSONResponse:
        return _answer(agent.preload(body.weights_uri, tier=body.tier, deadline_s=body.deadline_s,
                                     sha256=body.sha256, model_id=body.model_id))

    @v1.get("/state")
    def state() -> dict:
        return agent.state()

    @v1.delete("/weights")
    def evict(uri: Annotated[str, Query(min_length=6, pattern=r"^s3://[^/]+/.+")],
              tier: Annotated[Literal["disk", "host", "gpu"] | None, Query()] = None,
              force: bool = False) -> JSONResponse:
        result = agent.evict(uri, tier=tier, force=force)
        return JSONResponse(result, status_code=409 if result["kept_because_in_use"] else 200)

    @v1.get("/observations")
    def observations(since: Annotated[int, Query(ge=0)] = 0) -> dict:
        rows = agent.observations(since)
        return {"data": rows, "count": len(rows)}

    app.include_router(v1)
    return app
