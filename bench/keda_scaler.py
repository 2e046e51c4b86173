"""KEDA external scaler benchmark: ``GetMetrics`` latency and throughput at 10,000 models, REST as the baseline.

Usage:
    python bench/keda_scaler.py [--models 10000] [--concurrency 100] [--seconds 10] [--streams 10000] [--json PATH]

How the fleet is built: a fresh database (embedded PostgreSQL unless PREWARM_BENCH_ADMIN_URL names a server) gets
N synthetic models (``model-000000``...; ``replica_rps`` uniform in 0.5..20, seed 7) and one 60-minute forecast run
each, issued now (level gamma(1, 50) requests per minute times a slow sine, q0.1..q0.99 at 0.7..1.9 of it):
the shape of ``bench/api.py``'s fleet. ``prewarm serve --no-scheduler`` then runs as its own process with
``PREWARM_KEDA_GRPC_PORT`` set, so the gRPC scaler and the REST API answer from the one in-memory snapshot of the
same process, as in production.

What is measured, each phase for ``--seconds`` after a warm-up, from this process over loopback (closed loop,
``--concurrency`` calls in flight, each for a random model; latency from send to full reply):

0. in this process, the server's own work per query (parse the metadata, evaluate on the snapshot) on a synthetic
   snapshot of N models built in memory (:func:`in_process`), with no transport;
1. ``GetMetrics`` over one gRPC channel (KEDA shares one connection per scaler address);
2. the baseline in the same run: ``GET /v1/models/{id}/recommendation`` (what KEDA's metrics-api scaler polls) over
   keep-alive HTTP/1.1 connections;
3. ``GetMetrics`` again while ``--streams`` ``StreamIsActive`` streams are open (one per model, as KEDA's
   ``external-push`` trigger holds them), which the server re-evaluates every ``PREWARM_KEDA_STREAM_CHECK_S``.

Client and server share this machine's cores, so the figures include the load generator's contention; the Python
client is itself a bottleneck, so throughput here is a lower bound of what the server sustains.
``PREWARM_BENCH_SERVER_LOG=PATH`` keeps the server's output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc
import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdb import on_bench_server  # noqa: E402
from api.keda_scaler import METRIC_NAME  # noqa: E402
from api.proto import externalscaler_pb2 as pb  # noqa: E402
from api.proto import externalscaler_rpc  # noqa: E402

DATABASE = "bench_keda"
#: Streams opened at once. grpcio 1.85's server cancels about a quarter of a burst of 3,000 new streams on one
#: connection (CANCELLED, with a bare grpc.aio servicer too, whatever grpc.max_concurrent_streams says); batches of
#: 500 open 10,000 without a failure. KEDA opens a stream per ScaledObject and retries a failed one with back-off.
STREAM_BATCH = 500


def _bench_api():
    """bench/api.py (its fleet and helpers), loaded by path: ``api`` is the project's package name."""
    spec = importlib.util.spec_from_file_location("bench_api", Path(__file__).with_name("api.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_api = _bench_api()
free_port, model_ids, closed_loop = _api.free_port, _api.model_ids, _api.closed_loop


def prepare(admin_url: str, n_models: int) -> tuple[str, str]:
    """bench/api.py's fleet in a database of its own: ``n_models`` models, one 60-minute run each, a read token."""
    return _api.prepare(admin_url, n_models, database=DATABASE)


@contextlib.contextmanager
def serving(url: str, token: str, probe_model: str, *, timeout_s: float = 180.0):
    """``prewarm serve`` with the KEDA scaler on; yields (REST base URL, gRPC address) once both answer."""
    http_port, grpc_port = free_port(), free_port()
    # the fleet's one run is written once, before the server starts: keep it served as fresh for the whole benchmark
    env = {**os.environ, "DATABASE_URL": url, "PREWARM_KEDA_GRPC_PORT": str(grpc_port),
           "PREWARM_FORECAST_FRESH_S": "86400"}
    base, address = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    with open(os.environ.get("PREWARM_BENCH_SERVER_LOG", os.devnull), "w") as server_log:
        server = subprocess.Popen([sys.executable, "-m", "forecaster.cli", "serve", "--port", str(http_port),
                                   "--no-scheduler"], env=env, cwd=REPO, stdout=server_log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    rest_up = httpx.get(f"{base}/v1/models/{probe_model}/recommendation",
                                        headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200
                    with grpc.insecure_channel(address) as channel:
                        externalscaler_rpc.Stub(channel).GetMetrics(request(probe_model), timeout=30)
                    if rest_up:
                        break
                except (httpx.HTTPError, grpc.RpcError):
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prewarm serve did not come up (exit code {server.poll()})")
                time.sleep(0.5)
            yield base, address
        finally:
            _api.stop_server(server)


def scaled_object(model_id: str) -> pb.ScaledObjectRef:
    return pb.ScaledObjectRef(name=f"vllm-{model_id}", namespace="serving",
                              scalerMetadata={"scalerAddress": "prewarm:9090", "model": model_id, "quantile": "0.9"})


def request(model_id: str) -> pb.GetMetricsRequest:
    return pb.GetMetricsRequest(scaledObjectRef=scaled_object(model_id), metricName=METRIC_NAME)


async def grpc_phase(address: str, ids: list[str], concurrency: int, seconds: float, streams: int) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = externalscaler_rpc.Stub(channel)
        opened, first = [], []
        started = time.perf_counter()
        for lo in range(0, streams, STREAM_BATCH):  # each batch's first answers before the next batch opens
            batch = [stub.StreamIsActive(scaled_object(model_id)) for model_id in ids[lo:lo + STREAM_BATCH]]
            first += await asyncio.gather(*(s.read() for s in batch), return_exceptions=True)
            opened += batch
        failed = [f for f in first if isinstance(f, BaseException)]
        if failed:
            print(f"  {len(failed)} of {len(opened)} streams failed to open: {failed[0]!r}", file=sys.stderr)
        open_s = time.perf_counter() - started

        async def get_metrics(model_id: str) -> bool:
            try:
                reply = await stub.GetMetrics(request(model_id), timeout=10)
            except grpc.aio.AioRpcError:
                return False
            return len(reply.metricValues) == 1

        latencies, errors = await closed_loop(get_metrics, ids, concurrency, seconds, warmup_s=2.0)
        for s in opened:
            s.cancel()
    return summary(latencies, errors, seconds) | {"streams_open": len(opened) - len(failed),
                                                  "streams_failed": len(failed), "streams_open_s": round(open_s, 2)}


async def rest_phase(base: str, token: str, ids: list[str], concurrency: int, seconds: float) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, limits=limits,
                                 timeout=10) as client:
        async def recommendation(model_id: str) -> bool:
            response = await client.get(f"/v1/models/{model_id}/recommendation")
            return response.status_code == 200 and response.json()["replicas_at_lead_time"] is not None

        latencies, errors = await closed_loop(recommendation, ids, concurrency, seconds, warmup_s=2.0)
    return summary(latencies, errors, seconds)


def summary(latencies: list[float], errors: int, seconds: float) -> dict:
    ms = np.array(latencies) * 1000.0
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "calls_per_s": round(len(ms) / seconds, 1), "calls": int(len(ms)), "errors": errors}


def in_process(n_models: int, calls: int = 50_000) -> dict:
    """Microseconds per parse + evaluate of one GetMetrics query on a synthetic in-memory snapshot (no gRPC, no DB).

    The snapshot holds ``n_models`` views built directly (60-minute runs, three levels, as :func:`prepare` writes
    them); this is the server's own work per call, the ceiling one core would reach without transport costs.
    """
    from api.keda_scaler import ForecastFloor, parse_query
    from api.snapshot import ForecastSnapshot, ModelView
    from forecaster.planning.recommendation import MinuteQuantiles
    from forecaster.settings import Settings

    settings = Settings()
    now = datetime.now(timezone.utc)
    snapshot = ForecastSnapshot(engine=None, settings=settings, clock=lambda: now)
    rng = np.random.default_rng(7)
    minutes_s = (np.arange(60) * 60 + int(now.timestamp()) // 60 * 60).astype("int64")
    for model_id, base in zip(model_ids(n_models), rng.gamma(1.0, 50.0, size=n_models)):
        level = base * (1 + 0.2 * np.sin(np.arange(60) / 9))
        snapshot.models[model_id] = ModelView(
            replica_rps=float(rng.uniform(0.5, 20)), lead_time_s=19.76, start_state="none",
            forecast=MinuteQuantiles(issued_at=now, model_version_id=None, minutes_s=minutes_s,
                                     levels=(0.1, 0.5, 0.9), values=np.stack([level * 0.7, level, level * 1.4], 1),
                                     point=level))
    snapshot.healthy = True
    floors = ForecastFloor(snapshot, settings, lambda: now)
    refs = [scaled_object(m).scalerMetadata for m in random.Random(7).choices(model_ids(n_models), k=calls)]
    started = time.perf_counter()
    for metadata in refs:
        query = parse_query(metadata, settings.recommendation_quantile)
        floors.evaluate(query, snapshot.get(query.model_id))
    per_call_us = (time.perf_counter() - started) / calls * 1e6
    return {"per_call_us": round(per_call_us, 1), "calls": calls, "calls_per_s_one_core": round(1e6 / per_call_us)}


def run(admin_url: str, n_models: int, concurrency: int, seconds: float, streams: int) -> dict:
    cost = in_process(n_models)
    started = time.perf_counter()
    url, token = prepare(admin_url, n_models)
    prepare_s = time.perf_counter() - started
    ids = model_ids(n_models)
    with serving(url, token, ids[0]) as (base, address):
        grpc_figures = asyncio.run(grpc_phase(address, ids, concurrency, seconds, streams=0))
        rest_figures = asyncio.run(rest_phase(base, token, ids, concurrency, seconds))
        streamed = asyncio.run(grpc_phase(address, ids, concurrency, seconds, streams=min(streams, n_models))
                               ) if streams else None
    return {"models": n_models, "concurrency": concurrency, "seconds": seconds, "prepare_s": round(prepare_s, 1),
            "in_process": cost,
            "get_metrics": grpc_figures, "rest_recommendation": rest_figures, "get_metrics_with_streams": streamed,
            "throughput_ratio_grpc_over_rest": round(grpc_figures["calls_per_s"] / rest_figures["calls_per_s"], 2)}


def describe(name: str, figures: dict) -> str:
    return (f"{name}: p50 {figures['p50_ms']:.2f} ms, p99 {figures['p99_ms']:.2f} ms, "
            f"{figures['calls_per_s']:,.0f} calls/s ({figures['calls']:,} calls, {figures['errors']} errors)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=10_000, help="StreamIsActive streams in phase 3 (0: skip).")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures = on_bench_server(lambda url: run(url, args.models, args.concurrency, args.seconds, args.streams),
                              prefix="prewarm-bench-keda-")
    print(f"KEDA external scaler, {figures['models']:,} models, {figures['concurrency']} calls in flight, "
          f"{figures['seconds']:g} s per phase (fleet prepared in {figures['prepare_s']:g} s)")
    cost = figures["in_process"]
    print(f"  in process (synthetic snapshot, no gRPC): {cost['per_call_us']:.1f} us per query, "
          f"{cost['calls_per_s_one_core']:,} queries/s on one core")
    print("  " + describe("gRPC GetMetrics", figures["get_metrics"]))
    print("  " + describe("REST recommendation (baseline)", figures["rest_recommendation"]))
    if figures["get_metrics_with_streams"]:
        print("  " + describe(f"gRPC GetMetrics, {figures['get_metrics_with_streams']['streams_open']:,} streams open",
                              figures["get_metrics_with_streams"]))
    print(f"  throughput gRPC / REST: {figures['throughput_ratio_grpc_over_rest']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
