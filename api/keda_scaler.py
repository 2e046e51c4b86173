"""KEDA's external scaler over gRPC (``api/proto/externalscaler.proto``): the forecast as a replica floor.

KEDA's ``external`` trigger calls ``GetMetricSpec`` once and then ``GetMetrics`` and ``IsActive`` every polling
interval for each ScaledObject; ``external-push`` also holds one ``StreamIsActive`` stream open per ScaledObject.
This server answers all four from the API's in-memory forecast snapshot (:class:`api.snapshot.ForecastSnapshot`,
the one the REST recommendation reads), with the REST recommendation's own logic
(:func:`forecaster.planning.recommendation.recommend`):

* the metric ``prewarm-replica-floor`` is ``replicas_at_lead_time``: the replicas needed when a replica started
  now would be ready (the planner's lead time for the model), at the trigger's quantile. ``targetSize`` is 1, so
  KEDA's HPA proposes that many replicas, except within its tolerance (10 % by default): it keeps the current count
  while the floor is within 10 % of it (17 over 16 replicas is ignored), unless the ScaledObject sets
  ``advanced.horizontalPodAutoscalerConfig.behavior.scaleUp.tolerance: 0`` (docs/autoscalers.md). The HPA takes the
  maximum over a ScaledObject's triggers, so beside a reactive trigger this is a floor (prewarm only ever adds
  capacity early, never holds it below the reactive ask).
* active is "some minute from now to the end of the lead window needs a replica"
  (:func:`~forecaster.planning.recommendation.demand_within_lead`), so a ScaledObject that scales to zero wakes a
  cold-start lead time before a forecast spike arrives. ``StreamIsActive`` sends the current value at once, then
  re-evaluates every ``PREWARM_KEDA_STREAM_CHECK_S`` (which also picks up a newly landed forecast run) and sends
  only changes.

Trigger metadata (``ScaledObjectRef.scalerMetadata``; KEDA passes the whole trigger metadata, so other keys such
as ``scalerAddress`` are ignored): ``model`` (required, a registered model id) and ``quantile`` (optional, in
(0, 1), default ``PREWARM_RECOMMENDATION_QUANTILE``; the stored level nearest to it is used, as in REST).

Errors: a missing or malformed ``model`` or ``quantile``, or a metric name other than ours: ``INVALID_ARGUMENT``
(from every RPC). The rest come from ``GetMetrics``, ``IsActive`` and ``StreamIsActive``, never from
``GetMetricSpec``, which answers the spec for any well-formed trigger (KEDA asks for it once, to build the HPA:
see :meth:`ExternalScalerService.GetMetricSpec`): a model not in the catalogue: ``NOT_FOUND``; no forecast yet, or
the newest one does not reach the lead window: ``FAILED_PRECONDITION`` from ``GetMetrics`` (KEDA then counts a
failure and applies the ScaledObject's ``fallback``), while ``IsActive`` answers false (the reactive triggers
decide); a forecast older than ``PREWARM_FORECAST_FRESH_S`` (the forecast job stopped): ``FAILED_PRECONDITION``
from all three, ``IsActive`` included (an error, not "inactive", so that KEDA falls back instead of scaling to
zero: :meth:`ForecastFloor.floor`); the database away and the model not in memory: ``UNAVAILABLE``. While the
database is away, answers keep coming from the snapshot held, as long as its forecasts are that fresh.

The port carries no token: KEDA's external scaler authenticates only with TLS client certificates, which this
server does not terminate; keep the port inside the cluster network (a NetworkPolicy admitting KEDA's operator).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

import grpc

from api.proto import externalscaler_pb2 as pb
from api.proto import externalscaler_rpc
from api.snapshot import ForecastSnapshot, ModelView
from forecaster.planning.recommendation import Recommendation, demand_within_lead, recommend, replicas_for
from forecaster.settings import Settings
from forecaster.store.fields import id_problem, safe_repr

log = logging.getLogger(__name__)

#: The one metric this scaler offers (KEDA prefixes it with ``sN-`` in the HPA and strips that before calling).
METRIC_NAME = "prewarm-replica-floor"
MODEL_KEY = "model"
QUANTILE_KEY = "quantile"


class ScalerError(Exception):
    """A request the scaler answers with a gRPC status instead of a value."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class FloorQuery:
    """What one ScaledObject asks: a model and the demand quantile its floor is sized at."""

    model_id: str
    quantile: float


def parse_query(metadata: Mapping[str, str], default_quantile: float) -> FloorQuery:
    """The trigger metadata as a :class:`FloorQuery`; ScalerError(INVALID_ARGUMENT) naming the bad key."""
    model_id = metadata.get(MODEL_KEY)
    if model_id is None or not model_id.strip():
        raise ScalerError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"scalerMetadata.{MODEL_KEY} is required: the id of a model registered in prewarm")
    problem = id_problem(model_id)
    if problem:
        raise ScalerError(grpc.StatusCode.INVALID_ARGUMENT, f"scalerMetadata.{MODEL_KEY} {problem}")
    raw = metadata.get(QUANTILE_KEY)
    if raw is None or not raw.strip():
        return FloorQuery(model_id, default_quantile)
    try:
        quantile = float(raw)
    except ValueError:
        quantile = math.nan
    if not 0.0 < quantile < 1.0:  # NaN fails this too
        raise ScalerError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"scalerMetadata.{QUANTILE_KEY} must be a number in (0, 1), e.g. 0.9; "
                          f"got {safe_repr(raw)}")
    return FloorQuery(model_id, quantile)


@dataclass(frozen=True)
class Floor:
    """One evaluation of a :class:`FloorQuery` against the snapshot."""

    recommendation: Recommendation
    active: bool

    @property
    def replicas(self) -> int | None:
        return self.recommendation.replicas_at_lead_time


class ForecastFloor:
    """Evaluates floor queries on the snapshot, refreshing it the way the REST recommendation route does."""

    def __init__(self, snapshot: ForecastSnapshot, settings: Settings, clock: Callable[[], datetime]) -> None:
        self.snapshot = snapshot
        self.settings = settings
        self.clock = clock

    async def view(self, model_id: str) -> ModelView:
        """The model's snapshot view; in memory on the hot path, a refresh in a worker thread only when needed."""
        snapshot = self.snapshot
        if self.settings.api_snapshot_refresh_s == 0 or snapshot.newest_issued_at is None:
            await asyncio.to_thread(snapshot.refresh_if_due)
        view = snapshot.get(model_id)
        if view is None and snapshot.healthy:
            await asyncio.to_thread(snapshot.refresh, wait=True)  # registered since the last refresh?
            view = snapshot.get(model_id)
        if view is None:
            if snapshot.healthy:
                raise ScalerError(grpc.StatusCode.NOT_FOUND,
                                  f"model {safe_repr(model_id, 260)} is not registered in prewarm "
                                  f"(scalerMetadata.{MODEL_KEY}); register it with PUT /v1/models/{{id}}")
            raise ScalerError(grpc.StatusCode.UNAVAILABLE, "prewarm's database is unavailable and the model is "
                                                           "not in memory")
        return view

    def evaluate(self, query: FloorQuery, view: ModelView) -> Floor:
        """The floor and activity of ``query`` now (pure: reads ``view`` and the clock).

        A forecast older than ``PREWARM_FORECAST_FRESH_S`` gives reason ``forecast_stale``, no replicas and not
        active; :meth:`floor` turns it into an error.
        """
        now = self.clock()
        lead_time_s = float(view.lead_time_s or self.settings.default_cold_start_s)
        result = recommend(view.forecast, model_id=query.model_id, now=now, lead_time_s=lead_time_s,
                           replica_rps=view.replica_rps, quantile=query.quantile,
                           max_age_s=self.settings.forecast_fresh_s)
        if result.reason in ("forecast_stale", "forecast_invalid"):
            return Floor(result, active=False)
        peak = demand_within_lead(view.forecast, now=now, lead_time_s=lead_time_s, quantile=query.quantile)
        active = peak is not None and replicas_for(peak, view.replica_rps) > 0
        return Floor(result, active)

    async def floor(self, query: FloorQuery) -> Floor:
        """The floor of ``query`` now; ScalerError(FAILED_PRECONDITION) when the model's forecast is stale.

        A stale forecast is an error for every RPC, ``IsActive`` and ``StreamIsActive`` included, not "inactive":
        KEDA treats a trigger that errs as neither active nor idle, so it does not scale the target to zero on it,
        and applies the ScaledObject's ``fallback`` replicas (after ``failureThreshold`` failures, from zero
        too). An ``IsActive`` false would let KEDA scale to zero after ``cooldownPeriod`` on a forecast nobody
        updates any more.
        """
        floor = self.evaluate(query, await self.view(query.model_id))
        if floor.recommendation.reason == "forecast_stale":
            raise ScalerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"model {safe_repr(query.model_id, 260)}'s newest forecast is "
                              f"{floor.recommendation.forecast_age_s:.0f} s old, older than "
                              f"PREWARM_FORECAST_FRESH_S={self.settings.forecast_fresh_s:g} s (is the forecast job "
                              f"running?); KEDA's fallback applies")
        if floor.recommendation.reason == "forecast_invalid":
            raise ScalerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"model {safe_repr(query.model_id, 260)}'s newest forecast holds an infinite, NaN "
                              f"or negative demand; KEDA's fallback applies")
        return floor


class StreamTicker:
    """Wakes every open ``StreamIsActive`` once per check interval, after refreshing the snapshot if it is due.

    The API process's own refresher thread keeps the snapshot fresh, so there the refresh here is a no-op; it
    matters where the server runs without one (a benchmark, a test).
    """

    def __init__(self, snapshot: ForecastSnapshot, check_s: float, *, refresh: bool) -> None:
        self._snapshot = snapshot
        self._check_s = check_s
        self._refresh = refresh
        self._changed = asyncio.Condition()
        self.generation = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._check_s)
            if self._refresh:  # with refresh on every read (PREWARM_API_SNAPSHOT_REFRESH_S=0) each evaluation does it
                try:
                    await asyncio.to_thread(self._snapshot.refresh_if_due)
                except Exception:  # a failed refresh must not stop the streams: they serve what is held
                    log.exception("KEDA scaler: snapshot refresh failed")
            async with self._changed:
                self.generation += 1
                self._changed.notify_all()

    async def after(self, generation: int) -> int:
        """Wait for the first tick after ``generation``; returns the new generation."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.generation > generation)
            return self.generation


class ExternalScalerService:
    """The four RPCs of KEDA's ``externalscaler.ExternalScaler`` (method names are the proto's)."""

    def __init__(self, floors: ForecastFloor, ticker: StreamTicker) -> None:
        self._floors = floors
        self._ticker = ticker

    def _query(self, ref: pb.ScaledObjectRef) -> FloorQuery:
        return parse_query(ref.scalerMetadata, self._floors.settings.recommendation_quantile)

    async def IsActive(self, request: pb.ScaledObjectRef, context) -> pb.IsActiveResponse:
        try:
            floor = await self._floors.floor(self._query(request))
        except ScalerError as exc:
            await context.abort(exc.code, exc.message)
        return pb.IsActiveResponse(result=floor.active)

    async def GetMetricSpec(self, request: pb.ScaledObjectRef, context) -> pb.GetMetricSpecResponse:
        """The one metric spec for any well-formed trigger; only malformed metadata is refused.

        The model is not looked up here. KEDA asks for the spec when it builds the ScaledObject's HPA and, when the
        call fails, logs the error and builds the HPA without this trigger's metric; it builds the HPA again only
        when the ScaledObject or the HPA changes. A model registered a minute later, or a database that was away
        during that one call, would leave the ScaledObject without prewarm's floor (and without ``fallback``,
        which acts on the metric's errors) until someone edits it. ``GetMetrics`` and ``IsActive`` report an
        unknown model or an unreachable database instead, on every poll, where KEDA counts them as failures.
        """
        try:
            self._query(request)
        except ScalerError as exc:
            await context.abort(exc.code, exc.message)
        return pb.GetMetricSpecResponse(metricSpecs=[pb.MetricSpec(metricName=METRIC_NAME, targetSize=1,
                                                                   targetSizeFloat=1.0)])

    async def GetMetrics(self, request: pb.GetMetricsRequest, context) -> pb.GetMetricsResponse:
        try:
            if request.metricName not in ("", METRIC_NAME):
                raise ScalerError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"unknown metric {safe_repr(request.metricName)}; this scaler serves "
                                  f"{METRIC_NAME!r} (from GetMetricSpec)")
            query = self._query(request.scaledObjectRef)
            floor = await self._floors.floor(query)
            if floor.replicas is None:
                reason = floor.recommendation.reason
                detail = ("has no forecast yet" if reason == "no_forecast"
                          else "has a newest forecast that does not reach the cold-start lead window (expired)")
                raise ScalerError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"model {safe_repr(query.model_id, 260)} {detail}; KEDA's fallback applies")
        except ScalerError as exc:
            await context.abort(exc.code, exc.message)
        return pb.GetMetricsResponse(metricValues=[pb.MetricValue(metricName=METRIC_NAME, metricValue=floor.replicas,
                                                                  metricValueFloat=float(floor.replicas))])

    async def StreamIsActive(self, request: pb.ScaledObjectRef, context):
        try:
            query = self._query(request)
            floor = await self._floors.floor(query)
        except ScalerError as exc:
            await context.abort(exc.code, exc.message)
        last = floor.active
        yield pb.IsActiveResponse(result=last)
        generation = self._ticker.generation
        while True:
            generation = await self._ticker.after(generation)
            try:
                floor = await self._floors.floor(query)
            except ScalerError as exc:
                if exc.code == grpc.StatusCode.UNAVAILABLE:
                    continue  # database away and the model not held: keep the last answer, KEDA keeps it too
                await context.abort(exc.code, exc.message)  # e.g. the model was removed from the catalogue
            if floor.active != last:
                last = floor.active
                yield pb.IsActiveResponse(result=last)


class KedaScalerServer:
    """The gRPC server in a thread of its own with its own event loop (grpc.aio: one stream costs no thread).

    Args:
        snapshot: the API's forecast snapshot (shared with REST; this server never replaces it).
        settings: ``recommendation_quantile``, ``default_cold_start_s``, ``keda_stream_check_s``.
        clock: the API's clock.
        host, port: where to listen (the address ``prewarm serve`` binds for HTTP); port 0 picks a free one
            (:attr:`port` says which).
        reuse_port: share the port with other processes of this user that set it too (``SO_REUSEPORT``): each
            worker of a multi-worker ``prewarm serve`` binds its own socket, as for HTTP (:mod:`api.workers`), and
            answers from its own snapshot, so any worker can take a connection. Off, a port in use is an error.
    """

    def __init__(self, snapshot: ForecastSnapshot, settings: Settings, clock: Callable[[], datetime], *,
                 host: str, port: int, reuse_port: bool = False) -> None:
        self._floors = ForecastFloor(snapshot, settings, clock)
        self._snapshot = snapshot
        self._settings = settings
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 literal in brackets
        self._reuse_port = reuse_port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._grace_s = 1.0
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port: int | None = None

    def start(self, timeout_s: float = 10.0) -> int:
        """Start serving; returns the bound port. RuntimeError when the address cannot be bound."""
        self._thread = threading.Thread(target=self._run, name="keda-external-scaler", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"KEDA external scaler did not start on {self._address} within {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"KEDA external scaler cannot listen on {self._address}: {self._error}")
        log.info("KEDA external scaler (gRPC) on %s", self._address.rsplit(":", 1)[0] + f":{self.port}")
        return self.port

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        ticker = StreamTicker(self._snapshot, self._settings.keda_stream_check_s,
                              refresh=self._settings.api_snapshot_refresh_s > 0)
        # gRPC sets SO_REUSEPORT unless told not to: without it a port in use is an error, not silently shared
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if self._reuse_port else 0)])
        externalscaler_rpc.add_to_server(ExternalScalerService(self._floors, ticker), server)
        try:
            self.port = server.add_insecure_port(self._address)
            await server.start()
        except Exception as exc:  # noqa: BLE001 - reported to start()'s caller
            self._error = exc
            self._ready.set()
            return
        ticking = asyncio.create_task(ticker.run())
        self._ready.set()
        await self._stopping.wait()
        await server.stop(self._grace_s)  # open streams are cancelled after the grace period
        ticking.cancel()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (open streams are cancelled after ``grace_s``) and join the thread."""
        self._grace_s = grace_s
        if self._loop is not None and self._stopping is not None:
            try:
                self._loop.call_soon_threadsafe(self._stopping.set)
            except RuntimeError:  # the loop already ended (start-up failed)
                pass
        if self._thread is not None:
            self._thread.join(timeout=grace_s + 10)
