"""A per-model route's tail sent with a literal slash belongs to that route for every method.

``/v1/models/{model_id}`` (the catalogue's GET and PUT) takes ids with ``/`` (``api.model_routes``), so it also
fully matches ``/v1/models/llama/forecast`` as the id ``llama/forecast``; the forecast route serves GET only and
matches a PUT partially, and a full match wins. ``PUT /v1/models/llama/forecast`` then answered 200 and
registered a phantom model ``llama/forecast`` (which ingest, forecasts and plans then took up). The bare routes
must refuse a path whose tail, as sent, is a per-model route's; the tail sent encoded (``llama%2Fforecast``) is
part of the id.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from forecaster.store.tokens import create_token
from tests.test_model_id_paths import NOW, encoded, seed

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
PREFIX = "/v1/models/{model_id}"
#: Per-model paths and their methods as the API documented them before the fix (OpenAPI must not change).
DOCUMENTED = {"/v1/models/{model_id}": {"get", "put"}, "/v1/models/{model_id}/forecast": {"get"},
              "/v1/models/{model_id}/recommendation": {"get"}, "/v1/models/{model_id}/cold-start": {"get"},
              "/v1/models/{model_id}/series": {"get"}, "/v1/models/{model_id}/coldstarts": {"get"},
              "/v1/models/{model_id}/actions": {"get"}}
IDS = ["llama", "meta-llama/Llama-3-8B"]


class EndpointSeen:
    """ASGI wrapper noting which endpoint the router picked for each request (None: no route, or the hot path)."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen: list[str | None] = []

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)
        if scope["type"] == "http":
            endpoint = scope.get("endpoint")
            self.seen.append(getattr(endpoint, "__name__", None))


@pytest.fixture
def routed(engine, settings):
    admin = create_token(engine, name="admin", scopes=["admin"])
    for model_id in IDS:
        seed(engine, settings, model_id)
    # no hot path: every request goes through the router, whose choice is what is checked
    app = create_app(settings.model_copy(update={"api_snapshot_refresh_s": 0.0}), engine, clock=lambda: NOW)
    seen = EndpointSeen(app)
    with TestClient(seen) as client:
        client.headers["Authorization"] = f"Bearer {admin}"

        def call(method: str, path: str):
            seen.seen.clear()
            response = client.request(method, path, json={"replica_rps": 1.0} if method in ("PUT", "POST", "PATCH")
                                      else None)
            return response, seen.seen[-1]  # after a redirect followed, the endpoint that answered

        yield app, client, call


def _operations(app) -> dict[str, dict[str, str]]:
    """Per-model path -> method -> operation id, from the app's OpenAPI."""
    return {path: {method: op["operationId"] for method, op in item.items()}
            for path, item in app.openapi()["paths"].items() if path.startswith(PREFIX)}


def _handler(operation_id: str, endpoint: str | None) -> bool:
    return endpoint is not None and operation_id.startswith(endpoint + "_v1_models_")


def _registered(client) -> set[str]:
    return {m["id"] for m in client.get("/v1/models", params={"limit": 1000}).json()["data"]}


def test_a_literal_tail_is_its_route_for_every_method_and_an_encoded_one_is_the_id(routed):
    app, client, call = routed
    operations = _operations(app)
    assert {path: set(ops) for path, ops in operations.items()} == DOCUMENTED  # OpenAPI as before
    tails = sorted(path[len(PREFIX):] for path in operations if path != PREFIX)
    assert len(tails) == 6
    before = _registered(client)
    for model_id in IDS:
        literal_id = "/v1/models/" + model_id  # its own '/' as it is
        for tail in tails:
            route_ops = operations[PREFIX + tail]
            for path in (literal_id + tail,  # the tail with a literal slash
                         literal_id + f"/%{ord(tail[1]):02X}" + tail[2:]):  # its first letter encoded
                for method in METHODS:
                    response, endpoint = call(method, path)
                    if method.lower() in route_ops:  # GET: the tail's route, for this model, as before
                        assert response.status_code == 200, (method, path, response.text)
                        assert _handler(route_ops[method.lower()], endpoint), (method, path, endpoint)
                        body = response.json()
                        assert model_id in (body.get("model_id"), body.get("id")) or tail == "/actions", body
                    else:  # any other method: the tail's route refuses it; the catalogue takes nothing
                        assert response.status_code == 405, (method, path, response.status_code, response.text)
    assert _registered(client) == before  # no phantom model ending in a route's tail

    # the tail's slash sent encoded: the id holds it, and the catalogue's routes answer for it
    catalogue = operations[PREFIX]
    for model_id in IDS:
        for tail in tails:
            phantom = model_id + tail
            path = "/v1/models/" + encoded(phantom)
            response, endpoint = call("GET", path)
            assert response.status_code == 404 and _handler(catalogue["get"], endpoint), (path, response.text)
            for method in sorted(METHODS, key=lambda m: m != "PUT"):  # registered first, then read
                response, endpoint = call(method, path)
                if method == "PUT":
                    assert response.status_code == 200 and response.json()["id"] == phantom, (path, response.text)
                    assert _handler(catalogue["put"], endpoint)
                elif method == "GET":
                    assert response.status_code == 200 and response.json()["id"] == phantom, (path, response.text)
                    assert _handler(catalogue["get"], endpoint)
                else:
                    assert response.status_code == 405, (method, path, response.status_code)
            # and the literal tail still reaches the shorter id's route, not the new model
            response, endpoint = call("GET", "/v1/models/" + model_id + tail)
            assert response.status_code == 200 and _handler(operations[PREFIX + tail]["get"], endpoint)
    assert _registered(client) == before | {m + t for m in IDS for t in tails}


def test_an_id_that_is_only_a_routes_name_is_still_an_id(routed):
    """The tail's slash must follow an id: ``/v1/models/forecast`` is the model ``forecast``."""
    app, client, call = routed
    catalogue = _operations(app)[PREFIX]
    for name in ("forecast", "series", "recommendation"):
        response, endpoint = call("PUT", f"/v1/models/{name}")
        assert response.status_code == 200 and response.json()["id"] == name and _handler(catalogue["put"], endpoint)
        response, endpoint = call("GET", f"/v1/models/{name}")
        assert response.status_code == 200 and response.json()["id"] == name and _handler(catalogue["get"], endpoint)
    # an empty id before a tail is no model, whatever the method
    for method in ("GET", "PUT"):
        response, _ = call(method, "/v1/models//forecast")
        assert response.status_code == 404, (method, response.text)
    assert "/forecast" not in _registered(client)


def test_an_empty_segment_sent_as_such_is_no_part_of_an_id(routed):
    """``/v1/models/llama/forecast/`` is no model ``llama/forecast/`` (nor anything else: the router's
    trailing-slash redirect keeps ``raw_path``, whose tail is then no route's); encoded it is an id."""
    app, client, call = routed
    before = _registered(client)
    response, _ = call("PUT", "/v1/models/llama/forecast/")
    assert response.status_code == 404, response.text
    response, _ = call("PUT", "/v1/models/a//b")
    assert response.status_code == 404, response.text
    assert _registered(client) == before
    response, _ = call("PUT", "/v1/models/" + encoded("a//b/"))
    assert response.status_code == 200 and response.json()["id"] == "a//b/"

