"""PostgreSQL stopped and restarted under the API: reads serve the last forecasts marked stale; ingest says 503."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pandas as pd
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.main import create_app
from forecaster.settings import Settings
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.db import make_engine, upgrade
from forecaster.store.forecasts import write_forecasts
from forecaster.store.tokens import create_token

NOW = datetime(2026, 11, 29, 12, 0, 30, tzinfo=timezone.utc)


def test_reads_stay_up_stale_and_ingest_asks_to_retry(crashable, tmp_path):
    engine = make_engine(crashable.url)
    upgrade(engine)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama", replica_rps=1.0)])
    minutes = pd.date_range(pd.Timestamp(NOW).floor("min"), periods=30, freq="min")
    write_forecasts(engine, pd.DataFrame({"unique_id": "llama", "ds": minutes, "point": 90.0, "q0.9": 120.0}),
                    issued_at=NOW - timedelta(seconds=30), model_version_id=None)
    read = {"Authorization": "Bearer " + create_token(engine, name="keda", scopes=["read"])}
    ingest = {"Authorization": "Bearer " + create_token(engine, name="pusher", scopes=["ingest"])}
    settings = Settings(database_url=crashable.url, data_dir=tmp_path, db_retry_base_delay_s=0.01,
                        api_snapshot_refresh_s=0)
    rows = {"rows": [{"model_id": "llama", "minute": "2026-11-29T11:00:00Z", "count": 5}]}

    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        fresh = client.get("/v1/models/llama/recommendation", headers=read).json()
        forecast = client.get("/v1/models/llama/forecast?horizon=5", headers=read).json()
        assert fresh["replicas_now"] == 2 and fresh["stale"] is False
        assert client.post("/v1/invocations", json=rows, headers=ingest).status_code == 200

        crashable.crash()
        stale = client.get("/v1/models/llama/recommendation", headers=read)
        assert stale.status_code == 200 and stale.json() == {**fresh, "stale": True}
        stale_forecast = client.get("/v1/models/llama/forecast?horizon=5", headers=read).json()
        assert stale_forecast == {**forecast, "stale": True}
        never_asked = client.get("/v1/models/llama/forecast?horizon=7", headers=read)
        assert never_asked.status_code == 503 and "Retry-After" in never_asked.headers
        pushed = client.post("/v1/invocations", json={"rows": [{**rows["rows"][0], "count": 6}]}, headers=ingest)
        assert pushed.status_code == 503 and pushed.headers["Retry-After"] == str(settings.ingest_retry_after_s)
        assert client.get("/readyz").status_code == 503

        crashable.start()
        back = client.get("/v1/models/llama/recommendation", headers=read)
        assert back.status_code == 200 and back.json()["stale"] is False
        retried = client.post("/v1/invocations", json={"rows": [{**rows["rows"][0], "count": 6}]}, headers=ingest)
        assert retried.status_code == 200
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count FROM invocations")).scalar() == 6  # the retried batch, once
    engine.dispose()
