"""Transfer observations (pre-pulls, pre-loads): validation at the ingest edge, idempotent store, routing by kind."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from forecaster.actuation.actuator import Actuator
from forecaster.actuation.backends.base import Outcome
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, Plan, Reason, Tier
from forecaster.contracts.batches import IngestError
from forecaster.ingest.service import push_transfers
from forecaster.ingest.transfers import validate_transfers
from forecaster.store.transfers import read_transfers

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
PULL = {"kind": "prepull", "model_id": "m", "node_id": "n1", "ref": "reg/img:1", "started_at": "2026-11-29T11:00:00Z",
        "seconds": 4.0, "image_pull_s": 4.0, "bytes": 800_000_000, "cache_state": "none"}
LOAD = {"kind": "preload", "model_id": "m", "node_id": "n1", "ref": "s3://w/m.bin", "tier": "host",
        "started_at": "2026-11-29T11:01:00Z", "seconds": 9.0, "weight_fetch_s": 8.0, "weight_load_s": 1.0,
        "bytes": 4_000_000_000}


@pytest.mark.parametrize(("change", "reason", "field"), [
    ({"started_at": "0001-01-01T00:00:00Z"}, "ancient_timestamp", "started_at"),
    ({"started_at": datetime(1, 1, 1, tzinfo=timezone.utc)}, "ancient_timestamp", "started_at"),
    ({"started_at": "2027-01-01T00:00:00Z"}, "future_timestamp", "started_at"),
    ({"started_at": 1764410000}, "bad_timestamp", "started_at"),
    ({"started_at": "yesterday-ish"}, "bad_timestamp", "started_at"),
    ({"seconds": float("nan")}, "nan", "seconds"),
    ({"seconds": float("inf")}, "infinite", "seconds"),
    ({"image_pull_s": -1.0}, "negative_duration", "image_pull_s"),
    ({"image_pull_s": 9.0}, "inconsistent_phases", "seconds"),
    ({"weight_fetch_s": 1.0}, "inconsistent_phases", "weight_fetch_s"),
    ({"kind": "scale"}, "bad_kind", "kind"),
    ({"tier": "disk"}, "bad_tier", "tier"),
    ({"bytes": -5}, "out_of_range", "bytes"),
    ({"bytes": 1.5}, "not_a_number", "bytes"),
    ({"ref": ""}, "missing_field", "ref"),
    ({"total_seconds": 4.0}, "unknown_field", "total_seconds"),
    ({"cache_state": "warmish"}, "bad_cache_state", "cache_state"),
])
def test_bad_transfers_are_refused_naming_row_and_field(change, reason, field):
    with pytest.raises(IngestError) as err:
        validate_transfers([LOAD, {**PULL, **change}], now=NOW)
    assert (err.value.reason, err.value.row, err.value.field) == (reason, 2, field)


def test_a_transfer_twice_in_one_batch_is_refused():
    with pytest.raises(IngestError) as err:
        validate_transfers([PULL, dict(PULL)], now=NOW)
    assert (err.value.reason, err.value.row) == ("duplicate", 2)


def test_transfers_are_stored_once_and_a_resend_updates(engine, settings):
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('m')"))
    assert push_transfers(engine, settings, [PULL, LOAD], now=NOW, register=False) == {"inserted": 2, "updated": 0}
    assert push_transfers(engine, settings, [{**PULL, "seconds": 5.0, "image_pull_s": 5.0}], now=NOW,
                          register=False) == {"inserted": 0, "updated": 1}
    stored = read_transfers(engine)
    assert stored[["kind", "tier", "bytes", "seconds"]].values.tolist() == [
        ["prepull", "image", 8e8, 5.0], ["preload", "host", 4e9, 9.0]]
    with pytest.raises(IngestError) as err:
        push_transfers(engine, settings, [{**PULL, "model_id": "unknown"}], now=NOW, register=False)
    assert err.value.reason == "unknown_model"
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM cold_starts")).scalar() == 0
    # the table itself refuses a pre-pull that claims to land in a weights tier
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(text("INSERT INTO transfers (model_id, node_id, kind, tier, ref, started_at, seconds, source) "
                          "VALUES ('m', 'n', 'prepull', 'disk', 'x', now(), 1, 't')"))


class ObservingBackend:
    """A fake cluster that reports what a real agent reports: a transfer, plus a replica cold start seen meanwhile."""

    name = "observing"

    def replica_state(self, model):
        return None

    def carry_out(self, action, *, model, replicas, deadline_s):
        cold_start = {"model_id": "m", "node_id": "n2", "started_at": "2026-11-29T11:30:00Z", "total_seconds": 40.0}
        return Outcome(status=ActionStatus.SUCCEEDED, message="pulled", observations=(PULL, cold_start))


def test_the_actuator_routes_observations_by_kind(engine, settings):
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('m')"))
    action = Action(kind=ActionKind.PRELOAD, model_id="m", reason=Reason.CACHE_WARM, not_before=NOW,
                    deadline=NOW + timedelta(minutes=5), node_id="n1", target="s3://w/m.bin", tier=Tier.DISK)
    _, reports = Actuator(engine, settings, ObservingBackend()).apply(Plan(planned_at=NOW, actions=(action,)), now=NOW)
    assert reports[0].detail["observations"] == {"inserted": 1, "already_stored": 0, "rejected": 0,
                                                 "transfers": {"inserted": 1, "updated": 0}}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT node_id, total_seconds FROM cold_starts")).all() == [("n2", 40.0)]
        assert conn.execute(text("SELECT node_id, kind, seconds FROM transfers")).all() == [("n1", "prepull", 4.0)]
