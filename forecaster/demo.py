"""``prewarm demo``: the whole loop on a real trace, on the embedded database, onto a simulated cluster.

:func:`run_loop` ingests the first 18 hours of the shipped Azure Functions day
as history, trains the ensemble, then replays the rest minute by minute at an
accelerated clock. Each replayed minute the requests of that minute are served by a
fleet simulator (:class:`DemoCluster`), the minute's counts are ingested, the forecast
job stores forecasts and the plan job plans from them and hands the plan to the
production actuator (store ledger, guardrails), whose backend is that simulator: so the
actions in the store carry the statuses a cluster gave them, and the simulator's replica
starts are stored as cold starts. A reactive autoscaler (Knative's KPA) serves the same
requests on a second simulator; both simulators' figures per model are stored as a
replay (:mod:`forecaster.store.replays`) for the dashboard. The CLI serves the API and
dashboard meanwhile. :func:`run_demo` is the plain ingest-and-summarise mode
(``--summary-only``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from forecaster.contracts.fleetconfig import FleetConfig

from forecaster.data import AZURE2019_TOP100, sample_path
from forecaster.ingest.service import ingest_trace_file
from forecaster.settings import Settings
from forecaster.store.invocations import batch_window_models, read_counts
from forecaster.store.nodes import register_nodes


def summarise(counts: pd.DataFrame) -> pd.DataFrame:
    """Per model: total, active share of known minutes, mean and peak per minute, peak-to-mean ratio."""
    known = counts.dropna(subset=["y"])
    grouped = known.groupby("unique_id")["y"]
    table = pd.DataFrame(
        {
            "total": grouped.sum().astype("int64"),
            "known_min": grouped.size(),
            "active_pct": grouped.apply(lambda s: 100.0 * float((s > 0).mean())),
            "mean_per_min": grouped.mean(),
            "peak_per_min": grouped.max().astype("int64"),
        }
    )
    table["peak_to_mean"] = table["peak_per_min"] / table["mean_per_min"].replace(0, np.nan)
    return table.sort_values("total", ascending=False)


def run_demo(
    engine: Engine,
    settings: Settings,
    *,
    now: datetime,
    trace: Path | None = None,
    top: int = 15,
    echo: Callable[[str], None] = print,
) -> pd.DataFrame:
    """Ingest ``trace`` (default: the shipped Azure 2019 top-100 sample) and print a summary."""
    path = trace or sample_path(AZURE2019_TOP100)
    result = ingest_trace_file(engine, settings, path, now=now, register=True)
    window_start, window_end, model_ids = batch_window_models(engine, result.batch_id)
    window = (window_start, window_end)
    state = "already in the store (no change)" if result.duplicate else f"{result.rows_written:,} non-zero rows written"
    echo(f"ingested {path.name}: {result.models:,} models, {result.invocations:,} invocations, "
         f"{result.covered_steps:,} model-steps covered; {state}")
    echo(f"window {window[0]:%Y-%m-%d %H:%M} .. {window[1]:%Y-%m-%d %H:%M} UTC")
    counts = read_counts(engine, list(model_ids), window[0], window[1])
    table = summarise(counts)
    shown = table.head(top)
    echo(f"\n{'model':<18}{'total':>10}{'active%':>9}{'mean/min':>10}{'peak/min':>10}{'peak/mean':>10}")
    for row in shown.itertuples():
        model_id = row.Index
        name = model_id if len(model_id) <= 16 else model_id[:15] + "~"
        echo(f"{name:<18}{int(row.total):>10,}{row.active_pct:>9.1f}{row.mean_per_min:>10.1f}"
             f"{int(row.peak_per_min):>10,}{row.peak_to_mean:>10.1f}")
    if len(table) > top:
        echo(f"... and {len(table) - top} more models")
    echo(f"\nall models: {int(table.total.sum()):,} invocations; median model active "
         f"{table.active_pct.median():.1f}% of minutes; median peak/mean {table.peak_to_mean.median():.1f}")
    return table


# --------------------------------------------------------------------------- the whole loop


class SimClock:
    """The demo's clock: trace time, advanced by the replay loop (read by the API and dashboard)."""

    def __init__(self, start: datetime) -> None:
        self._now = start

    def __call__(self) -> datetime:
        return self._now

    def set(self, moment: datetime) -> None:
        self._now = moment


#: The simulated cluster the demo replays onto (the store's ``nodes`` mirror it): 32 nodes of 8 GPUs, the
#: simulator's default fleet. The sample's 100 models need 116 GPUs with one replica each; on 8 nodes of 8 the
#: reactive baseline waits for free GPUs (p99 wait above 5 hours on the 6-hour replay), which says nothing about
#: pre-warming.
DEMO_CLUSTER = FleetConfig(n_nodes=32, gpus_per_node=8)
#: Minutes before the replay both simulators serve unscored, so neither starts from an empty cluster.
WARMUP_MIN = 10
#: Simulated minutes between retrains of the cold-start latency model on the stored cold starts and transfers
#: (production retrains it nightly; the plan job loads the newest saved one).
LATENCY_REFIT_MIN = 60
#: Where the simulator's replica starts go in ``cold_starts.source``.
COLD_START_SOURCE = "simulated-cluster"
REPLAY_SOURCE = "demo"
#: Minutes after the replay's end within which actions it planned may fall due (the plan horizon is at most 60):
#: a re-run clears them and the closing summary counts them, so both read the same actions.
ACTION_TAIL_MIN = 60


def register_fleet(engine: Engine, counts: pd.DataFrame, *, config: FleetConfig = DEMO_CLUSTER) -> pd.DataFrame:
    """Give each trace series a real open model from the catalogue (busiest get the biggest) and a GPU fleet.

    The nodes are the simulated cluster's (``node-0`` ..), so the planner's pre-pulls and pre-loads name nodes
    the simulator knows. Returns the catalogue table per model id (the simulator's model table).
    """
    from forecaster.simulation.catalog import assign_models
    from forecaster.store.catalog import ServingModelSpec, upsert_models

    totals = counts.groupby("unique_id")["y"].sum()
    table = assign_models(totals.index.to_numpy(), order_by=totals.to_numpy())
    specs = [ServingModelSpec(id=str(model_id), image_ref=row.image_ref, image_size_bytes=int(row.image_bytes),
                              weights_uri=row.weights_uri, weights_size_bytes=int(row.weights_bytes),
                              gpus_per_replica=int(row.gpus), replica_rps=float(row.replica_rps),
                              labels={"catalog": row.catalog_name, "registered_by": "demo"})
             for model_id, row in table.iterrows()]
    with engine.begin() as conn:
        upsert_models(conn, specs)
        register_nodes(conn, count=config.n_nodes, gpus_per_node=config.gpus_per_node,
                       disk_bytes=int(config.disk_bytes), host_bytes=int(config.host_bytes))
    return table


def scored_starts(result, score_from_s: float) -> pd.DataFrame:
    """The result's replica starts (one row per replica that became ready) that began in the scored window."""
    events = result.events
    return events[events["started_s"] >= score_from_s] if len(events) else events


def per_model_outcomes(result, score_from_s: float = 0.0) -> list[dict]:
    """One simulator's figures per model (:data:`forecaster.store.replays.OUTCOME_COLUMNS`) from its result.

    ``cold_requests``: requests that arrived while the model had no ready replica; ``replica_starts``: replicas
    that became ready, started at or after ``score_from_s``; ``wait_total_s`` / ``wait_max_s``: seconds from
    arrival to service start, summed / worst (the simulator scores requests from ``score_from_s`` on).
    """
    n = len(result.model_ids)
    wait_total = np.bincount(result.wait_model, weights=result.waits, minlength=n) if len(result.waits) \
        else np.zeros(n)
    wait_max = np.zeros(n)
    if len(result.waits):
        np.maximum.at(wait_max, result.wait_model, result.waits)
    events = scored_starts(result, score_from_s)
    starts = events["model_id"].value_counts() if len(events) else pd.Series(dtype="int64")
    return [{"model_id": str(mid), "requests": int(result.requests[i]), "cold_requests": int(result.cold_requests[i]),
             "replica_starts": int(starts.get(str(mid), 0)), "wait_total_s": float(wait_total[i]),
             "wait_max_s": float(wait_max[i])} for i, mid in enumerate(result.model_ids)]


class ActuatorDriven:
    """The prewarm side's simulator policy: it decides nothing itself; the plan job plans once a minute and its
    actuator (the production one, over the store) carries actions out on the simulator. Between plans this
    runs the actuator whenever a pending action falls due (checked every simulated second, as the planner's
    deadlines are seconds apart; the store is asked only when its next due time has come).

    The serving layer is the same as in the replay benchmark's prewarm rows (:class:`PlannerPolicy`): the
    activator starts a replica for a request that finds none, sustained overload adds replicas, and an
    on-demand replica is kept 60 s after its last request.
    """

    name = "prewarm"
    reactive_overload = True
    idle_grace_s = 60.0
    decide_every_s = 1.0

    def __init__(self, start: pd.Timestamp) -> None:
        self.start = start
        self.actuator = None
        self.engine: Engine | None = None
        self.next_due: datetime | None = None
        self.polls = 0

    def refresh(self) -> None:
        """Ask the store when the next pending action falls due (after a plan, and after each run)."""
        from forecaster.store.replays import next_pending_at

        with self.engine.connect() as conn:
            self.next_due = next_pending_at(conn)

    def decide(self, view):
        if self.actuator is None or self.next_due is None:
            return None
        now = (self.start + pd.Timedelta(seconds=view.now_s)).to_pydatetime()
        if now >= self.next_due:
            self.actuator.run_due(now=now)
            self.polls += 1
            self.refresh()
        return None


class ScheduledLatency:
    """Retrains and saves the latency model every ``refit_min`` simulated minutes (the demo's nightly retrain).

    The plan job loads the newest saved latency model (``forecaster.coldstart.service``); in the demo's
    accelerated day the simulated cluster's cold starts arrive in minutes, so the model is retrained hourly in
    simulated time instead of nightly.

    Args:
        engine: the store (its ``cold_starts`` and ``transfers``).
        settings: where the model is saved (``models_dir``).
        refit_min: simulated minutes between retrains (default :data:`LATENCY_REFIT_MIN`).
    """

    def __init__(self, engine: Engine, settings: Settings, refit_min: int = LATENCY_REFIT_MIN) -> None:
        self.engine = engine
        self.settings = settings
        self.refit_min = refit_min
        self.refits = 0
        self._fitted_at: datetime | None = None

    def __call__(self, now: datetime) -> None:
        from datetime import timedelta

        from forecaster.coldstart.service import train_latency_model

        if self._fitted_at is None or now - self._fitted_at >= timedelta(minutes=self.refit_min):
            train_latency_model(self.engine, self.settings, now)
            self._fitted_at = now
            self.refits += 1


def demo_workload(counts: pd.DataFrame, ids: np.ndarray, *, start: pd.Timestamp, minutes: int):
    """The requests both simulators serve: per-minute counts (``unique_id, ds, y``) of ``[start, start +
    minutes)`` for ``ids`` (in that order), spread uniformly within each minute (seed 0)."""
    from forecaster.planning.forecasts import CountPanel
    from forecaster.simulation.workload import Workload

    column = ((counts["ds"] - start) / pd.Timedelta(minutes=1)).astype("int64").to_numpy()
    row = pd.Index(ids).get_indexer(counts["unique_id"].astype(str))
    grid = np.zeros((len(ids), minutes))
    keep = (row >= 0) & (column >= 0) & (column < minutes)
    np.add.at(grid, (row[keep], column[keep]), counts["y"].to_numpy(dtype="float64")[keep])
    return Workload.from_counts(CountPanel(ids=ids, start=start, counts=grid), spread="uniform", seed=0)


class DemoCluster:
    """The replayed minutes on two fleet simulators: prewarm's (behind the actuator) and a reactive one.

    Both serve the same requests (the trace's per-minute counts spread uniformly within each minute, seed 0)
    on the same fleet (:data:`DEMO_CLUSTER`), from an empty cluster ``warmup_min`` minutes before the replay:
    those minutes are served (prewarm's side by its reactive path alone, as no forecast exists yet) but not
    scored, so the comparison starts with both clusters serving.

    Args:
        engine: the store (actions, cold starts, node state and the replay's figures go there).
        settings: the product settings (the actuator's guardrails).
        counts: counts (``unique_id, ds, y``) of the replayed minutes and the warm-up before them.
        models: the catalogue table per model id (:func:`register_fleet`).
        start: the first replayed minute (UTC).
        minutes: how many minutes are replayed.
        warmup_min: minutes served unscored before ``start``.
    """

    def __init__(self, engine: Engine, settings: Settings, counts: pd.DataFrame, models: pd.DataFrame, *,
                 start: pd.Timestamp, minutes: int, config: FleetConfig = DEMO_CLUSTER,
                 warmup_min: int = WARMUP_MIN) -> None:
        from forecaster.actuation.actuator import Actuator
        from forecaster.simulation.backend import SimulatedBackend
        from forecaster.simulation.engine import FleetSimulator
        from forecaster.simulation.policies import KnativePolicy
        from forecaster.store.replays import forget_replay_window, start_replay

        config = replace(config, score_from_s=60.0 * warmup_min)
        self.engine, self.settings, self.config = engine, settings, config
        self.start = start - pd.Timedelta(minutes=warmup_min)  # simulated second 0
        ids = np.asarray(sorted(models.index.astype(str)), dtype=object)
        workload = demo_workload(counts, ids, start=self.start, minutes=warmup_min + minutes)
        table = models.loc[ids]
        self.policy = ActuatorDriven(self.start)
        self.prewarm = FleetSimulator(workload, table, self.policy, config)
        self.reactive = FleetSimulator(workload, table, KnativePolicy(), config)
        self.prewarm.begin()
        self.reactive.begin()
        self.actuator = Actuator(engine, settings, SimulatedBackend(self.prewarm))
        self.policy.actuator, self.policy.engine = self.actuator, engine
        self._pushed = 0
        end = start + pd.Timedelta(minutes=minutes)
        #: actions planned in the replay fall due up to here: the summary counts them
        self.actions_end = (end + pd.Timedelta(minutes=ACTION_TAIL_MIN)).to_pydatetime()
        with engine.begin() as conn:
            # what earlier runs left from this run's start on (a longer run's later actions and starts, actions
            # planned near an end that fall due after it): left, they would be read as this run's present
            self.forgotten = forget_replay_window(conn, start=self.start.to_pydatetime(),
                                                  cold_start_source=COLD_START_SOURCE, stale_nodes_like="gpu-node-%")
            self.replay_id = start_replay(conn, source=REPLAY_SOURCE, window_start=start.to_pydatetime(),
                                          window_end=end.to_pydatetime(), policies=("prewarm", "reactive"),
                                          summary={"cluster": {"nodes": config.n_nodes,
                                                               "gpus_per_node": config.gpus_per_node}})

    def advance(self, now: datetime) -> dict:
        """Serve every request before ``now`` on both simulators, then report prewarm's cluster to the store:
        its new replica starts as cold starts and its nodes' free capacity and caches (as node agents would)."""
        from forecaster.ingest.service import push_cold_starts
        from forecaster.store.nodes import report_node_state

        until = (pd.Timestamp(now) - self.start).total_seconds()
        self.prewarm.advance(until)
        self.reactive.advance(until)
        fresh = self.prewarm.events[self._pushed:]
        self._pushed = len(self.prewarm.events)
        stored = {"inserted": 0}
        if fresh:
            events = [self._cold_start(e) for e in fresh]
            # The store keys a cold start by (model, node, start); replicas the simulator started in one tick on
            # one node are separate starts, so each further one is recorded a millisecond later.
            seen: dict[tuple, int] = {}
            for event in events:
                key = (event["model_id"], event["node_id"], event["started_at"])
                if key in seen:
                    seen[key] += 1
                    event["started_at"] = (pd.Timestamp(key[2]) + pd.Timedelta(milliseconds=seen[key])).isoformat()
                else:
                    seen[key] = 0
            stored = push_cold_starts(self.engine, self.settings, events, now=now, source=COLD_START_SOURCE,
                                      register=False)
        inputs = self.prewarm.fleet_inputs()
        with self.engine.begin() as conn:
            report_node_state(conn, nodes=inputs["nodes"], artefacts=inputs["artefacts"],
                              gpus_total=self.config.gpus_per_node, now=now)
        return stored

    def _cold_start(self, event: dict) -> dict:
        from forecaster.contracts.phases import PHASES

        started = self.start + pd.Timedelta(seconds=float(event["started_s"]))
        return {"model_id": event["model_id"], "node_id": event["node_id"], "started_at": started.isoformat(),
                "total_seconds": float(event["total_seconds"]), "cache_state": event["cache_state"],
                **{phase: float(event[phase]) for phase in PHASES}}

    def comparison(self) -> dict:
        """Both simulators' figures so far: per policy and model, and totals per policy."""
        prewarm, reactive = self.prewarm.result(), self.reactive.result()
        scored = self.config.score_from_s
        outcomes = {"prewarm": per_model_outcomes(prewarm, scored), "reactive": per_model_outcomes(reactive, scored)}
        totals = {name: {"requests": int(r.requests.sum()), "cold_requests": int(r.cold_requests.sum()),
                         "replica_starts": int(len(scored_starts(r, scored))), "wait_total_s": float(r.waits.sum()),
                         "wait_p99_s": r.summary()["wait_p99_s"], "gpu_seconds": float(r.gpu_seconds),
                         "gpu_unavailable": int(r.gpu_unavailable)}
                  for name, r in (("prewarm", prewarm), ("reactive", reactive))}
        return {"outcomes": outcomes, "totals": totals, "guardrail_refusals": dict(self.actuator.refusals)}

    def store(self, now: datetime) -> dict:
        """Write the comparison so far to the replay's rows (what the API serves); returns it."""
        from forecaster.store.replays import write_replay_outcomes

        figures = self.comparison()
        summary = {"cluster": {"nodes": self.config.n_nodes, "gpus_per_node": self.config.gpus_per_node},
                   "totals": figures["totals"], "guardrail_refusals": figures["guardrail_refusals"]}
        with self.engine.begin() as conn:
            write_replay_outcomes(conn, replay_id=self.replay_id, scored_until=now, outcomes=figures["outcomes"],
                                  summary=summary)
        return figures


def format_comparison(totals: dict, actions: dict) -> list[str]:
    """The demo's closing lines: prewarm vs the reactive autoscaler on the same minutes and cluster."""
    p, r = totals["prewarm"], totals["reactive"]
    rows = [("requests", "requests", "{:,}"), ("cold-start requests", "cold_requests", "{:,}"),
            ("replica starts", "replica_starts", "{:,}"), ("request wait, total (s)", "wait_total_s", "{:,.0f}"),
            ("request wait, p99 (s)", "wait_p99_s", "{:.1f}"), ("GPU-seconds", "gpu_seconds", "{:,.0f}")]
    lines = [f"{'on the simulated cluster':<26}{'prewarm':>14}{'reactive':>14}"]
    lines += [f"{label:<26}{fmt.format(p[key]):>14}{fmt.format(r[key]):>14}" for label, key, fmt in rows]
    avoided = r["cold_requests"] - p["cold_requests"]
    share = f" ({100.0 * avoided / r['cold_requests']:.0f}% of reactive's)" if r["cold_requests"] else ""
    lines.append(f"prewarm avoided {avoided:,} cold-start requests{share} and saved "
                 f"{r['wait_total_s'] - p['wait_total_s']:,.0f} s of request wait")
    plain = {k: v for k, v in actions.items() if ":" not in k}
    reasons = {k.split(":", 1)[1]: v for k, v in actions.items() if ":" in k}
    line = "actions on the simulated cluster: " + (", ".join(f"{n:,} {status}" for status, n in sorted(plain.items()))
                                                   or "none")
    if reasons:
        line += " (not succeeded: " + ", ".join(f"{n:,} {why}" for why, n in sorted(reasons.items())) + ")"
    lines.append(line)
    return lines


def run_loop(
    engine: Engine,
    settings: Settings,
    *,
    clock: SimClock | None = None,
    trace: Path | None = None,
    train_minutes: int = 1080,
    replay_minutes: int | None = None,
    speed: float = 60.0,
    members: list[str] | None = None,
    echo: Callable[[str], None] = print,
    on_ready: Callable[[SimClock], None] | None = None,
    stop: "threading.Event | None" = None,
    store_every_min: int = 10,
) -> dict:
    """Ingest the first ``train_minutes`` of the trace, train, then replay the rest minute by minute.

    Each replayed minute: both simulators serve that minute's requests (:class:`DemoCluster`), its counts are
    pushed (as a live source would), then the forecast job and the plan job run at the simulated ``now``; the
    plan job's actuator carries the plan out on prewarm's simulator. Every ``store_every_min`` minutes and at
    the end the comparison with the reactive simulator is stored. ``speed`` simulated seconds pass per wall
    second (0: as fast as the jobs run).

    Returns:
        ``replayed_minutes``, ``forecast_rows``, ``actions`` (planned), ``carried_out`` (actions by status as
        the plan job's runs reported them), ``action_statuses`` (the replay's actions in the store by final
        status, and ``status:reason`` for those that did not succeed), ``cold_starts_stored``, ``totals`` (per policy: requests, cold requests,
        replica starts, wait, GPU-seconds), ``outcomes`` (per policy and model) and ``replay_id``.
    """
    import threading
    import time as wall

    from forecaster.ingest.service import ingest_frame
    from forecaster.ingest.traces import read_trace
    from forecaster.jobs.backtesting import select_members
    from forecaster.jobs.forecasting import forecast_job, retrain_job
    from forecaster.jobs.planning import plan_job
    from forecaster.forecast.ensemble import Ensemble
    from forecaster.forecast.registry import ENSEMBLE_FILE, ChampionCache, champion, code_version, set_status
    from forecaster.store.replays import replay_action_statuses

    stop = stop or threading.Event()
    raw = read_trace(trace or sample_path(AZURE2019_TOP100))
    counts = pd.DataFrame({"unique_id": raw.raw["unique_id"].astype(str), "ds": raw.raw["ds"],
                           "y": raw.raw["y"].astype("int64")})
    start = counts["ds"].min()
    split = start + pd.Timedelta(minutes=train_minutes)
    end = counts["ds"].max() + pd.Timedelta(minutes=1)
    total_replay = int((end - split) / pd.Timedelta(minutes=1))
    replay_minutes = total_replay if replay_minutes is None else min(replay_minutes, total_replay)

    models = register_fleet(engine, counts)
    history = counts[counts["ds"] < split]
    windows = pd.DataFrame({"unique_id": sorted(counts["unique_id"].unique()), "start": start, "end": split})
    result = ingest_frame(engine, settings, history, source="demo-history", step_seconds=60, now=split,
                          windows=windows, register=False)
    echo(f"history: {result.models} models, {result.invocations:,} invocations over {train_minutes} minutes "
         f"({'already stored' if result.duplicate else f'{result.rows_written:,} rows written'})")

    clock = clock or SimClock(split.to_pydatetime())
    clock.set(split.to_pydatetime())
    cache = ChampionCache()
    held = champion(engine)
    if held is not None and not (Path(held.path) / ENSEMBLE_FILE).exists():
        # the embedded database lives in the user's data dir, the artefacts in the checkout's models/: a champion
        # trained by a checkout since moved or deleted cannot be loaded, so it is marked failed and trained again
        echo(f"the champion {held.id} has no artefacts at {held.path}; marking it failed and training again")
        set_status(engine, held.id, "failed")
        held = None
    elif held is not None and held.code_version != code_version():
        # the data dir outlives checkouts: a champion another version of the code trained would make this run
        # replay that version's forecasts, so the demo's figures would depend on which checkout ran it first
        echo(f"the champion {held.id} was trained by {held.code_version or 'an unknown version'}, not by this "
             f"checkout ({code_version()}); retiring it and training again")
        set_status(engine, held.id, "retired")
        held = None
    elif held is not None:
        echo(f"forecasting with the champion {held.id}, trained by this checkout on an earlier run")
    if held is None:
        echo("training the forecasting ensemble on the history (members: "
             f"{', '.join(members) if members else settings.forecast_members.replace(',', ', ')} + fallback) ...")
        began = wall.perf_counter()
        trained = retrain_job(engine, settings, split.to_pydatetime(), cache=cache,
                              ensemble_factory=lambda: Ensemble(
                                  members=select_members(members, 60, settings), horizon=60,
                                  weighting=settings.forecast_weighting, progress=lambda line: echo(f"  {line}")))
        echo(f"trained {trained['version']} in {wall.perf_counter() - began:.0f} s; holdout wQL "
             f"{trained['scores']['challenger']['wql']:.3f}; champion: {trained['promoted']}")

    replay = counts[(counts["ds"] >= split) & (counts["ds"] < split + pd.Timedelta(minutes=replay_minutes))]
    served = counts[(counts["ds"] >= split - pd.Timedelta(minutes=WARMUP_MIN))
                    & (counts["ds"] < split + pd.Timedelta(minutes=replay_minutes))]
    cluster = DemoCluster(engine, settings, served, models, start=split, minutes=max(replay_minutes, 1))
    latency = ScheduledLatency(engine, settings)
    if on_ready is not None:
        on_ready(clock)
    echo(f"replaying {replay_minutes} minutes from {split:%Y-%m-%d %H:%M} UTC at "
         f"{'full speed' if speed <= 0 else f'{speed:g}x'} onto a simulated cluster of {DEMO_CLUSTER.n_nodes} "
         f"nodes x {DEMO_CLUSTER.gpus_per_node} GPUs (prewarm's actuator), beside a reactive autoscaler on the "
         "same requests")
    by_minute = dict(tuple(replay.groupby("ds")))
    ids = windows["unique_id"]
    began = wall.monotonic()
    totals = {"forecast_rows": 0, "actions": 0, "cold_starts_stored": 0}
    carried_out: dict[str, int] = {}
    replayed = stored_at = 0
    figures = None
    for minute in range(replay_minutes):
        if stop.is_set():
            break
        at = split + pd.Timedelta(minutes=minute)
        now = (at + pd.Timedelta(minutes=1)).to_pydatetime()  # the minute is over: its counts arrive
        totals["cold_starts_stored"] += cluster.advance(now).get("inserted", 0)
        rows = by_minute.get(at, replay.iloc[0:0])
        ingest_frame(engine, settings, rows, source="demo-replay", step_seconds=60, now=now,
                     windows=pd.DataFrame({"unique_id": ids, "start": at, "end": at + pd.Timedelta(minutes=1)}),
                     register=False)
        clock.set(now)
        forecast = forecast_job(engine, settings, now, cache=cache)
        latency(now)
        planned = plan_job(engine, settings, now, actuator=cluster.actuator)
        cluster.policy.refresh()
        for status, n in planned.get("carried_out", {}).items():
            carried_out[status] = carried_out.get(status, 0) + n
        totals["forecast_rows"] += forecast.get("rows", 0)
        totals["actions"] += planned.get("actions", 0)
        replayed = minute + 1
        if minute % store_every_min == store_every_min - 1 or minute == replay_minutes - 1:
            figures, stored_at = cluster.store(now), replayed
        if minute % 10 == 0 or minute == replay_minutes - 1:
            p, r = (cluster.prewarm.cold.sum(), cluster.reactive.cold.sum())
            echo(f"  {now:%H:%M} sim: {int(rows['y'].sum()) if len(rows) else 0:>6,} invocations, forecast "
                 f"{forecast.get('models', 0)} models in {forecast.get('seconds', 0):.2f} s, "
                 f"{planned.get('actions', 0)} actions planned; cold-start requests so far: prewarm {int(p):,}, "
                 f"reactive {int(r):,}")
        if speed > 0:
            due = began + (minute + 1) * 60.0 / speed
            stop.wait(max(0.0, due - wall.monotonic()))
    if replayed != stored_at:  # stopped early: store what both simulators measured up to here
        figures = cluster.store(clock())
    figures = figures or cluster.comparison()
    with engine.connect() as conn:
        statuses = replay_action_statuses(conn, start=cluster.start.to_pydatetime(), end=cluster.actions_end)
    return {"replayed_minutes": replayed, **totals, "carried_out": carried_out, "action_statuses": statuses,
            "totals": figures["totals"],
            "outcomes": figures["outcomes"], "guardrail_refusals": figures["guardrail_refusals"],
            "replay_id": cluster.replay_id}
