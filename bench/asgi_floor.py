"""The bare-ASGI floor of bench/api.py: one Starlette route, no auth, no work, a fixed recommendation-sized body.

Served the way ``prewarm serve`` serves the API (the same uvicorn options, event loop and HTTP parser, and with
several workers the same supervisor, each worker on its own ``SO_REUSEPORT`` socket: :mod:`api.workers`), so
the gap between the two is what prewarm's own request path costs::

    python bench/asgi_floor.py --port P --workers N
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


def make_app() -> Starlette:
    """The floor as an app factory (what :func:`api.workers.serve_workers` runs in each worker)."""
    return app


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # prewarm's api package, for its supervisor
    import uvicorn

    from api import workers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    options = {"host": args.host, "port": args.port, **workers.SERVER_OPTIONS}
    if args.workers == 1:
        uvicorn.run(app, **options)
    else:
        workers.serve_workers("asgi_floor:make_app", args.workers, options)
