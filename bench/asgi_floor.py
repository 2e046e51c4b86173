"""The bare-ASGI floor of bench/api.py: one Starlette route, no auth, no work, a fixed recommendation-sized body.

Served by the same uvicorn (same event loop, HTTP parser and worker count) as
``prewarm serve``, so the gap between the two is what prewarm's own request
path costs::

    python -m uvicorn asgi_floor:app --app-dir bench --workers N --no-access-log
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

#: A body of the recommendation's size (about 380 bytes), so both send the same bytes per response.
BODY = (b'{"model_id":"model-000000","replicas_now":3,"replicas_at_lead_time":4,"lead_time_s":45.0,"quantile":0.9,'
        b'"demand_now_per_min":187.44834899902344,"demand_at_lead_time_per_min":201.5399932861328,'
        b'"reason":"forecast","forecast_issued_at":"2026-01-01T00:00:00Z","forecast_age_s":12.345678,'
        b'"model_version_id":null,"stale":false}')


async def recommendation(request) -> Response:
    return Response(BODY, media_type="application/json")


app = Starlette(routes=[Route("/v1/models/{model_id}/recommendation", recommendation)])
