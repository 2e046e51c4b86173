"""Bad input on the push path: every rejection names reason, row and field, and writes nothing.

Two layers are checked with the same table of cases:

* the pure validator :func:`build_count_batch` (internal field names ``unique_id``,
  ``ds``, ``y``), and
* :func:`push_counts` against a real PostgreSQL (push field names ``model_id``,
  ``minute``, ``count``), with auto-registration on, so that a rejected batch
  must not even register its models.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

from forecaster.contracts.batches import IngestError
from forecaster.ingest.service import push_counts
from forecaster.ingest.validate import build_count_batch
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.invocations import read_counts

UTC = timezone.utc
# The conftest ``now`` is 2026-11-29T12:00Z; the data sits two hours before it.
T0 = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
PUSH_FIELD = {"unique_id": "model_id", "ds": "minute", "y": "count"}


def at(minutes: int, seconds: int = 0) -> str:
    """ISO text of ``T0 + minutes:seconds``, as a pusher would send it."""
    return (T0 + timedelta(minutes=minutes, seconds=seconds)).isoformat()


def ts(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


def row(model_id, minute, count) -> dict:
    return {"model_id": model_id, "minute": minute, "count": count}


def raw_frame(rows: list[dict]) -> pd.DataFrame:
    """The raw frame push_counts hands to validation (counts kept as objects)."""
    return pd.DataFrame(
        {
            "unique_id": [r["model_id"] for r in rows],
            "ds": [r["minute"] for r in rows],
            "y": pd.Series([r["count"] for r in rows], dtype=object),
        }
    )


def validate(rows: list[dict], **kwargs):
    kwargs.setdefault("now", NOW)
    return build_count_batch(raw_frame(rows), source="push", step_seconds=60, **kwargs)


# --- store helpers ------------------------------------------------------------


def snapshot(engine) -> dict:
    """Everything an ingest could have written."""
    with engine.connect() as conn:
        return {
            "invocations": conn.execute(
                text("SELECT model_id, minute, count FROM invocations ORDER BY model_id, minute")).all(),
            "coverage": conn.execute(
                text("SELECT model_id, source, step_seconds, ranges::text FROM coverage ORDER BY 1, 2")).all(),
            "ingest_batches": conn.execute(text("SELECT id, content_sha256 FROM ingest_batches ORDER BY id")).all(),
            "serving_models": conn.execute(text("SELECT id, labels FROM serving_models ORDER BY id")).all(),
        }


def stored(engine) -> list[tuple[str, datetime, int]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(
            text("SELECT model_id, minute, count FROM invocations ORDER BY model_id, minute")).all()]


def coverage(engine) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(
            text("SELECT model_id, source, step_seconds, lower(ranges), upper(ranges) FROM coverage "
                 "ORDER BY model_id")).all()]


def model_ids(engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT id FROM serving_models ORDER BY id")).scalars())


def batch_count(engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM ingest_batches")).scalar())


def assert_nothing_written(engine, *, models: list[str]) -> None:
    snap = snapshot(engine)
    assert snap["invocations"] == []
    assert snap["coverage"] == []
    assert snap["ingest_batches"] == []
    assert [r[0] for r in snap["serving_models"]] == models


@pytest.fixture
def registered(engine):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama"), ServingModelSpec(id="mistral")])
    return engine


@pytest.fixture
def auto_settings(settings):
    return settings.model_copy(update={"auto_register_models": True})


# --- the table of bad batches -------------------------------------------------
#
# (rows, reason, 1-based row, internal field); the push field is PUSH_FIELD[field].

BAD_BATCHES = [
    pytest.param([row("llama", at(0), 3), row("llama", at(1), -1)], "negative_count", 2, "y", id="negative"),
    pytest.param([row("llama", at(0), 2.5)], "non_integer_count", 1, "y", id="non-integer-2.5"),
    pytest.param([row("llama", at(0), 1), row("llama", at(1), float("nan"))], "nan", 2, "y", id="nan"),
    pytest.param([row("llama", at(0), None)], "nan", 1, "y", id="none-count"),
    pytest.param([row("llama", at(0), 1), row("llama", at(1), 2), row("llama", at(2), float("inf"))],
                 "infinite", 3, "y", id="inf"),
    pytest.param([row("llama", at(0), float("-inf"))], "infinite", 1, "y", id="minus-inf"),
    pytest.param([row("llama", at(0), 1), row("llama", at(1), "lots")], "not_a_number", 2, "y",
                 id="non-numeric-string"),
    pytest.param([row("llama", at(0), 1), row("", at(1), 1)], "missing_model", 2, "unique_id", id="empty-model"),
    pytest.param([row("   ", at(0), 1)], "missing_model", 1, "unique_id", id="blank-model"),
    pytest.param([row(None, at(0), 1)], "missing_model", 1, "unique_id", id="none-model"),
    pytest.param([row("llama", at(0), 1), row("llama", "half past ten", 1)], "bad_timestamp", 2, "ds",
                 id="unparseable-timestamp"),
    pytest.param([row("llama", "", 1)], "bad_timestamp", 1, "ds", id="empty-timestamp"),
    pytest.param([row("llama", None, 1)], "bad_timestamp", 1, "ds", id="none-timestamp"),
    pytest.param([row("llama", int(T0.timestamp()), 1)], "bad_timestamp", 1, "ds", id="epoch-int"),
    pytest.param([row("llama", at(0), 1), row("llama", T0.timestamp() + 60, 1)], "bad_timestamp", 2, "ds",
                 id="epoch-float-mixed"),
    pytest.param([row("llama", at(0), 1), row("mistral", at(0), 1), row("llama", at(0), 2)], "duplicate", 3, "ds",
                 id="duplicate"),
    pytest.param([row("llama", "2026-11-29T10:00:00Z", 1), row("llama", "2026-11-29T12:00:00+02:00", 2)],
                 "duplicate", 2, "ds", id="duplicate-same-instant-other-offset"),
    pytest.param([row("llama", at(0), 1), row("llama", (NOW + timedelta(seconds=301)).isoformat(), 1)],
                 "future_timestamp", 2, "ds", id="future"),
    pytest.param([row("llama", (NOW + timedelta(days=365)).isoformat(), 1)], "future_timestamp", 1, "ds",
                 id="far-future"),
]


@pytest.mark.parametrize(("rows", "reason", "bad_row", "field"), BAD_BATCHES)
def test_build_count_batch_rejects(rows, reason, bad_row, field):
    with pytest.raises(IngestError) as info:
        validate(rows)
    err = info.value
    assert (err.reason, err.row, err.field) == (reason, bad_row, field)
    assert str(err).startswith(f"row {bad_row}, field {field!r}: ")


@pytest.mark.parametrize(("rows", "reason", "bad_row", "field"), BAD_BATCHES)
def test_push_rejects_and_writes_nothing(registered, auto_settings, rows, reason, bad_row, field):
    # A model the catalogue does not know rides along: auto-register is on, so
    # only a rejected batch keeps it out of serving_models.
    rows = [*rows, row("newcomer", at(30), 4)]
    with pytest.raises(IngestError) as info:
        push_counts(registered, auto_settings, rows, now=NOW)
    err = info.value
    push_field = PUSH_FIELD[field]
    assert (err.reason, err.row, err.field) == (reason, bad_row, push_field)
    assert str(err).startswith(f"row {bad_row}, field {push_field!r}: ")
    assert err.as_dict()["field"] == push_field
    assert_nothing_written(registered, models=["llama", "mistral"])


# --- specific rejections --------------------------------------------------------


def test_duplicate_names_both_rows(registered, settings, now):
    rows = [row("llama", at(0), 1), row("mistral", at(0), 1), row("llama", at(1), 1), row("llama", at(0), 2)]
    with pytest.raises(IngestError) as info:
        push_counts(registered, settings, rows, now=now)
    err = info.value
    assert (err.reason, err.row, err.field, err.value) == ("duplicate", 4, "minute", "2026-11-29T10:00:00+00:00")
    assert "(rows 1 and 4)" in str(err)
    assert "'llama'" in str(err)
    assert_nothing_written(registered, models=["llama", "mistral"])


def test_numeric_epoch_message(registered, settings, now):
    with pytest.raises(IngestError) as info:
        push_counts(registered, settings, [row("llama", 1764410400, 1)], now=now)
    assert info.value.reason == "bad_timestamp"
    assert info.value.value == "1764410400"
    assert "ISO 8601" in str(info.value)


def test_future_limit_follows_the_setting(registered, settings, now):
    strict = settings.model_copy(update={"max_future_skew_s": 0.0})
    with pytest.raises(IngestError) as info:
        push_counts(registered, strict, [row("llama", at(0), 1), row("llama", (now + timedelta(seconds=1)).isoformat(), 1)],
                    now=now)
    assert (info.value.reason, info.value.row, info.value.field) == ("future_timestamp", 2, "minute")
    assert info.value.value == "2026-11-29T12:00:01+00:00"
    assert_nothing_written(registered, models=["llama", "mistral"])

    # exactly ``now`` is inside a zero skew
    result = push_counts(registered, strict, [row("llama", now.isoformat(), 2)], now=now)
    assert (result.rows_written, result.invocations) == (1, 2)
    assert stored(registered) == [("llama", now, 2)]


def test_just_inside_the_future_skew_is_accepted(registered, settings, now):
    assert settings.max_future_skew_s == 300.0
    rows = [
        row("llama", (now + timedelta(seconds=299)).isoformat(), 1),  # 12:04:59 -> minute 12:04
        row("llama", (now + timedelta(seconds=300)).isoformat(), 2),  # exactly at the limit
    ]
    result = push_counts(registered, settings, rows, now=now)
    assert (result.duplicate, result.models, result.rows_written, result.invocations) == (False, 1, 2, 3)
    assert stored(registered) == [
        ("llama", datetime(2026, 11, 29, 12, 4, tzinfo=UTC), 1),
        ("llama", datetime(2026, 11, 29, 12, 5, tzinfo=UTC), 2),
    ]


def test_one_second_past_the_skew_is_rejected(registered, settings, now):
    with pytest.raises(IngestError) as info:
        push_counts(registered, settings, [row("llama", (now + timedelta(seconds=301)).isoformat(), 1)], now=now)
    assert (info.value.reason, info.value.row, info.value.field) == ("future_timestamp", 1, "minute")
    assert "300 s ahead of now (2026-11-29T12:00:00+00:00)" in str(info.value)
    assert_nothing_written(registered, models=["llama", "mistral"])


def test_empty_batch(registered, auto_settings, now):
    with pytest.raises(IngestError) as info:
        push_counts(registered, auto_settings, [], now=now)
    assert (info.value.reason, info.value.row, info.value.field) == ("empty_batch", None, None)
    assert_nothing_written(registered, models=["llama", "mistral"])


def test_build_count_batch_of_an_empty_frame_is_empty():
    batch = build_count_batch(pd.DataFrame({"unique_id": [], "ds": [], "y": []}), source="push", step_seconds=60,
                              now=NOW)
    assert (len(batch.counts), len(batch.windows), batch.model_ids, batch.total_invocations) == (0, 0, [], 0)


@pytest.mark.parametrize(
    ("rows", "reason", "bad_row", "field"),
    [
        pytest.param([row("llama", at(0), 1), {"model_id": "llama", "minute": at(1)}], "missing_field", 2, "count",
                     id="no-count"),
        pytest.param([{"minute": at(0), "count": 1}], "missing_field", 1, "model_id", id="no-model"),
        pytest.param([row("llama", at(0), 1), {"model_id": "llama", "count": 1}], "missing_field", 2, "minute",
                     id="no-minute"),
        pytest.param([row("llama", at(0), 1), ["llama", at(1), 1]], "bad_row", 2, None, id="not-an-object"),
    ],
)
def test_push_row_missing_a_field(registered, auto_settings, now, rows, reason, bad_row, field):
    rows = [*rows, row("newcomer", at(5), 1)]
    with pytest.raises(IngestError) as info:
        push_counts(registered, auto_settings, rows, now=now)
    assert (info.value.reason, info.value.row, info.value.field) == (reason, bad_row, field)
    assert_nothing_written(registered, models=["llama", "mistral"])


def test_build_count_batch_missing_column():
    with pytest.raises(IngestError) as info:
        build_count_batch(pd.DataFrame({"unique_id": ["llama"], "ds": [at(0)]}), source="push", step_seconds=60,
                          now=NOW)
    assert (info.value.reason, info.value.row, info.value.field) == ("missing_column", None, None)
    assert "['y']" in str(info.value)


# --- unknown models and auto-registration ------------------------------------------


def test_unknown_model_is_rejected_by_default(registered, settings, now):
    assert settings.auto_register_models is False
    rows = [row("llama", at(0), 1), row("ghost", at(0), 2), row("phantom", at(1), 3)]
    with pytest.raises(IngestError) as info:
        push_counts(registered, settings, rows, now=now)
    err = info.value
    assert (err.reason, err.row, err.field, err.value) == ("unknown_model", 2, "model_id", "ghost")
    assert "(and 1 more)" in str(err)
    assert "PREWARM_AUTO_REGISTER_MODELS" in str(err)
    assert_nothing_written(registered, models=["llama", "mistral"])


def test_unknown_model_in_pure_validation():
    with pytest.raises(IngestError) as info:
        validate([row("llama", at(0), 1), row("ghost", at(0), 2)], known_models={"llama"})
    assert (info.value.reason, info.value.row, info.value.field, info.value.value) == (
        "unknown_model", 2, "unique_id", "ghost")
    # known_models=None (the caller auto-registers) accepts any id
    batch = validate([row("llama", at(0), 1), row("ghost", at(0), 2)], known_models=None)
    assert batch.model_ids == ["ghost", "llama"]


def test_register_argument_registers_unknown_models(registered, settings, now):
    result = push_counts(registered, settings, [row("llama", at(0), 1), row("ghost", at(1), 2)], now=now,
                         register=True)
    assert (result.models, result.rows_written, result.invocations) == (2, 2, 3)
    snap = snapshot(registered)
    assert [tuple(r) for r in snap["serving_models"]] == [
        ("ghost", {"registered_by": "push"}), ("llama", {}), ("mistral", {})]
    assert stored(registered) == [("ghost", ts(1), 2), ("llama", ts(0), 1)]


def test_auto_register_setting_registers_unknown_models(registered, auto_settings, now):
    result = push_counts(registered, auto_settings, [row("ghost", at(0), 5)], now=now)
    assert (result.models, result.rows_written, result.invocations) == (1, 1, 5)
    assert model_ids(registered) == ["ghost", "llama", "mistral"]
    assert stored(registered) == [("ghost", ts(0), 5)]


def test_register_false_overrides_the_setting(registered, auto_settings, now):
    with pytest.raises(IngestError) as info:
        push_counts(registered, auto_settings, [row("ghost", at(0), 5)], now=now, register=False)
    assert (info.value.reason, info.value.row, info.value.field) == ("unknown_model", 1, "model_id")
    assert_nothing_written(registered, models=["llama", "mistral"])


# --- accepted oddities ------------------------------------------------------------


def test_sub_minute_timestamps_are_bucketed_and_summed(registered, settings, now):
    rows = [row("llama", at(0, 10), 2), row("llama", at(0, 50), 3), row("llama", at(1, 59), 4)]
    batch = validate(rows)
    assert batch.counts.to_dict("records") == [
        {"unique_id": "llama", "ds": pd.Timestamp(ts(0)), "y": 5},
        {"unique_id": "llama", "ds": pd.Timestamp(ts(1)), "y": 4},
    ]
    result = push_counts(registered, settings, rows, now=now)
    assert (result.rows_written, result.invocations, result.covered_steps) == (2, 9, 2)
    assert stored(registered) == [("llama", ts(0), 5), ("llama", ts(1), 4)]
    assert coverage(registered) == [("llama", "push", 60, ts(0), ts(2))]


def test_out_of_order_rows_are_stored_right(registered, settings, now):
    rows = [row("mistral", at(2), 7), row("llama", at(3), 4), row("llama", at(0), 1), row("llama", at(2), 2)]
    result = push_counts(registered, settings, rows, now=now)
    assert (result.models, result.rows_written, result.invocations, result.covered_steps) == (2, 4, 14, 5)
    assert stored(registered) == [
        ("llama", ts(0), 1), ("llama", ts(2), 2), ("llama", ts(3), 4), ("mistral", ts(2), 7)]
    assert coverage(registered) == [
        ("llama", "push", 60, ts(0), ts(4)), ("mistral", "push", 60, ts(2), ts(3))]
    frame = read_counts(registered, ["llama"], ts(-1), ts(5))
    values = frame["y"].tolist()
    assert np.isnan(values[0]) and np.isnan(values[5])
    assert values[1:5] == [1.0, 0.0, 2.0, 4.0]


def test_naive_timestamps_are_utc(registered, settings, now):
    rows = [
        row("llama", "2026-11-29T10:00:00", 1),               # naive text
        row("llama", datetime(2026, 11, 29, 10, 1), 2),        # naive datetime
        row("llama", "2026-11-29T12:02:00+02:00", 3),         # explicit offset
        row("llama", "2026-11-29 10:03:00Z", 4),
    ]
    result = push_counts(registered, settings, rows, now=now)
    assert (result.rows_written, result.invocations) == (4, 10)
    assert stored(registered) == [("llama", ts(0), 1), ("llama", ts(1), 2), ("llama", ts(2), 3), ("llama", ts(3), 4)]


def test_naive_datetime_column_is_utc():
    raw = pd.DataFrame({"unique_id": ["llama"], "ds": [pd.Timestamp("2026-11-29 10:00:30")], "y": [3]})
    batch = build_count_batch(raw, source="push", step_seconds=60, now=NOW)
    assert batch.counts.to_dict("records") == [{"unique_id": "llama", "ds": pd.Timestamp(ts(0)), "y": 3}]


def test_whole_number_forms_are_counts():
    rows = [row("llama", at(0), 3.0), row("llama", at(1), "4"), row("llama", at(2), np.int64(5)),
            row("llama", at(3), 0)]
    batch = validate(rows)
    assert batch.counts["y"].tolist() == [3, 4, 5]
    assert str(batch.counts["y"].dtype) == "int64"
    # the zero is not stored but is covered
    assert batch.covered_steps == 4


# --- idempotency --------------------------------------------------------------------


def test_same_push_twice_is_a_duplicate(registered, settings, now):
    rows = [row("llama", at(0), 3), row("llama", at(1), 4), row("mistral", at(0), 5)]
    first = push_counts(registered, settings, rows, now=now)
    second = push_counts(registered, settings, rows, now=now)
    reordered = push_counts(registered, settings, list(reversed(rows)), now=now)
    assert first.duplicate is False and first.batch_id is not None
    assert (second.duplicate, second.batch_id, second.rows_written, second.invocations) == (
        True, first.batch_id, 0, 12)
    assert (reordered.duplicate, reordered.batch_id) == (True, first.batch_id)
    assert stored(registered) == [("llama", ts(0), 3), ("llama", ts(1), 4), ("mistral", ts(0), 5)]
    assert batch_count(registered) == 1


def test_a_batch_sent_again_after_a_later_one_replaced_it_is_written_again(registered, settings, now):
    """5, then 7, then 5 again (an operator undoing a wrong push): the last batch's content was seen before, but
    the store no longer holds it, so it is written, not skipped as a duplicate (it was, and 7 stayed)."""
    five, seven = [row("llama", at(0), 5)], [row("llama", at(0), 7)]
    first = push_counts(registered, settings, five, now=now)
    assert push_counts(registered, settings, seven, now=now).duplicate is False
    again = push_counts(registered, settings, five, now=now)
    assert (again.duplicate, again.rows_written) == (False, 1)
    assert again.batch_id > first.batch_id  # a new ledger id: history caches see the change past their watermark
    assert stored(registered) == [("llama", ts(0), 5)]
    assert batch_count(registered) == 2
    assert push_counts(registered, settings, five, now=now).duplicate is True  # held as it is now: a no-op


def test_counts_of_one_step_adding_up_past_the_limit_are_refused_and_nothing_is_lost(registered, settings, now):
    """Each row is within 2^53, but 1,024 of them in one minute add up to 2^63: summed in int64 they wrapped
    negative, the minute was dropped as zero while the batch covered it, and the stored count was deleted."""
    push_counts(registered, settings, [row("llama", at(0), 9)], now=now)
    flood = [row("llama", f"2026-11-29T10:00:{i // 1000:02d}.{i % 1000:03d}Z", 2**53) for i in range(1024)]
    with pytest.raises(IngestError) as refused:
        push_counts(registered, settings, flood, now=now)
    assert refused.value.reason == "count_too_large" and "add up" in str(refused.value)
    with pytest.raises(IngestError) as two:  # two rows of one minute: 2^54, past the per-step limit
        push_counts(registered, settings, flood[:2], now=now)
    assert two.value.reason == "count_too_large"
    assert stored(registered) == [("llama", ts(0), 9)]


@pytest.mark.parametrize("count, reason", [(10**400, "count_too_large"), (-(10**400), "negative_count")],
                         ids=["huge", "huge-negative"])
def test_integers_no_float_can_hold_are_refused_not_a_crash(registered, settings, now, count, reason):
    with pytest.raises(IngestError) as refused:
        push_counts(registered, settings, [row("llama", at(0), count)], now=now)
    assert refused.value.reason == reason and refused.value.row == 1 and len(str(refused.value.value)) < 200


def test_resent_batch_with_a_corrected_minute_replaces(registered, settings, now):
    push_counts(registered, settings, [row("llama", at(0), 3), row("llama", at(1), 4), row("llama", at(2), 5)],
                now=now)
    result = push_counts(registered, settings,
                         [row("llama", at(0), 3), row("llama", at(1), 40), row("llama", at(2), 5)], now=now)
    assert (result.duplicate, result.rows_written, result.invocations) == (False, 3, 48)
    assert stored(registered) == [("llama", ts(0), 3), ("llama", ts(1), 40), ("llama", ts(2), 5)]
    assert batch_count(registered) == 2
    # a minute corrected to zero disappears but stays covered (known zero)
    push_counts(registered, settings, [row("llama", at(0), 3), row("llama", at(1), 0), row("llama", at(2), 5)],
                now=now)
    assert stored(registered) == [("llama", ts(0), 3), ("llama", ts(2), 5)]
    assert read_counts(registered, ["llama"], ts(0), ts(3))["y"].tolist() == [3.0, 0.0, 5.0]
    assert coverage(registered) == [("llama", "push", 60, ts(0), ts(3))]


# --- error messages speak the push schema ------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "push_field", "internal"),
    [
        pytest.param(row("llama", at(1), -3), "count", "y", id="count"),
        pytest.param(row("llama", "not a time", 1), "minute", "ds", id="minute"),
        pytest.param(row("", at(1), 1), "model_id", "unique_id", id="model_id"),
        pytest.param(row("llama", at(0), 1), "minute", "ds", id="duplicate"),
    ],
)
def test_push_errors_name_push_fields(registered, settings, now, bad, push_field, internal):
    with pytest.raises(IngestError) as info:
        push_counts(registered, settings, [row("llama", at(0), 1), bad], now=now)
    message = str(info.value)
    assert info.value.field == push_field
    assert info.value.row == 2
    assert f"field {push_field!r}" in message
    assert f"'{internal}'" not in message
    assert internal not in message.split(":", 1)[0]
    assert message.count("row 2") == 1  # the prefix is not doubled by the renaming


# --- findings (see the report) ---------------------------------------------------------


def test_boolean_count_is_rejected():
    with pytest.raises(IngestError) as info:
        validate([row("llama", at(0), True)])
    assert (info.value.reason, info.value.row, info.value.field) == ("not_a_number", 1, "y")


def test_first_bad_row_is_named_whatever_the_problem():
    with pytest.raises(IngestError) as info:
        validate([row("llama", at(0), -1), row("llama", at(1), "lots")])
    assert (info.value.reason, info.value.row) == ("negative_count", 1)


# --- declared windows --------------------------------------------------------------


def _window_case(start, end, uid="llama"):
    raw = pd.DataFrame({"unique_id": ["llama"], "ds": [pd.Timestamp("2026-11-29 10:00", tz="UTC")], "y": [1]})
    windows = pd.DataFrame({"unique_id": [uid], "start": [pd.Timestamp(start, tz="UTC")],
                            "end": [pd.Timestamp(end, tz="UTC")]})
    return raw, windows


@pytest.mark.parametrize(
    ("start", "end", "uid", "known", "reason", "field"),
    [
        ("2026-11-29 09:59:30", "2026-11-29 10:01", "llama", None, "bad_window", "start"),
        ("2026-11-29 10:00", "2026-11-29 10:01:30", "llama", None, "bad_window", "end"),
        ("2026-11-29 10:00", "2030-01-01 00:00", "llama", None, "future_timestamp", "end"),
        ("2026-11-29 10:01", "2026-11-29 10:00", "llama", None, "bad_window", "end"),
        ("2026-11-29 10:00", "2026-11-29 10:01", "ghost", {"llama"}, "unknown_model", "unique_id"),
    ],
)
def test_declared_windows_are_checked(start, end, uid, known, reason, field):
    raw, windows = _window_case(start, end, uid)
    with pytest.raises(IngestError) as info:
        build_count_batch(raw, source="push", step_seconds=60, now=datetime(2026, 11, 29, 12, tzinfo=timezone.utc),
                          windows=windows, known_models=known)
    assert (info.value.reason, info.value.field) == (reason, field)
