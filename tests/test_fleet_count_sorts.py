"""The fleet ranking by cold starts and by succeeded actions against a real PostgreSQL: every page, rank and
count equals a direct count of the window's rows, the planner settings those sorts run with do not leak into
the caller's transaction, and the succeeded-action count is answered from migration 0011's index."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import text

from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.dashboard import read_fleet_page

END = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
WINDOW_MIN = 60
START = END - timedelta(minutes=WINDOW_MIN)
MODELS = [f"m{i:02d}" for i in range(23)] + ["M-upper", "m_b"]  # "C" order differs from the default collation
STATUSES = ("pending", "running", "succeeded", "failed", "dropped")


@pytest.fixture
def counted(engine):
    """Cold starts and actions of 25 models in and around the window, edges included; returns their rows.

    Times fall on whole minutes from 30 minutes before the window to 10 after (start inclusive, end exclusive
    both hit); one in five actions has no ``not_before`` (it sits at its ``updated_at``); an action of an
    unregistered model and of no model at all, which the ranking leaves out.
    """
    rng = np.random.default_rng(11)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in MODELS])
    starts, actions = [], []
    for model in MODELS[:-3]:  # the last three have nothing
        for j in range(int(rng.integers(0, 9))):
            starts.append((model, f"node-{j}", START + timedelta(minutes=int(rng.integers(-30, WINDOW_MIN + 10)))))
        for _ in range(int(rng.integers(0, 12))):
            at = START + timedelta(minutes=int(rng.integers(-30, WINDOW_MIN + 10)))
            planned = rng.random() < 0.8
            actions.append((model, at if planned else None, at if not planned else END + timedelta(days=1),
                            STATUSES[int(rng.integers(0, len(STATUSES)))]))
    starts += [(MODELS[0], "node-edge", START), (MODELS[1], "node-edge", END)]
    actions += [(MODELS[0], START, START, "succeeded"), (MODELS[1], END, END, "succeeded"),
                ("unregistered", START, START, "succeeded"), (None, START, START, "succeeded")]
    with engine.begin() as conn:
        for model, node, at in starts:
            conn.execute(text("INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, source) "
                              "VALUES (:m, :n, :t, 30, 'test')"), {"m": model, "n": node, "t": at})
        for model, not_before, updated_at, status in actions:
            conn.execute(text("INSERT INTO actions (kind, model_id, node_id, target, not_before, deadline, status, "
                              "updated_at) VALUES ('prepull', :m, 'n', 'img', :nb, :nb, :s, :u)"),
                         {"m": model, "nb": not_before, "u": updated_at, "s": status})
    return starts, actions


def direct_ranking(counted, sort: str) -> list[tuple[str, int]]:
    """(model, count) of every registered model, the window's rows counted in Python, largest first, then by id
    in code point order."""
    starts, actions = counted
    if sort == "cold_starts":
        rows = [model for model, _, at in starts if START <= at < END]
    else:
        rows = [model for model, not_before, updated_at, status in actions
                if status == "succeeded" and START <= (not_before or updated_at) < END]
    counts = {model: rows.count(model) for model in MODELS}
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0].encode()))


@pytest.mark.parametrize("sort", ["cold_starts", "actions_succeeded"])
def test_count_sorts_rank_every_page_as_the_direct_count(engine, counted, sort):
    expected = direct_ranking(counted, sort)
    assert len({n for _, n in expected}) >= 4  # the ranking has something to order
    got = []
    with engine.connect() as conn:
        for offset in range(0, len(MODELS) + 4, 4):
            page = read_fleet_page(conn, end=END, window_min=WINDOW_MIN, horizon_min=5, sort=sort, limit=4,
                                   offset=offset)
            assert page.matching == len(MODELS)
            got += [(r.model_id, r.rank, r.cold_starts if sort == "cold_starts" else r.actions_succeeded)
                    for r in page.rows]
        searched = read_fleet_page(conn, end=END, window_min=WINDOW_MIN, horizon_min=5, sort=sort,
                                   search="M1", limit=100)
    assert got == [(model, rank, n) for rank, (model, n) in enumerate(expected, 1)]
    assert [(r.model_id, r.rank) for r in searched.rows] == [
        (model, rank) for rank, (model, _) in enumerate(expected, 1) if "m1" in model.lower()]
    assert searched.matching == len(searched.rows) == sum("m1" in m.lower() for m in MODELS)


def test_count_sort_settings_are_put_back(engine, counted):
    with engine.connect() as conn:
        conn.execute(text("SET LOCAL work_mem = '5MB'"))
        before = conn.execute(text("SELECT current_setting('work_mem'), "
                                   "current_setting('max_parallel_workers_per_gather'), "
                                  "current_setting('random_page_cost')")).one()
        page = read_fleet_page(conn, end=END, window_min=WINDOW_MIN, horizon_min=5, sort="cold_starts", limit=3)
        after = conn.execute(text("SELECT current_setting('work_mem'), "
                                  "current_setting('max_parallel_workers_per_gather'), "
                                  "current_setting('random_page_cost')")).one()
    assert len(page.rows) == 3
    assert before == after and before[0] == "5MB" and before[1] != "0" and before[2] != "1.1"


def test_succeeded_actions_are_counted_from_their_partial_index(engine, counted):
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE actions"))  # index-only scans need the visibility map
        conn.execute(text("SET enable_seqscan = off"))  # 30 rows: a plain or bitmap scan would win otherwise
        conn.execute(text("SET enable_bitmapscan = off"))
        plan = "\n".join(r[0] for r in conn.execute(text(
            "EXPLAIN SELECT model_id, count(*) FROM actions WHERE status = 'succeeded' "
            "AND coalesce(not_before, updated_at) >= :s AND coalesce(not_before, updated_at) < :e GROUP BY model_id"),
            {"s": START, "e": END}))
    assert "Index Only Scan using actions_succeeded_time_model" in plan, plan
