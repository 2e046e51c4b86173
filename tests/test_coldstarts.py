"""Observed cold starts: validation (reason, row, field), storage, in-place re-sends, atomicity."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from forecaster.contracts.batches import IngestError
from forecaster.contracts.phases import CACHE_STATES, PHASES
from forecaster.ingest.coldstarts import validate_cold_starts
from forecaster.ingest.service import push_cold_starts, store_observed_cold_starts
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.fields import MIN_COLD_START_S

UTC = timezone.utc
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)  # the conftest ``now``
T0 = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
_DROP = object()  # event(field=_DROP) leaves the field out
COLUMNS = ("model_id", "node_id", "started_at", "total_seconds", *PHASES, "cache_state", "source")


def event(**overrides) -> dict:
    base = {"model_id": "llama", "node_id": "gpu-node-1", "started_at": "2026-11-29T10:00:00Z", "total_seconds": 42.5}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not _DROP}


def rows(engine) -> list[dict]:
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(
            text(f"SELECT {', '.join(COLUMNS)} FROM cold_starts ORDER BY model_id, node_id, started_at"))]


def count(engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM cold_starts")).scalar())


def model_ids(engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT id FROM serving_models ORDER BY id")).scalars())


def nothing_else(engine) -> None:
    """Cold starts never touch the count tables."""
    with engine.connect() as conn:
        for table in ("invocations", "coverage", "ingest_batches"):
            assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar() == 0, table


@pytest.fixture
def registered(engine):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama"), ServingModelSpec(id="mistral")])
    return engine


# --- valid events ---------------------------------------------------------------


def test_event_without_phases(registered, settings, now):
    result = push_cold_starts(registered, settings, [event()], now=now)
    assert result == {"inserted": 1, "updated": 0}
    assert rows(registered) == [{
        "model_id": "llama", "node_id": "gpu-node-1", "started_at": T0, "total_seconds": 42.5,
        "image_pull_s": None, "weight_fetch_s": None, "weight_load_s": None, "runtime_init_s": None,
        "registration_s": None, "cache_state": None, "source": "push",
    }]
    nothing_else(registered)


def test_events_with_phases_and_cache_state(registered, settings, now):
    events = [
        event(image_pull_s=10.0, weight_fetch_s=20.0, weight_load_s=8.0, runtime_init_s=3.5, registration_s=1.0,
              cache_state="none"),
        event(model_id="mistral", node_id="gpu-node-2", started_at="2026-11-29T12:30:00+02:00",  # 10:30Z
              total_seconds="4.25", weight_load_s=3, cache_state="host"),
        # naive time is UTC; phases may overlap up to 5 % over the total
        event(node_id="gpu-node-3", started_at=datetime(2026, 11, 29, 11, 0), total_seconds=10,
              weight_fetch_s=6, weight_load_s=4.5, cache_state="gpu"),
    ]
    result = push_cold_starts(registered, settings, events, now=now, source="kubelet")
    assert result == {"inserted": 3, "updated": 0}
    stored = rows(registered)
    assert stored == [
        {"model_id": "llama", "node_id": "gpu-node-1", "started_at": T0, "total_seconds": 42.5,
         "image_pull_s": 10.0, "weight_fetch_s": 20.0, "weight_load_s": 8.0, "runtime_init_s": 3.5,
         "registration_s": 1.0, "cache_state": "none", "source": "kubelet"},
        {"model_id": "llama", "node_id": "gpu-node-3", "started_at": datetime(2026, 11, 29, 11, 0, tzinfo=UTC),
         "total_seconds": 10.0, "image_pull_s": None, "weight_fetch_s": 6.0, "weight_load_s": 4.5,
         "runtime_init_s": None, "registration_s": None, "cache_state": "gpu", "source": "kubelet"},
        {"model_id": "mistral", "node_id": "gpu-node-2", "started_at": datetime(2026, 11, 29, 10, 30, tzinfo=UTC),
         "total_seconds": 4.25, "image_pull_s": None, "weight_fetch_s": None, "weight_load_s": 3.0,
         "runtime_init_s": None, "registration_s": None, "cache_state": "host", "source": "kubelet"},
    ]


@pytest.mark.parametrize("state", CACHE_STATES)
def test_every_cache_state_is_accepted(state):
    frame = validate_cold_starts([event(cache_state=state)], now=NOW)
    assert frame["cache_state"].tolist() == [state]


def test_validated_frame_shape():
    frame = validate_cold_starts([event(model_id=" llama ", node_id=" n1 ", image_pull_s=2)], now=NOW)
    assert list(frame.columns) == ["model_id", "node_id", "started_at", "total_seconds", *PHASES, "cache_state",
                                   "event_id"]
    record = frame.iloc[0]
    assert record["event_id"] == ""  # none sent: the event is its (model, node, start)
    assert (record["model_id"], record["node_id"], record["total_seconds"], record["image_pull_s"]) == (
        "llama", "n1", 42.5, 2.0)
    assert record["started_at"] == T0


def test_resend_updates_in_place(registered, settings, now):
    assert push_cold_starts(registered, settings, [event(), event(node_id="gpu-node-2")], now=now) == {
        "inserted": 2, "updated": 0}
    with registered.connect() as conn:
        ids_before = conn.execute(text("SELECT id, node_id FROM cold_starts ORDER BY node_id")).all()

    # the same event again, the start written in another zone, with corrected figures
    again = event(started_at="2026-11-29T11:00:00+01:00", total_seconds=50.0, weight_load_s=12.0, cache_state="disk")
    assert push_cold_starts(registered, settings, [again], now=now, source="agent") == {"inserted": 0, "updated": 1}
    assert count(registered) == 2
    with registered.connect() as conn:
        assert conn.execute(text("SELECT id, node_id FROM cold_starts ORDER BY node_id")).all() == ids_before
    first = rows(registered)[0]
    assert (first["node_id"], first["total_seconds"], first["weight_load_s"], first["cache_state"], first["source"]) \
        == ("gpu-node-1", 50.0, 12.0, "disk", "agent")
    assert rows(registered)[1]["total_seconds"] == 42.5

    # an identical re-send is also an update, not a new row
    assert push_cold_starts(registered, settings, [again], now=now, source="agent") == {"inserted": 0, "updated": 1}
    assert count(registered) == 2


def test_resend_with_a_new_event_mixes_insert_and_update(registered, settings, now):
    push_cold_starts(registered, settings, [event()], now=now)
    result = push_cold_starts(registered, settings, [event(), event(started_at="2026-11-29T10:05:00Z")], now=now)
    assert result == {"inserted": 1, "updated": 1}
    assert count(registered) == 2


def test_start_just_inside_the_future_skew_is_accepted(registered, settings, now):
    edge = (now + timedelta(seconds=settings.max_future_skew_s)).isoformat()
    assert push_cold_starts(registered, settings, [event(started_at=edge)], now=now) == {"inserted": 1, "updated": 0}
    assert rows(registered)[0]["started_at"] == datetime(2026, 11, 29, 12, 5, tzinfo=UTC)


def test_unknown_model_is_registered_on_request(registered, settings, now):
    result = push_cold_starts(registered, settings, [event(model_id="ghost")], now=now, register=True)
    assert result == {"inserted": 1, "updated": 0}
    assert model_ids(registered) == ["ghost", "llama", "mistral"]
    with registered.connect() as conn:
        assert conn.execute(text("SELECT labels FROM serving_models WHERE id = 'ghost'")).scalar() == {
            "registered_by": "push"}


def test_auto_register_setting(registered, settings, now):
    auto = settings.model_copy(update={"auto_register_models": True})
    assert push_cold_starts(registered, auto, [event(model_id="ghost")], now=now) == {"inserted": 1, "updated": 0}
    assert model_ids(registered) == ["ghost", "llama", "mistral"]


# --- bad events ------------------------------------------------------------------

GOOD = [event(), event(node_id="gpu-node-2", total_seconds=30.0, cache_state="image")]
BAD_EVENTS = [
    pytest.param(event(total_seconds=_DROP), "missing_field", "total_seconds", id="missing-total"),
    pytest.param(event(total_seconds=None), "missing_field", "total_seconds", id="none-total"),
    pytest.param(event(image_pull_s=-1.5), "negative_duration", "image_pull_s", id="negative-phase"),
    pytest.param(event(total_seconds=-3), "negative_duration", "total_seconds", id="negative-total"),
    pytest.param(event(total_seconds=0), "zero_duration", "total_seconds", id="zero-total"),
    pytest.param(event(total_seconds=1e-320), "zero_duration", "total_seconds", id="denormal-total"),
    pytest.param(event(total_seconds=0.05), "zero_duration", "total_seconds", id="total-below-the-floor"),
    pytest.param(event(total_seconds=float("nan")), "nan", "total_seconds", id="nan-total"),
    pytest.param(event(total_seconds=math.inf), "infinite", "total_seconds", id="inf-total"),
    pytest.param(event(total_seconds=10**400), "duration_too_long", "total_seconds", id="int-past-any-float"),
    pytest.param(event(weight_load_s=float("inf")), "infinite", "weight_load_s", id="inf-phase"),
    pytest.param(event(total_seconds="slow"), "not_a_number", "total_seconds", id="text-total"),
    pytest.param(event(total_seconds=True), "not_a_number", "total_seconds", id="bool-total"),
    pytest.param(event(runtime_init_s=[1]), "not_a_number", "runtime_init_s", id="list-phase"),
    pytest.param(event(total_seconds=10.0, image_pull_s=6.0, weight_load_s=5.0), "inconsistent_phases",
                 "total_seconds", id="phases-over-total"),
    pytest.param(event(cache_state="warm"), "bad_cache_state", "cache_state", id="unknown-cache-state"),
    pytest.param(event(cache_state="GPU"), "bad_cache_state", "cache_state", id="cache-state-case"),
    pytest.param(event(model_id="ghost"), "unknown_model", "model_id", id="unknown-model"),
    pytest.param(event(model_id=""), "missing_field", "model_id", id="empty-model"),
    pytest.param(event(node_id=_DROP), "missing_field", "node_id", id="missing-node"),
    pytest.param(event(node_id=7), "missing_field", "node_id", id="numeric-node"),
    pytest.param(event(started_at="yesterday"), "bad_timestamp", "started_at", id="bad-start"),
    pytest.param(event(started_at=_DROP), "bad_timestamp", "started_at", id="missing-start"),
    pytest.param(event(started_at="2026-11-29T12:05:01Z"), "future_timestamp", "started_at", id="future-start"),
    pytest.param(event(started_at="2027-01-01T00:00:00Z"), "future_timestamp", "started_at", id="far-future-start"),
    # the same (model, node, start) as the first good event, written differently
    pytest.param(event(node_id=" gpu-node-1 ", started_at="2026-11-29T11:00:00+01:00", total_seconds=1),
                 "duplicate", "started_at", id="duplicate-in-batch"),
    # 100 ns later: the store keeps microseconds, so this is the first good event again
    pytest.param(event(started_at="2026-11-29T10:00:00.0000001Z", total_seconds=1), "duplicate", "started_at",
                 id="duplicate-within-a-microsecond"),
    pytest.param(["llama", "gpu-node-1", "2026-11-29T10:00:00Z", 4.0], "bad_row", None, id="non-object"),
    pytest.param(None, "bad_row", None, id="null-row"),
]


@pytest.mark.parametrize(("bad", "reason", "field"), BAD_EVENTS)
def test_validation_names_reason_row_and_field(bad, reason, field):
    with pytest.raises(IngestError) as info:
        validate_cold_starts([*GOOD, bad], now=NOW, known_models={"llama", "mistral"})
    err = info.value
    assert (err.reason, err.row, err.field) == (reason, 3, field)
    prefix = "row 3" + (f", field {field!r}" if field else "") + ": "
    assert str(err).startswith(prefix)


@pytest.mark.parametrize(("bad", "reason", "field"), BAD_EVENTS)
def test_push_of_a_bad_event_writes_nothing(registered, settings, now, bad, reason, field):
    # two good events first: the batch is all or nothing
    with pytest.raises(IngestError) as info:
        push_cold_starts(registered, settings, [*GOOD, bad], now=now)
    assert (info.value.reason, info.value.row, info.value.field) == (reason, 3, field)
    assert count(registered) == 0
    assert model_ids(registered) == ["llama", "mistral"]
    nothing_else(registered)


def test_bad_event_with_auto_register_registers_nothing(registered, settings, now):
    auto = settings.model_copy(update={"auto_register_models": True})
    batch = [event(model_id="ghost"), event(model_id="phantom", node_id="n2"), event(cache_state="lukewarm")]
    with pytest.raises(IngestError) as info:
        push_cold_starts(registered, auto, batch, now=now)
    assert (info.value.reason, info.value.row, info.value.field, info.value.value) == (
        "bad_cache_state", 3, "cache_state", "lukewarm")
    assert count(registered) == 0
    assert model_ids(registered) == ["llama", "mistral"]


def test_messages_and_values(registered, settings, now):
    with pytest.raises(IngestError) as info:
        push_cold_starts(registered, settings, [event(), event(total_seconds=1)], now=now)
    assert str(info.value) == "row 2, field 'started_at': same event as row 1"
    assert info.value.value == "2026-11-29T10:00:00+00:00"

    with pytest.raises(IngestError) as info:
        push_cold_starts(registered, settings, [event(total_seconds=10, image_pull_s=6, weight_load_s=5)], now=now)
    assert str(info.value) == "row 1, field 'total_seconds': phases add up to 11 s, more than the total 10 s"

    with pytest.raises(IngestError) as info:
        push_cold_starts(registered, settings, [event(model_id="ghost")], now=now)
    assert (info.value.reason, info.value.value) == ("unknown_model", "ghost")
    assert "'ghost' is not registered" in str(info.value)
    assert count(registered) == 0


def test_future_limit_follows_the_setting(registered, settings, now):
    strict = settings.model_copy(update={"max_future_skew_s": 0.0})
    with pytest.raises(IngestError) as info:
        push_cold_starts(registered, strict, [event(started_at=(now + timedelta(seconds=1)).isoformat())], now=now)
    assert (info.value.reason, info.value.row, info.value.field) == ("future_timestamp", 1, "started_at")
    assert push_cold_starts(registered, strict, [event(started_at=now.isoformat())], now=now) == {
        "inserted": 1, "updated": 0}


def test_empty_batch(registered, settings, now):
    with pytest.raises(IngestError) as info:
        push_cold_starts(registered, settings, [], now=now)
    assert (info.value.reason, info.value.row, info.value.field) == ("empty_batch", None, None)
    assert count(registered) == 0


def test_failure_inside_the_write_rolls_back_the_whole_batch(registered, settings, now):
    # An id too long for the column fails in the database after the good events were inserted
    # in the same transaction; none of them may remain.
    too_long = event(node_id="n" * 300, started_at="2026-11-29T10:07:00Z")
    with pytest.raises((IngestError, DBAPIError)):
        push_cold_starts(registered, settings, [*GOOD, too_long], now=now)
    assert count(registered) == 0
    assert model_ids(registered) == ["llama", "mistral"]


# --- findings (see the report) ---------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Discarding nonzero nanoseconds")
def test_numeric_start_is_rejected():
    with pytest.raises(IngestError) as info:
        validate_cold_starts([event(started_at=1_764_410_400)], now=NOW)
    assert (info.value.reason, info.value.row, info.value.field) == ("bad_timestamp", 1, "started_at")


def test_overlong_node_id_is_an_ingest_error(registered, settings, now):
    with pytest.raises(IngestError) as info:
        push_cold_starts(registered, settings, [event(node_id="n" * 300)], now=now)
    assert (info.value.row, info.value.field) == (1, "node_id")


def test_an_event_id_tells_two_starts_at_the_same_instant_apart_and_is_checked():
    same = dict(model_id="llama", node_id="n1", started_at="2026-11-29T10:00:00Z")
    frame = validate_cold_starts([event(**same, event_id="pod-a"), event(**same, event_id=" pod-b ")], now=NOW)
    assert frame["event_id"].tolist() == ["pod-a", "pod-b"]
    with pytest.raises(IngestError) as info:
        validate_cold_starts([event(**same, event_id="pod-a"), event(**same, event_id="pod-a")], now=NOW)
    assert (info.value.reason, info.value.row) == ("duplicate", 2)
    for bad, reason in ((7, "bad_event_id"), ("", "bad_event_id"), ("x" * 300, "id_too_long"), ("a\x00b", "bad_id")):
        with pytest.raises(IngestError) as info:
            validate_cold_starts([event(**same, event_id=bad)], now=NOW)
        assert (info.value.reason, info.value.field) == (reason, "event_id")


def test_a_zero_phase_is_accepted_where_a_zero_total_is_not(registered, settings, now):
    """Phases may be 0 (an image already present); the total must be a cold start (>= MIN_COLD_START_S)."""
    result = push_cold_starts(registered, settings, [event(image_pull_s=0.0, cache_state="image",
                                                           total_seconds=MIN_COLD_START_S)], now=now)
    assert result == {"inserted": 1, "updated": 0}


def test_observed_rows_are_told_apart_by_event_id_when_another_row_is_bad(registered, settings, now):
    """The per-row path of store_observed_cold_starts (taken when any row is bad) keys rows as the table does, with
    event_id: two replicas created in the same second on one node are two cold starts, as on the all-good path."""
    a = event(event_id="uid-A", total_seconds=40.0)
    b = event(event_id="uid-B", total_seconds=42.0)
    bad = event(model_id="ghost", event_id="uid-C")
    again = event(event_id="uid-A", total_seconds=41.0)
    result = store_observed_cold_starts(registered, settings, [a, b, bad, again], now=now,
                                        source="actuator-kubernetes")
    assert (result["inserted"], result["rejected"]) == (2, 2)
    assert result["rejected_reasons"] == {"unknown_model": 1, "duplicate": 1}
    duplicate = [r for r in result["rejected_rows"] if r["reason"] == "duplicate"]
    assert duplicate[0]["row"] == 4 and "event_id" in duplicate[0]["message"]
    with registered.connect() as conn:
        stored = conn.execute(text("SELECT event_id, total_seconds FROM cold_starts ORDER BY event_id")).all()
    assert [tuple(r) for r in stored] == [("uid-A", 40.0), ("uid-B", 42.0)]
