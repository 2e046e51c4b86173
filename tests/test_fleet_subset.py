"""The fleet read for a few models (``fleet_from_store(model_ids=...)``, ``warmest_cached_states(conn, ids)``) against
the whole fleet's read, on a real PostgreSQL: each model asked about must come out exactly as in the whole fleet.

The per-model answers (``GET /v1/models/{id}/cold-start``, the dashboard's ``?node=`` lead, the ``/metrics``
cold-start gauges) read only the models they answer for; the planner reads the whole fleet. Images shared between
models, weights URIs shared between models, and pre-pulls and pre-loads known only from succeeded actions are the
cases where a read keyed on the wrong thing would lose a cached artefact.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

from forecaster.jobs.planning import fleet_from_store
from forecaster.planning.fleet import node_state_ranks
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.nodecache import warmest_cached_states

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
#: model -> (image, weights URI); a and b share an image, a and f share weights
MODELS = {"a": ("reg/x:1", "s3://w/a"), "b": ("reg/x:1", "s3://w/b"), "c": ("reg/c:1", "s3://w/c"),
          "d": ("reg/d:1", "s3://w/d"), "f": ("reg/f:1", "s3://w/a")}


@pytest.fixture
def stored_fleet(engine):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, image_ref=image, image_size_bytes=int(5e9), weights_uri=weights,
                                              weights_size_bytes=int(2e10), replica_rps=1.0)
                             for m, (image, weights) in MODELS.items()])
        for node in ("n1", "n2", "n3"):
            conn.execute(text("INSERT INTO nodes (id, gpus_total, gpus_free) VALUES (:n, 8, 4)"), {"n": node})
        conn.execute(text(
            "INSERT INTO node_cache (node_id, artefact_kind, ref, tier) VALUES "
            "('n1', 'image', 'reg/x:1', 'image'), ('n1', 'weights', 's3://w/a', 'disk'), "
            "('n2', 'image', 'reg/c:1', 'image'), ('n2', 'weights', 's3://w/c', 'host'), "
            "('n3', 'image', 'reg/d:1', 'image'), ('n3', 'weights', 's3://w/d', 'host'), "
            "('n3', 'image', 'reg/f:1', 'image')"))
        actions = [  # (kind, model, node, target, tier, status, hours ago, replicas)
            ("prepull", "b", "n3", "reg/x:1", None, "succeeded", 1, None),
            ("preload", "f", "n3", "s3://w/a", "host", "succeeded", 2, None),  # a's weights too
            ("prepull", "c", "n1", "reg/c:1", None, "succeeded", 30, None),  # older than a day: not held
            ("preload", "c", "n1", "s3://w/c", "disk", "failed", 1, None),
            ("scale", "a", None, None, None, "succeeded", 3, 2),
            ("scale", "d", None, None, None, "succeeded", 3, 5),
        ]
        for kind, model, node, target, tier, status, hours, replicas in actions:
            spec = {"tier": tier} if tier else ({"replicas": replicas} if replicas is not None else {})
            conn.execute(text(
                "INSERT INTO actions (kind, model_id, node_id, target, spec, status, updated_at) "
                "VALUES (:k, :m, :n, :t, CAST(:s AS jsonb), :st, :u)"),
                {"k": kind, "m": model, "n": node, "t": target, "s": json.dumps(spec),
                 "st": status, "u": NOW - timedelta(hours=hours)})
    return fleet_from_store(engine, now=NOW)


@pytest.mark.parametrize("asked", [["a", "c"], ["b"], ["f"], ["d", "a", "b", "c", "f"], ["b", "unknown"]])
def test_each_model_asked_about_is_as_in_the_whole_fleet(engine, stored_fleet, asked):
    whole = stored_fleet
    part = fleet_from_store(engine, now=NOW, model_ids=asked)
    known = [m for m in asked if m in MODELS]
    assert sorted(part.models.index) == sorted(known)
    pd.testing.assert_frame_equal(part.models.sort_index(), whole.models.loc[sorted(known)])
    pd.testing.assert_frame_equal(part.nodes, whole.nodes)
    ranks = node_state_ranks(part, pd.Index(asked))
    assert np.array_equal(ranks, node_state_ranks(whole, pd.Index(asked)))
    with engine.connect() as conn:
        everyone = warmest_cached_states(conn)
        assert warmest_cached_states(conn, asked) == {m: s for m, s in everyone.items() if m in asked}


def test_the_cases_a_read_keyed_on_the_wrong_thing_would_lose(engine, stored_fleet):
    nodes = pd.Index(["n1", "n2", "n3"])
    names = {0: "none", 1: "image", 2: "disk", 3: "host"}

    def states(model):
        part = fleet_from_store(engine, now=NOW, model_ids=[model])
        return [names[int(r)] for r in node_state_ranks(part, pd.Index([model]), nodes)[0]]

    # b shares a's image: pulled on n1 (node_cache) and on n3 (a succeeded pre-pull of b's, an hour ago)
    assert states("b") == ["image", "none", "image"]
    # a: its weights on n1's disk; on n3 f's pre-load of the same URI to host memory, beside the shared image
    assert states("a") == ["disk", "none", "host"]
    # c: the day-old pre-pull and the failed pre-load on n1 do not count
    assert states("c") == ["none", "host", "none"]
    assert fleet_from_store(engine, now=NOW, model_ids=["a"]).models.loc["a", "replicas"] == 2


def test_a_cold_cost_label_stored_as_text_is_the_models_cold_cost(engine, settings, caplog):
    """``PUT /v1/models`` stores labels as text: ``{"cold_cost": "50"}`` was read as no number, and every such
    model planned with the default cost. The catalogue now refuses a ``cold_cost`` the planner cannot use (422);
    of the rows stored before that, a label that is no number is logged and one past the planner's bound makes the
    model skipped and reported, never the whole plan fail (1e308 overflowed its arithmetic)."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from forecaster.store.tokens import create_token

    admin = create_token(engine, name="fleet-admin", scopes=["admin"])
    with TestClient(create_app(settings, engine=engine)) as client:
        for model_id, value in (("vip", "50"), ("typo", "fifty"), ("huge", "1e308"), ("plain", None)):
            labels = {} if value is None else {"cold_cost": value}
            answer = client.put(f"/v1/models/{model_id}", json={"labels": labels},
                                headers={"Authorization": f"Bearer {admin}"})
            assert answer.status_code == (422 if model_id in ("typo", "huge") else 200), answer.text
    with engine.begin() as conn:  # as stored before the check
        conn.execute(text("INSERT INTO serving_models (id, labels) VALUES ('typo', '{\"cold_cost\": \"fifty\"}'), "
                          "('huge', '{\"cold_cost\": \"1e308\"}')"))
    with caplog.at_level("WARNING", logger="forecaster.store.fleet"):
        fleet = fleet_from_store(engine, now=NOW, default_cold_cost=2.0)
    assert fleet.models.loc["vip", "cold_cost"] == 50.0
    assert fleet.models.loc["typo", "cold_cost"] == fleet.models.loc["plain", "cold_cost"] == 2.0
    assert "huge" in fleet.skipped and "cold_cost" in fleet.skipped["huge"]
    assert "not a number" in caplog.text and "'typo'" in caplog.text


def test_a_model_the_catalogue_accepts_is_not_skipped_for_its_sizes(engine):
    from forecaster.store.fields import MAX_SIZE_BYTES

    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="big", image_ref="reg/big:1", image_size_bytes=MAX_SIZE_BYTES,
                                              weights_uri="s3://w/big", weights_size_bytes=MAX_SIZE_BYTES)])
    fleet = fleet_from_store(engine, now=NOW)
    assert "big" not in fleet.skipped and "big" in fleet.models.index
