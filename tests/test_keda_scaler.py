"""KEDA's external scaler over gRPC: a real server on loopback, a client generated from our externalscaler.proto,
forecasts stored in a real PostgreSQL and read through the API's forecast snapshot."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone

import grpc
import pandas as pd
import pytest
from fastapi.testclient import TestClient

from api.keda_scaler import METRIC_NAME, KedaScalerServer
from api.main import create_app
from api.proto import externalscaler_pb2 as pb
from api.proto import externalscaler_rpc
from api.snapshot import ForecastSnapshot
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.db import make_engine
from forecaster.store.forecasts import write_forecasts
from forecaster.store.tokens import create_token
from tests.runtime_fixtures import free_port, start, stop_process, wait_until
from tests.test_api_prepared import REPO, _listening_sockets

START = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
#: No latency model, no sizes, no cold start of its own: PREWARM_DEFAULT_COLD_START_S (45 s) with the planner's
#: margins (a 0-byte physics prior of 12.3 s before 62da60b)
DEFAULT_LEAD_S = 45.0 * 1.2 + 5.0


class SteppedClock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock():
    return SteppedClock(START + timedelta(seconds=30))


@pytest.fixture
def scaler_settings(settings):
    """Fast stream checks, and a freshness limit past one run's hour: these tests move the clock along a run to
    follow its floor (the default limit has tests of its own, test_a_stale_forecast_*)."""
    return settings.model_copy(update={"keda_stream_check_s": 0.05, "forecast_fresh_s": 7200.0})


def _served_stub(engine, settings, clock):
    """A scaler on a free loopback port over a fresh snapshot of the store; its stub while the caller holds it."""
    snapshot = ForecastSnapshot(engine, refresh_s=0, settings=settings, clock=clock)
    server = KedaScalerServer(snapshot, settings, clock, host="127.0.0.1", port=0)
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield externalscaler_rpc.Stub(channel)
    finally:
        channel.close()
        server.stop()


@pytest.fixture
def stub(engine, scaler_settings, clock):
    with engine.begin() as conn:  # 2 requests per second per replica = 120 per minute
        upsert_models(conn, [ServingModelSpec(id="llama", image_ref="vllm/vllm-openai:v0.6", replica_rps=2.0),
                             ServingModelSpec(id="unforecast", replica_rps=2.0)])
    yield from _served_stub(engine, scaler_settings, clock)


def store_run(engine, *, issued_at: datetime, q90: list[float], model_id: str = "llama") -> None:
    minutes = pd.date_range(pd.Timestamp(issued_at).floor("min"), periods=len(q90), freq="min")
    frame = pd.DataFrame({"unique_id": model_id, "ds": minutes, "point": [v * 0.7 for v in q90], "p_any": 1.0,
                          "q0.5": [v * 0.6 for v in q90], "q0.9": q90})
    write_forecasts(engine, frame, issued_at=issued_at, model_version_id=None)


def ref(**metadata) -> pb.ScaledObjectRef:
    return pb.ScaledObjectRef(name="vllm-llama", namespace="serving",
                              scalerMetadata={"scalerAddress": "prewarm.prewarm.svc:9090", **metadata})


def floor_value(stub, **metadata) -> float:
    reply = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(**metadata), metricName=METRIC_NAME), timeout=10)
    (value,) = reply.metricValues
    assert value.metricName == METRIC_NAME and value.metricValue == int(value.metricValueFloat)
    return value.metricValueFloat


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def test_metric_spec_asks_for_one_replica_per_unit(stub):
    spec = stub.GetMetricSpec(ref(model="llama"), timeout=10)
    assert [(s.metricName, s.targetSize, s.targetSizeFloat) for s in spec.metricSpecs] == [(METRIC_NAME, 1, 1.0)]


def test_floor_is_the_rest_recommendation_at_the_lead_time(stub, engine, scaler_settings, clock):
    q90 = [150.0] * 5 + [450.0] * 55  # 150/min -> 2 replicas, a spike to 450/min (4 replicas) from 12:05
    store_run(engine, issued_at=START, q90=q90)
    token = create_token(engine, name="read", scopes=["read"])
    with TestClient(create_app(scaler_settings, engine, clock=clock)) as rest:
        for now, expected in ((START + timedelta(seconds=30), 2), (START + timedelta(minutes=4, seconds=45), 4)):
            clock.now = now
            body = rest.get("/v1/models/llama/recommendation", headers={"Authorization": f"Bearer {token}"}).json()
            assert body["lead_time_s"] == pytest.approx(DEFAULT_LEAD_S)
            assert body["replicas_at_lead_time"] == expected
            assert floor_value(stub, model="llama") == expected
    # another quantile: q0.5 is 0.6 x q0.9 = 270/min at the spike -> 3 replicas; 0.55 picks the nearest, 0.5
    assert floor_value(stub, model="llama", quantile="0.5") == 3
    assert floor_value(stub, model="llama", quantile="0.55") == 3
    assert stub.IsActive(ref(model="llama"), timeout=10).result is True


@pytest.mark.parametrize(("metadata", "code", "words"), [
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "scalerMetadata.model is required"),
    ({"model": "  "}, grpc.StatusCode.INVALID_ARGUMENT, "scalerMetadata.model is required"),
    ({"model": "bad\x07id"}, grpc.StatusCode.INVALID_ARGUMENT, "control character U+0007"),
    ({"model": "llama", "quantile": "abc"}, grpc.StatusCode.INVALID_ARGUMENT, "quantile must be a number in (0, 1)"),
    ({"model": "llama", "quantile": "1.5"}, grpc.StatusCode.INVALID_ARGUMENT, "quantile must be a number in (0, 1)"),
    ({"model": "llama", "quantile": "0"}, grpc.StatusCode.INVALID_ARGUMENT, "quantile must be a number in (0, 1)"),
    ({"model": "llama", "quantile": "nan"}, grpc.StatusCode.INVALID_ARGUMENT, "quantile must be a number in (0, 1)"),
])
def test_bad_metadata_is_a_precise_status_on_every_rpc(stub, engine, metadata, code, words):
    store_run(engine, issued_at=START, q90=[150.0] * 60)
    calls = {
        "GetMetrics": lambda: stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(**metadata)), timeout=10),
        "GetMetricSpec": lambda: stub.GetMetricSpec(ref(**metadata), timeout=10),
        "IsActive": lambda: stub.IsActive(ref(**metadata), timeout=10),
        "StreamIsActive": lambda: next(stub.StreamIsActive(ref(**metadata), timeout=10)),
    }
    for name, call in calls.items():
        got, details = status_of(call)
        assert got == code and words in details, (name, got, details)


def test_an_unknown_model_gets_its_metric_spec_and_not_found_from_the_polled_rpcs(stub, engine):
    """KEDA asks for the spec once, to build the HPA, and leaves a trigger whose spec failed out of it until the
    ScaledObject changes: a model registered later must still get its floor, so only the polled RPCs say NOT_FOUND
    (where KEDA counts failures and applies fallback)."""
    spec = stub.GetMetricSpec(ref(model="nope"), timeout=10)
    assert [(s.metricName, s.targetSize) for s in spec.metricSpecs] == [(METRIC_NAME, 1)]
    calls = {
        "GetMetrics": lambda: stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(model="nope")), timeout=10),
        "IsActive": lambda: stub.IsActive(ref(model="nope"), timeout=10),
        "StreamIsActive": lambda: next(stub.StreamIsActive(ref(model="nope"), timeout=10)),
    }
    for name, call in calls.items():
        got, details = status_of(call)
        assert got == grpc.StatusCode.NOT_FOUND and "model 'nope' is not registered" in details, (name, got, details)
    with engine.begin() as conn:  # registered after KEDA built the HPA: the same spec now has a value
        upsert_models(conn, [ServingModelSpec(id="nope", replica_rps=2.0)])
    store_run(engine, issued_at=START, q90=[150.0] * 60, model_id="nope")
    assert floor_value(stub, model="nope") == 2


def test_the_metric_spec_is_answered_while_the_database_is_away(scaler_settings, clock):
    """A database unreachable at the moment KEDA builds the HPA must not leave prewarm's metric out of it: the spec
    needs no database, and GetMetrics says UNAVAILABLE (a failure KEDA counts towards fallback)."""
    with socket.socket() as probe:  # a loopback port nothing listens on: every connection is refused
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    away = make_engine(f"postgresql+psycopg://prewarm@127.0.0.1:{dead_port}/prewarm?connect_timeout=2")
    snapshot = ForecastSnapshot(away, refresh_s=0, settings=scaler_settings, clock=clock)
    server = KedaScalerServer(snapshot, scaler_settings, clock, host="127.0.0.1", port=0)
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = externalscaler_rpc.Stub(channel)
            spec = stub.GetMetricSpec(ref(model="llama"), timeout=10)
            assert [s.metricName for s in spec.metricSpecs] == [METRIC_NAME]
            got, details = status_of(lambda: floor_value(stub, model="llama"))
            assert got == grpc.StatusCode.UNAVAILABLE and "database is unavailable" in details
    finally:
        server.stop()
        away.dispose()


def test_unknown_metric_name_and_missing_forecasts(stub, engine, clock):
    store_run(engine, issued_at=START, q90=[150.0] * 60)
    got, details = status_of(lambda: stub.GetMetrics(
        pb.GetMetricsRequest(scaledObjectRef=ref(model="llama"), metricName="queue-length"), timeout=10))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and METRIC_NAME in details
    # registered without a forecast: no value (KEDA's fallback), and not active
    got, details = status_of(lambda: floor_value(stub, model="unforecast"))
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "no forecast yet" in details
    assert stub.IsActive(ref(model="unforecast"), timeout=10).result is False
    # the run's last minute is 12:59: at 12:59:45 a replica started now is ready in 13:00, past the run
    clock.now = START + timedelta(minutes=59, seconds=45)
    got, details = status_of(lambda: floor_value(stub, model="llama"))
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "expired" in details
    assert stub.IsActive(ref(model="llama"), timeout=10).result is False


@pytest.fixture
def fresh_limit_stub(engine, settings, clock):
    """A scaler with the default freshness limit (PREWARM_FORECAST_FRESH_S, 180 s)."""
    fresh_settings = settings.model_copy(update={"keda_stream_check_s": 0.05})
    assert fresh_settings.forecast_fresh_s == 180.0
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama", replica_rps=2.0)])
    yield from _served_stub(engine, fresh_settings, clock)


def test_a_stale_forecast_is_an_error_so_keda_falls_back(fresh_limit_stub, engine, clock):
    """After the forecast job stops, its last run still covers the hour ahead; served past PREWARM_FORECAST_FRESH_S
    it would hold the floor where it was and KEDA's fallback would never engage. Every polled RPC errs instead,
    IsActive too: KEDA scales nothing to zero on a trigger in error, and applies fallback."""
    stub = fresh_limit_stub
    store_run(engine, issued_at=START, q90=[300.0] * 60)  # 300/min at 120 a replica: 3 replicas all hour
    clock.now = START + timedelta(minutes=1)
    assert floor_value(stub, model="llama") == 3
    assert stub.IsActive(ref(model="llama"), timeout=10).result is True
    clock.now = START + timedelta(minutes=10)  # the run reaches 13:00, but is 600 s old
    calls = {
        "GetMetrics": lambda: floor_value(stub, model="llama"),
        "IsActive": lambda: stub.IsActive(ref(model="llama"), timeout=10),
        "StreamIsActive": lambda: next(stub.StreamIsActive(ref(model="llama"), timeout=10)),
    }
    for name, call in calls.items():
        got, details = status_of(call)
        assert got == grpc.StatusCode.FAILED_PRECONDITION, (name, got, details)
        assert "600 s old" in details and "PREWARM_FORECAST_FRESH_S=180 s" in details, (name, details)
    assert stub.GetMetricSpec(ref(model="llama"), timeout=10).metricSpecs  # the HPA keeps the metric
    store_run(engine, issued_at=START + timedelta(minutes=9, seconds=30), q90=[150.0] * 60)  # the job is back
    assert floor_value(stub, model="llama") == 2


def test_an_open_stream_ends_with_the_error_when_its_forecast_goes_stale(fresh_limit_stub, engine, clock):
    """A stream that answered active must not go on (or turn inactive, which lets KEDA scale to zero) once the
    forecast behind it is stale: it ends with FAILED_PRECONDITION, and KEDA reconnects and polls in the meantime."""
    store_run(engine, issued_at=START, q90=[300.0] * 60)
    clock.now = START + timedelta(minutes=1)
    reader = StreamReader(fresh_limit_stub.StreamIsActive(ref(model="llama")))
    try:
        assert reader.next() is True
        clock.now = START + timedelta(minutes=4)
        assert reader.next() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        reader.close()


class StreamReader:
    """Reads a StreamIsActive call in a thread so the test can wait on each pushed value with a timeout."""

    def __init__(self, call) -> None:
        self.call = call
        self.values: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.values.put(message.result)
        except grpc.RpcError as exc:
            self.values.put(exc.code())

    def next(self, timeout_s: float = 10.0):
        return self.values.get(timeout=timeout_s)

    def nothing_within(self, seconds: float) -> bool:
        try:
            self.values.get(timeout=seconds)
        except queue.Empty:
            return True
        return False

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(timeout=5)


def test_stream_pushes_active_a_lead_time_before_the_spike_arrives(stub, engine, clock):
    spike_at = START + timedelta(minutes=10)
    store_run(engine, issued_at=START, q90=[0.0] * 10 + [600.0] * 50)  # nothing until 12:10, then 5 replicas
    reader = StreamReader(stub.StreamIsActive(ref(model="llama")))
    try:
        assert reader.next() is False  # the current value at once
        # the lead time is DEFAULT_LEAD_S (59 s): 12:07:30 + 59 s is 12:08:29, its window still quiet
        clock.now = START + timedelta(minutes=7, seconds=30)
        assert reader.nothing_within(0.5)  # ten checks, no change, nothing sent
        clock.now = START + timedelta(minutes=8, seconds=30)  # 12:09:29: the window reaches the spike at 12:10
        assert reader.next() is True
        assert clock.now < spike_at  # pushed before the demand arrives
        assert floor_value(stub, model="llama") == 5
        clock.now = START + timedelta(minutes=70)  # the run has expired: nothing forecast, inactive again
        assert reader.next() is False
    finally:
        reader.close()


def test_stream_re_evaluates_when_a_new_forecast_run_lands(stub, engine, clock):
    store_run(engine, issued_at=START, q90=[0.0] * 60)
    reader = StreamReader(stub.StreamIsActive(ref(model="llama")))
    try:
        assert reader.next() is False
        assert reader.nothing_within(0.3)
        store_run(engine, issued_at=START + timedelta(seconds=20), q90=[0.0] + [300.0] * 59)  # clock unchanged
        assert reader.next() is True
        assert stub.IsActive(ref(model="llama"), timeout=10).result is True
    finally:
        reader.close()


def test_the_api_process_serves_the_scaler_when_a_port_is_set(engine, settings, clock):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama", replica_rps=2.0)])
    store_run(engine, issued_at=START, q90=[150.0] * 60)
    app = create_app(settings.model_copy(update={"keda_grpc_port": 0}), engine, clock=clock)
    with TestClient(app):
        port = app.state.keda_scaler.port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert floor_value(externalscaler_rpc.Stub(channel), model="llama") == 2
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # stopped with the app
        got, _ = status_of(lambda: externalscaler_rpc.Stub(channel).IsActive(ref(model="llama"), timeout=2))
        assert got == grpc.StatusCode.UNAVAILABLE


def test_a_port_in_use_fails_start_up_with_the_address(engine, scaler_settings, clock):
    snapshot = ForecastSnapshot(engine, refresh_s=0, settings=scaler_settings, clock=clock)
    first = KedaScalerServer(snapshot, scaler_settings, clock, host="127.0.0.1", port=0)
    port = first.start()
    try:
        second = KedaScalerServer(snapshot, scaler_settings, clock, host="127.0.0.1", port=port)
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
            second.start()
        second.stop()
    finally:
        first.stop()


def test_every_rpc_of_the_proto_is_implemented_by_the_service():
    """prewarm's service defines each RPC the proto declares itself (there is no generated base class to inherit an
    UNIMPLEMENTED answer from), and the bindings refuse a service that lacks one (a method added to the proto without
    an implementation here fails this test and the server's start)."""
    from api.keda_scaler import ExternalScalerService

    declared = [m.name for m in pb.DESCRIPTOR.services_by_name["ExternalScaler"].methods]
    assert declared == ["IsActive", "StreamIsActive", "GetMetricSpec", "GetMetrics"]
    for name in declared:
        assert name in vars(ExternalScalerService) and callable(vars(ExternalScalerService)[name]), name
    assert [m.name for m in externalscaler_rpc.SERVICE.methods] == declared

    class Partial:
        async def IsActive(self, request, context):  # noqa: N802 - the proto's name
            return pb.IsActiveResponse(result=True)

    with pytest.raises(TypeError, match="StreamIsActive, GetMetricSpec, GetMetrics"):
        externalscaler_rpc.add_to_server(Partial(), grpc.aio.server())


def _primary_address() -> str | None:
    """A non-loopback IPv4 address of this machine (``hostname -I``'s first), or None when it has none."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10, check=False).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return next((a for a in out if "." in a and not a.startswith("127.")), None)


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_on_all_addresses_serves_the_scaler_there_from_every_worker(engine, db_url, tmp_path, workers):
    """``prewarm serve --host 0.0.0.0`` (the Deployment's args) serves the scaler on that host too, not on
    PREWARM_API_HOST's loopback default; with several workers each binds the gRPC port with SO_REUSEPORT, as it
    binds the HTTP port, instead of the second failing and the supervisor stopping them all."""
    address = _primary_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama", replica_rps=2.0)])
    store_run(engine, issued_at=datetime.now(timezone.utc), q90=[150.0] * 60)
    http_port, grpc_port = free_port(), free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}, "DATABASE_URL": db_url,
           "PREWARM_DATA_DIR": str(tmp_path), "PYTHONPATH": str(REPO), "PREWARM_KEDA_GRPC_PORT": str(grpc_port)}
    log = tmp_path / "serve.log"
    server = start([sys.executable, "-m", "forecaster.cli", "serve", "--no-scheduler", "--host", "0.0.0.0",
                    "--port", str(http_port), "--workers", str(workers)], log, env=env)
    try:
        wait_until(lambda: _listening_sockets(grpc_port) >= workers, timeout=90, what="prewarm serve's scaler",
                   proc=server, log=log)
        for _ in range(3 * workers):  # a new connection each: the kernel hands them to either worker
            with grpc.insecure_channel(f"{address}:{grpc_port}") as channel:
                assert floor_value(externalscaler_rpc.Stub(channel), model="llama") == 2
        time.sleep(1.5)  # the supervisor checks its workers every 0.5 s: one that failed would have stopped it
        assert server.poll() is None, log.read_text()[-3000:]
        assert _listening_sockets(grpc_port) == workers  # one socket per worker, as for HTTP
    finally:
        stop_process(server, timeout=40)


def test_serve_with_workers_refuses_a_grpc_port_already_taken(db_url, tmp_path):
    """The supervisor checks the scaler's port as it checks HTTP's, before any worker starts: with SO_REUSEPORT a
    worker's bind alone would not notice another server of this user there and would share its connections."""
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        grpc_port = taken.getsockname()[1]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}, "DATABASE_URL": db_url,
               "PREWARM_DATA_DIR": str(tmp_path), "PYTHONPATH": str(REPO), "PREWARM_KEDA_GRPC_PORT": str(grpc_port)}
        done = subprocess.run([sys.executable, "-m", "forecaster.cli", "serve", "--no-scheduler", "--port",
                               str(free_port()), "--workers", "2"], env=env, capture_output=True, text=True,
                              check=False, timeout=120)
    finally:
        taken.close()
    assert done.returncode == 3, done.stderr[-3000:]
    assert f"127.0.0.1:{grpc_port}" in done.stderr and "api.workers" not in done.stderr, done.stderr[-3000:]
