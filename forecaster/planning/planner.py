"""The pre-warm planner: forecasts + predicted cold starts + fleet state + costs + ``now`` -> a plan.

A pure function (:func:`plan`): it reads its arguments, returns a
:class:`~forecaster.contracts.actions.Plan`, and never acts. Per model and minute
of the horizon it decides, with costs in GPU-seconds:

1. **Warm or not** (newsvendor on a binary event). Keep at least one replica
   ready in minute ``h`` when ``p_any(h) * C_cold >= (1 - p_any(h)) * C_idle``:
   ``C_idle`` = GPUs x 60 s x ``gpu_second_cost``; ``C_cold`` = the model's
   ``cold_cost`` (value of a second of wait, its SLO weight) x the wait a cold
   start causes, ``D + lambda D^2 / 2`` (first request waits ``D``, those that
   queue behind it ``D / 2`` on average), with ``D`` the predicted cold start
   from the warmest cache state the model can start from and ``lambda`` the mean
   demand in a minute with a request (the wait is linear in it).
2. **How many replicas** (newsvendor on the count). Size for the demand
   quantile at the critical level ``c_u / (c_u + c_o)``: ``c_u`` = wait cost of
   a request that finds no capacity (``cold_cost x D / 2``), ``c_o`` = idle cost
   of one request's worth of capacity (``C_idle / capacity``). A level above the
   forecast's top one is read from an exponential tail through the quantiles at
   ``settings.quantile_for_shape`` and the top level, not clamped to the top.
   A model whose requests come in bursts (a ``burst_factor`` above 1,
   :mod:`forecaster.contracts.bursts`) is sized per minute between the
   even-arrival size and the size that serves the burst's peak rate: the size
   that minimises the idle cost plus the expected wait of the queue the burst
   builds (:func:`_burst_queue_sizes`).
3. **Which cheaper tier** (when ``settings.tiers``): for the replicas the
   forecast may need beyond those warm, pre-pull the image and pre-load the
   weights to disk or host memory on the nodes where they would start, when
   the expected wait avoided exceeds the bytes moved and memory held.
4. **When**: each action starts at least its predicted latency (plus a margin)
   before the minute it serves; tier actions as early as the concurrency limits
   allow, scale actions as late as they can (a warm replica burns GPU-seconds).
5. **Limits**: the GPU budget is shared between models by expected wait
   avoided per GPU-second; concurrent pulls per node and per registry/bucket
   never exceed their limits (actions that do not fit in time are deferred to a
   later plan, and counted in the summary).

Every action carries a :class:`~forecaster.contracts.actions.Reason`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import pandas as pd

from forecaster.contracts.actions import Action, ActionKind, Plan, Reason, Tier
from forecaster.contracts.bursts import BURST_BUCKET_S, MAX_BURST_FACTOR
from forecaster.contracts.fleet import FleetState, registry_of
from forecaster.contracts.forecast import float_columns, p_any_from_quantiles, validate_forecast
from forecaster.contracts.phases import START_STATES, STATE_RANK
from forecaster.planning.coherence import coherent_quantiles
from forecaster.planning.fleet import PlannerSettings, latency_table

MINUTE = timedelta(minutes=1)
_TIER_OF_STATE = {"disk": Tier.DISK, "host": Tier.HOST}


# --------------------------------------------------------------------------- forecast arrays


@dataclass(frozen=True)
class ForecastArrays:
    """The forecast frame as arrays aligned to the fleet's models and the horizon."""

    levels: np.ndarray  # (L,)
    values: np.ndarray  # (N, H, L) quantiles of the per-minute count
    p_any: np.ndarray  # (N, H)
    known: np.ndarray  # (N,) the model has a forecast
    rescaled: int = 0  # rows whose quantiles disagreed with their p_any (:mod:`.coherence`)
    #: (N, H, L) the quantiles made coherent with ``p_any`` (:mod:`.coherence`), read for the demand given a
    #: request only; None when built another way than by :func:`forecast_arrays` (``values`` are read for it)
    coherent_values: np.ndarray | None = None

    def quantile(self, level: np.ndarray | float, tail_from: float | None = None) -> np.ndarray:
        """(N, H) quantile at ``level`` (scalar, (N,) or (N, H)), linear between levels, clamped at the ends.

        With ``tail_from`` (a level below the top one), a level above the top one is read from an exponential
        tail through the quantiles at ``tail_from`` and at the top level instead of being clamped:
        ``q_top + (q_top - q_from) * ln((1 - top) / (1 - level)) / ln((1 - from) / (1 - top))``, exact when the
        count's tail is exponential. Sizing asks for levels above q0.99 when a request's wait behind a missing
        replica is worth more than 99 minutes of the idle capacity that would serve it; the clamp then stops
        adding replicas however much more a wait is worth."""
        level = np.asarray(level, dtype="float64")
        if level.ndim == 0:
            level = np.full(self.p_any.shape, float(level))
        elif level.ndim == 1:
            level = np.repeat(level[:, None], self.p_any.shape[1], axis=1)
        if len(self.levels) == 1:
            return self.values[..., 0]
        pos = np.interp(level, self.levels, np.arange(len(self.levels)))
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, len(self.levels) - 1)
        frac = pos - lo
        v_lo = np.take_along_axis(self.values, lo[..., None], axis=2)[..., 0]
        v_hi = np.take_along_axis(self.values, hi[..., None], axis=2)[..., 0]
        out = v_lo * (1 - frac) + v_hi * frac
        top = float(self.levels[-1])
        if tail_from is None or not 0.0 < tail_from < top or not (level > top).any():
            return out
        top_value = self.values[..., -1]
        scale = (top_value - self.quantile(tail_from)) / math.log((1.0 - tail_from) / (1.0 - top))
        beyond = np.log((1.0 - top) / (1.0 - np.minimum(level, 1.0 - 1e-9)))
        return np.where(level > top, top_value + scale * beyond, out)

    def mean_above(self, level: np.ndarray) -> np.ndarray:
        """(N, H) mean of the quantile function over ``[level, 1]`` (``level`` (N, H) in [0, 1)): exact for the
        piecewise-linear function :meth:`quantile` reads, held flat beyond the first and last levels."""
        level = np.clip(np.asarray(level, dtype="float64"), 0.0, 1.0 - 1e-12)
        levels, values = self.levels, self.values
        if len(levels) == 1:
            return values[..., 0]
        first, last = values[..., 0], values[..., -1]
        # area under the quantile function from the first level up to each level
        cum = np.zeros(values.shape)
        np.cumsum(np.diff(levels) * (values[..., 1:] + values[..., :-1]) / 2.0, axis=2, out=cum[..., 1:])
        total = levels[0] * first + cum[..., -1] + (1.0 - levels[-1]) * last
        pos = np.interp(level, levels, np.arange(len(levels)))
        lo = np.minimum(np.floor(pos).astype(np.int64), len(levels) - 2)[..., None]
        frac = (pos - lo[..., 0])
        v_lo = np.take_along_axis(values, lo, axis=2)[..., 0]
        v_hi = np.take_along_axis(values, lo + 1, axis=2)[..., 0]
        at = v_lo + frac * (v_hi - v_lo)
        # area from 0 to ``level`` (below the first level the function is flat at its first value, and the
        # segment formula with frac = 0 gives exactly that; above the last it is flat at its last value)
        below = levels[0] * first + np.take_along_axis(cum, lo, axis=2)[..., 0] \
            + (level - levels[lo[..., 0]]) * (v_lo + at) / 2.0
        below = np.where(level > levels[-1], total - (1.0 - level) * last, below)
        return (total - below) / (1.0 - level)

    def coherent(self) -> "ForecastArrays":
        """The same forecast with its quantiles made coherent with ``p_any``: what a request's minute looks like."""
        if self.coherent_values is None:
            return self
        return ForecastArrays(levels=self.levels, values=self.coherent_values, p_any=self.p_any, known=self.known)

    def demand_given_any(self) -> np.ndarray:
        """(N, H) mean count in a minute with at least one request: the mean of the positive part of the
        distribution whose mass above zero is ``p_any``."""
        return self.coherent().mean_above(1.0 - np.clip(self.p_any, 1e-9, 1.0))

    def row(self, i: int) -> "ForecastArrays":
        coherent = None if self.coherent_values is None else self.coherent_values[i:i + 1]
        return ForecastArrays(levels=self.levels, values=self.values[i:i + 1], p_any=self.p_any[i:i + 1],
                              known=self.known[i:i + 1], coherent_values=coherent)

    def exceed(self, x: np.ndarray) -> np.ndarray:
        """(N, H) P(count > x) from the quantiles (piecewise linear CDF); ``x`` is (N, H)."""
        n, h, _ = self.values.shape
        out = np.empty((n, h))
        flat_v = self.values.reshape(n * h, -1)
        flat_x = np.asarray(x, dtype="float64").reshape(-1)
        lv = self.levels
        # below the lowest quantile: at most 1 - level[0]; above the highest: at most 1 - level[-1]
        below = flat_x < flat_v[:, 0]
        above = flat_x >= flat_v[:, -1]
        cdf = np.empty(n * h)
        cdf[below] = lv[0] * np.clip(flat_x[below] / np.maximum(flat_v[below, 0], 1e-12), 0, 1)
        cdf[above] = lv[-1]
        mid = ~(below | above)
        if mid.any():
            v = flat_v[mid]
            xs = flat_x[mid]
            k = (v <= xs[:, None]).sum(axis=1) - 1
            k = np.clip(k, 0, len(lv) - 2)
            v0 = v[np.arange(len(k)), k]
            v1 = v[np.arange(len(k)), k + 1]
            frac = np.where(v1 > v0, (xs - v0) / np.where(v1 > v0, v1 - v0, 1), 1.0)
            cdf[mid] = lv[k] + frac * (lv[k + 1] - lv[k])
        out.reshape(-1)[:] = 1.0 - cdf
        return out


def forecast_arrays(forecast: pd.DataFrame, model_ids: pd.Index, now: datetime, horizon: int) -> ForecastArrays:
    """Pivot the long forecast to (N, H, L) arrays; minutes outside ``[now, now + H)`` are ignored."""
    columns = validate_forecast(forecast)
    levels = np.array([lv for lv, _ in columns])
    n = len(model_ids)
    values = np.zeros((n, horizon, len(levels)))
    p_any = np.zeros((n, horizon))
    known = np.zeros(n, dtype=bool)
    if len(forecast):
        ds = pd.to_datetime(forecast["ds"], utc=True)
        h = ((ds - pd.Timestamp(now)) // pd.Timedelta(minutes=1)).to_numpy(dtype="int64")
        row = model_ids.get_indexer(forecast["unique_id"].astype(str))
        ok = (row >= 0) & (h >= 0) & (h < horizon)
        row, h = row[ok], h[ok]
        vals = np.maximum.accumulate(float_columns(forecast, [c for _, c in columns])[ok], axis=1)
        values[row, h] = np.maximum(vals, 0.0)
        if "p_any" in forecast.columns:
            p_any[row, h] = forecast["p_any"].to_numpy(dtype="float64")[ok]
        else:
            p_any[row, h] = p_any_from_quantiles(levels, vals)
        known[row] = True
    # the demand given a request is read from the distribution whose mass above zero is p_any: rows that say
    # otherwise (the ensemble's residual quantiles beside its stacked p_any) are rescaled to it for that reading
    # only; sizing, pre-loads and the GPU budget ask coverage questions, which the quantiles as forecast answer
    # (:mod:`.coherence`)
    coherent, rescaled = coherent_quantiles(levels, values, p_any)
    return ForecastArrays(levels=levels, values=values, p_any=p_any, known=known, rescaled=rescaled,
                          coherent_values=coherent)


# --------------------------------------------------------------------------- concurrency


class ConcurrencyLedger:
    """Planned and running transfers per resource (a node, a registry), as time intervals in seconds."""

    def __init__(self, limits: dict[str, int]):
        self.limits = limits  # resource kind prefix ("node", "registry") -> limit
        self.intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self._arrays: dict[str, tuple[np.ndarray, ...]] = {}

    def _limit(self, resource: str) -> int:
        return self.limits[resource.split(":", 1)[0]]

    def add(self, resources: list[str], start: float, end: float) -> None:
        for r in resources:
            self.intervals[r].append((start, end))
            self._arrays.pop(r, None)

    def _peak(self, resource: str, starts: np.ndarray, duration: float) -> np.ndarray:
        """Most intervals of ``resource`` running at once inside ``[c, c + duration)``, per candidate ``c``."""
        if not self.intervals[resource]:
            return np.zeros(len(starts), dtype=np.int64)
        if resource not in self._arrays:
            arr = np.array(self.intervals[resource], dtype="float64")
            s_sorted, e_sorted = np.sort(arr[:, 0]), np.sort(arr[:, 1])
            cover_at_starts = (np.searchsorted(s_sorted, arr[:, 0], side="right")
                               - np.searchsorted(e_sorted, arr[:, 0], side="right"))
            self._arrays[resource] = (arr[:, 0], s_sorted, e_sorted, cover_at_starts)
        s_arr, s_sorted, e_sorted, cover_at_starts = self._arrays[resource]
        at_start = np.searchsorted(s_sorted, starts, side="right") - np.searchsorted(e_sorted, starts, side="right")
        inside = (s_arr[None, :] > starts[:, None]) & (s_arr[None, :] < starts[:, None] + duration)
        later = np.where(inside, cover_at_starts[None, :], 0).max(axis=1)
        return np.maximum(at_start, later)

    def place(self, resources: list[str], duration: float, earliest: float, latest: float,
              prefer_late: bool) -> float | None:
        """A start in ``[earliest, latest]`` where every resource stays under its limit, or None.

        Candidates are both ends of the window and the edges of the intervals
        already booked (a slot opens when one ends; a late slot ends where one
        begins); the first that fits, in the preferred order, wins.
        """
        if latest < earliest:
            return None
        candidates = [earliest, latest]
        for r in resources:
            for s, e in self.intervals[r]:
                candidates.extend((e, s - duration))
        starts = np.unique(np.array(candidates))
        starts = starts[(starts >= earliest) & (starts <= latest)]
        if prefer_late:
            starts = starts[::-1]
        fits = np.ones(len(starts), dtype=bool)
        for r in resources:
            fits &= self._peak(r, starts, duration) < self._limit(r)
        if not fits.any():
            return None
        start = float(starts[np.argmax(fits)])
        self.add(resources, start, start + duration)
        return start


# --------------------------------------------------------------------------- the plan


def _wait_seconds(d: np.ndarray, rate_per_s: np.ndarray, queued: bool) -> np.ndarray:
    """Total request-seconds of wait caused by one cold start of ``d`` seconds."""
    d = np.nan_to_num(np.asarray(d, dtype="float64"), nan=0.0)
    return d + (rate_per_s * d * d / 2.0 if queued else 0.0)


@dataclass
class CacheIndex:
    """Weights cache entries as arrays: model row, node position and state rank, grouped by model row."""

    node_ids: np.ndarray  # (K,) node ids of the fleet, in ``fleet.nodes`` order
    model_row: np.ndarray  # (C,) per cache entry
    node_pos: np.ndarray  # (C,)
    rank: np.ndarray  # (C,)
    by_model: dict  # model row -> entry indices
    image_nodes: dict  # image ref -> (K,) bool: node holds the image

    def warmth(self, i: int) -> np.ndarray:
        """(K,) state rank of model ``i`` on each node (0 none .. 3 host; images not included)."""
        out = np.zeros(len(self.node_ids), dtype=np.int64)
        idx = self.by_model.get(i)
        if idx is not None and len(idx):
            np.maximum.at(out, self.node_pos[idx], self.rank[idx])
        return out


def _group_indices(keys: np.ndarray) -> dict:
    """``pd.Series(...).groupby(keys).indices`` without pandas' groupby machinery (every replayed minute calls it):
    sorted keys (missing ones left out) -> ascending positions."""
    codes, uniques = pd.factorize(keys, sort=True)
    if not len(uniques):
        return {}
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes[codes >= 0], minlength=len(uniques))
    bounds = np.concatenate([[0], np.cumsum(counts)]) + int((codes < 0).sum())
    return {uniques[u]: order[bounds[u]:bounds[u + 1]] for u in range(len(uniques)) if counts[u]}


def _best_states(fleet: FleetState, gpus: np.ndarray) -> tuple[np.ndarray, CacheIndex]:
    """Per model, the warmest start state on a node with room for a replica; and the cache as arrays.

    A node holding the model's image counts as state ``image``; weights on disk
    or in host memory as ``disk`` / ``host``.
    """
    models = fleet.models
    best = np.zeros(len(models), dtype=np.int64)
    free = fleet.nodes["gpus_free"].to_numpy(dtype="float64")
    node_ids = fleet.nodes.index.astype(str).to_numpy()
    node_index = pd.Index(node_ids)
    image_refs = models["image_ref"].astype(str).to_numpy()
    image_nodes: dict[str, np.ndarray] = {}
    if len(fleet.images):
        pos = node_index.get_indexer(fleet.images["node_id"].astype(str))
        for ref, rows in _group_indices(fleet.images["image_ref"].astype(str).to_numpy()).items():
            mask = np.zeros(len(node_ids), dtype=bool)
            valid = pos[rows][pos[rows] >= 0]
            mask[valid] = True
            image_nodes[ref] = mask
            node_free = free[valid] if len(valid) else np.zeros(0)
            model_rows = np.flatnonzero(image_refs == ref)
            if len(model_rows) and len(node_free):
                fits = node_free.max() >= gpus[model_rows]
                best[model_rows[fits]] = np.maximum(best[model_rows[fits]], STATE_RANK["image"])
    model_row = np.zeros(0, dtype=np.int64)
    node_pos = np.zeros(0, dtype=np.int64)
    rank = np.zeros(0, dtype=np.int64)
    if len(fleet.cache):
        states = fleet.cache["state"].to_numpy()
        rank = np.array([STATE_RANK.get(v, -1) if isinstance(v, str) else -1 for v in states], dtype=np.int64)
        start_state = rank >= 0  # isin(START_STATES)
        rank = rank[start_state]
        model_row = models.index.get_indexer(fleet.cache["model_id"].astype(str).to_numpy()[start_state])
        node_pos = node_index.get_indexer(fleet.cache["node_id"].astype(str).to_numpy()[start_state])
        node_free = np.where(node_pos >= 0, free[np.maximum(node_pos, 0)], -1.0)
        ok = (model_row >= 0) & (node_pos >= 0) & (node_free >= gpus[np.maximum(model_row, 0)])
        np.maximum.at(best, model_row[ok], rank[ok])
        keep = (model_row >= 0) & (node_pos >= 0)
        model_row, node_pos, rank = model_row[keep], node_pos[keep], rank[keep]
        # a node with the model's weights holds its image too
        for ref in np.unique(image_refs[model_row]) if len(model_row) else ():
            mask = image_nodes.setdefault(ref, np.zeros(len(node_ids), dtype=bool))
            mask[node_pos[image_refs[model_row] == ref]] = True
    by_model = _group_indices(model_row) if len(model_row) else {}
    return best, CacheIndex(node_ids=node_ids, model_row=model_row, node_pos=node_pos, rank=rank,
                            by_model=by_model, image_nodes=image_nodes)


def plan(
    forecast: pd.DataFrame,
    latency: pd.DataFrame,
    fleet: FleetState,
    settings: PlannerSettings,
    now: datetime,
    *,
    spend_curve_multipliers: np.ndarray | None = None,
    spend_curve_busy: str = "requests",
) -> Plan:
    """Plan pre-warm actions for the next ``settings.horizon_min`` minutes.

    Args:
        forecast: per-minute quantile forecasts (see :mod:`forecaster.planning.forecasts`).
        latency: predicted cold-start seconds per model and start state, optionally per node (a ``node_id``
            column, or a :class:`~forecaster.contracts.latency.NodeLatencyTable` of arrays; see
            :func:`forecaster.planning.fleet.node_latency`).
        fleet: the fleet as it stands at ``now``.
        settings: costs and guardrails.
        now: planning time (UTC); forecast horizon 1 is the minute starting at ``now``.
        spend_curve_multipliers: budget mode (:mod:`forecaster.planning.budget`): multipliers of every cold cost
            at which to also predict the idle GPU-seconds of the next minute (the replicas the plan's rules
            would hold there, :func:`_held_next_minute`, less the expected use, :func:`_expected_idle_gpu_s`);
            the plan's summary then carries them as ``spend_curve_gpu_s``.
        spend_curve_busy: how the driver counts busy replicas (``"requests"`` or ``"replicas"``, see
            :func:`forecaster.planning.budget.idle_gpu_seconds`).

    Returns:
        The plan; ``summary`` counts actions per kind and reason, late actions
        (demand closer than the lead time), actions deferred by the concurrency
        limits, and replicas denied by the GPU budget.
    """
    h_count = settings.horizon_min
    models = fleet.models
    ids = models.index.astype(str)
    n = len(ids)
    gpus = models["gpus"].to_numpy(dtype="float64")
    burst = models["burst_factor"].to_numpy(dtype="float64") if "burst_factor" in models.columns else np.ones(n)
    burst = np.maximum(np.nan_to_num(burst, nan=1.0), 1.0)
    bursty = burst > 1.0 + 1e-6
    # requests per minute a replica can take when they come at the minute's mean rate, and at the burst's peak rate
    cap_even = np.maximum(models["replica_rpm"].to_numpy(dtype="float64") * settings.replica_utilisation, 1e-9)
    cap = np.maximum(cap_even / burst, 1e-9)
    cold_cost = models["cold_cost"].to_numpy(dtype="float64")
    slo = models["slo_s"].to_numpy(dtype="float64")
    current = models["replicas"].to_numpy(dtype="float64").astype(np.int64)
    fa = forecast_arrays(forecast, pd.Index(ids), now, h_count)
    lat = latency_table(latency, pd.Index(ids), fleet)  # per-node arrays reduced to the nodes each start would use
    starts = np.array([(now + k * MINUTE) for k in range(h_count)], dtype=object)
    start_s = np.arange(h_count) * 60.0  # minute starts, seconds after now

    c_idle = gpus * 60.0 * settings.gpu_second_cost  # one replica-minute
    # demand given any request: the mean of the positive part of the distribution. A cold start's queued wait is
    # linear in the requests that arrive during it, so its expected cost takes their mean; the median read one
    # request a minute for a bursty model whose minutes with a request average many more
    q_given_any = fa.demand_given_any()
    rate = np.maximum(q_given_any, 1.0) / 60.0

    best_state, cache_index = _best_states(fleet, gpus)
    d_by_state = np.stack([np.nan_to_num(lat[s], nan=0.0) for s in START_STATES], axis=1)  # (N, 4)

    def scale_levels(state_idx: np.ndarray, multiplier: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Desired ready replicas (N, H) when a new replica starts from ``state_idx``; benefits per unit.

        ``multiplier`` scales every cold cost (budget mode's spend curve asks what other factors would hold)."""
        d = d_by_state[np.arange(n), state_idx]
        cost = cold_cost * multiplier
        c_cold = np.broadcast_to(cost[:, None] * _wait_seconds(d[:, None], rate, settings.count_queued_wait),
                                 (n, h_count)).copy()
        warm = fa.p_any * c_cold >= (1.0 - fa.p_any) * c_idle[:, None]
        c_u = _queued_wait_cost(cost, d)
        c_o = c_idle / cap
        level = c_u / (c_u + c_o)
        size = np.ceil(np.maximum(fa.quantile(level, tail_from=settings.quantile_for_shape), 0.0) / cap[:, None]
                       - 1e-9)
        if bursty.any():
            # a bursty model's minute is sized for the queue its burst builds, not for the burst's peak rate
            # (the even-arrival size of the bursty models only: most of a fleet never comes here)
            b_fa = ForecastArrays(levels=fa.levels, values=fa.values[bursty], p_any=fa.p_any[bursty],
                                  known=fa.known[bursty])
            b_cu, b_cap = c_u[bursty], cap_even[bursty]
            level_even = b_cu / (b_cu + c_idle[bursty] / b_cap)
            size_even = np.ceil(np.maximum(b_fa.quantile(level_even, tail_from=settings.quantile_for_shape), 0.0)
                                / b_cap[:, None] - 1e-9)
            size[bursty] = _burst_queue_sizes(fa, bursty, size_even, size[bursty], burst[bursty], b_cap / 60.0,
                                              cost[bursty], d[bursty], c_idle[bursty])
        desired = np.where(warm & fa.known[:, None], np.maximum(size, 1.0), 0.0).astype(np.int64)
        return desired, c_cold, d

    desired, c_cold, d_now = scale_levels(best_state)

    # ---------------------------------------------------------------- tiers
    ledger = ConcurrencyLedger({"node": settings.max_transfers_per_node,
                                "registry": settings.max_transfers_per_registry})
    for t in fleet.transfers.itertuples(index=False) if len(fleet.transfers) else ():
        end = (pd.Timestamp(t.ends_at) - pd.Timestamp(now)).total_seconds()
        if end > 0:
            ledger.add([f"node:{t.node_id}", f"registry:{t.registry}"], 0.0, end)
    actions: list[Action] = []
    deferred = 0
    late = 0
    tier_state = best_state.copy()
    tier_ready_s = np.zeros(n)
    if settings.tiers:
        tier_actions, tier_state, tier_ready_s, tier_deferred = _plan_tiers(
            fa, fleet, settings, now, desired, cap, gpus, cold_cost, rate, d_by_state, lat, best_state,
            cache_index, ledger)
        actions.extend(tier_actions)
        deferred += tier_deferred
        improved = tier_state > best_state
        if improved.any():
            desired_t, c_cold_t, d_t = scale_levels(tier_state)
            # a tier only helps minutes it is ready for
            ready = start_s[None, :] >= tier_ready_s[:, None]
            use = improved[:, None] & ready
            desired = np.where(use, desired_t, desired)
            c_cold = np.where(use, c_cold_t, c_cold)
    start_state = np.where(tier_state > best_state, tier_state, best_state)
    d_start = d_by_state[np.arange(n), start_state]
    lead = np.asarray(settings.lead(d_start), dtype="float64")

    # ---------------------------------------------------------------- GPU budget
    target = desired.max(axis=1)
    budget = settings.gpu_budget
    if budget is None:
        held = float((current * gpus).sum())
        free = float(fleet.nodes["gpus_free"].to_numpy(dtype="float64").sum())
        budget = held + free - settings.gpu_headroom * (held + free)
    c_u_start = _queued_wait_cost(cold_cost, d_start)
    granted = _share_budget(fa, target, cap, c_cold, c_u_start, c_idle, gpus, budget)
    budget_denied = int((target - granted).clip(min=0).sum())
    desired = np.minimum(desired, granted[:, None])

    # ---------------------------------------------------------------- scale and release
    # keep a replica through a lull when idling until the demand returns costs less than restarting it:
    # look ahead at least the lead time, and as many minutes as one restart's wait cost buys of idling
    lead_minutes = _keep_minutes(lead, c_cold.max(axis=1) / np.maximum(c_idle, 1e-12), h_count,
                                 settings.release_hold_min)
    registry_img = np.array([registry_of(r) for r in models["image_ref"].to_numpy()], dtype=object)
    pull_s = np.nan_to_num(lat.get("none:image_pull_s", np.zeros(n)), nan=0.0)
    id_values = ids.to_numpy()  # (an Index lookup per action costs more than the action)
    # a model without a usable forecast (none, expired, or dropped by the plan step for bad values) is held at
    # its current level: its zero desired level says nothing about its demand, so neither scale nor release it
    held_no_forecast = int(((current > 0) & ~fa.known).sum())
    for i in np.flatnonzero(((desired.max(axis=1) > 0) | (current > 0)) & fa.known):
        model_id = id_values[i]
        window = desired[i, :max(1, min(h_count, int(lead_minutes[i]) + 1))]
        keep = int(window.max()) if len(window) else 0
        level = int(current[i])
        if keep < level:
            reason = Reason.BUDGET_PREEMPT if granted[i] < target[i] and granted[i] < level else Reason.IDLE_RELEASE
            actions.append(Action(kind=ActionKind.RELEASE, model_id=model_id, reason=reason, not_before=now,
                                  deadline=now + MINUTE, replicas=level - keep,
                                  expected_cost=-float((level - keep) * c_idle[i] * h_count)))
            level = keep
        for h in range(h_count):
            want = int(desired[i, h])
            if want <= level:
                continue
            serves_at = start_s[h]
            wanted_start = serves_at - float(lead[i])
            reason = Reason.FORECAST_DEMAND if level == 0 else Reason.FORECAST_SPIKE
            if not math.isnan(slo[i]) and d_start[i] > slo[i]:
                reason = Reason.SLO_COVER
            start = max(0.0, wanted_start)
            if start_state[i] == 0 and pull_s[i] > 0:
                # a start from nothing pulls the image: book the registry, latest slot first
                booked = ledger.place([f"registry:{registry_img[i]}"], float(pull_s[i]), 0.0, max(0.0, wanted_start),
                                      prefer_late=True)
                if booked is None:
                    deferred += 1
                    break
                start = booked
            if wanted_start < 0:
                late += 1
            units = want - level
            benefit = float(units * c_cold[i, h] * fa.p_any[i, h])
            cost = float(units * gpus[i] * ((h_count - h) * 60.0 + (serves_at - start)) * settings.gpu_second_cost)
            actions.append(Action(kind=ActionKind.SCALE, model_id=model_id, reason=reason,
                                  not_before=now + timedelta(seconds=start),
                                  deadline=starts[h] + MINUTE, replicas=want,
                                  expected_benefit_s=benefit, expected_cost=cost))
            level = want

    actions.sort(key=lambda a: (a.not_before, a.kind != ActionKind.RELEASE, a.model_id))
    summary = {
        "actions": len(actions),
        "by_kind": {k.value: sum(a.kind is k for a in actions) for k in ActionKind},
        "by_reason": {r.value: sum(a.reason is r for a in actions) for r in Reason if any(a.reason is r
                                                                                         for a in actions)},
        "late": late,
        "deferred": deferred,
        "budget_gpus": budget,
        "budget_denied_replicas": budget_denied,
        "warm_gpus_planned": float((np.maximum(desired.max(axis=1), 0) * gpus).sum()),
        "models_forecast": int(fa.known.sum()),
        "no_forecast": int((~fa.known).sum()),  # models planned without a usable forecast: no scale or release
        "held_no_forecast": held_no_forecast,  # of those, models holding replicas, held at their current level
        "forecast_rows_rescaled": fa.rescaled,
    }
    if spend_curve_multipliers is not None:
        need = _need_given_any(fa, cap, spend_curve_busy)
        summary["spend_curve_gpu_s"] = [
            _expected_idle_gpu_s(fa, _held_next_minute(
                np.where(fa.known[:, None], scale_levels(best_state, float(m))[0], current[:, None]), current, lead,
                _keep_minutes(lead, m * c_cold.max(axis=1) / np.maximum(c_idle, 1e-12), h_count,
                              settings.release_hold_min)), need, gpus)
            for m in np.asarray(spend_curve_multipliers, dtype="float64")]
    return Plan(planned_at=now, actions=tuple(actions), summary=summary)


#: Quantile levels sampled per model, evenly over the mass above zero, for a bursty model's expected queue.
_BURST_SAMPLES = 16


def _burst_queue_wait(replicas: np.ndarray, n: np.ndarray, burst: np.ndarray, rps: np.ndarray, d: np.ndarray
                      ) -> np.ndarray:
    """Request-seconds of wait in a minute of ``n`` requests whose busiest 10 seconds come at ``burst`` times the
    minute's mean rate (:mod:`forecaster.contracts.bursts`) and the other 50 at the rate that leaves, served by
    ``replicas`` of ``rps`` requests a second each.

    A fluid queue: it grows through the burst, then drains at the spare rate. Requests still queued at the
    minute's end wait for a new replica as well, ``d / 2`` seconds each (the planner's price of a request beyond
    capacity). Convex and decreasing in ``replicas``, so :func:`_burst_queue_sizes` can bisect."""
    rest_s = 60.0 - BURST_BUCKET_S
    mu = replicas * rps
    peak_rate = n * burst / 60.0
    rest_rate = n * np.maximum(1.0 - burst / MAX_BURST_FACTOR, 0.0) / rest_s
    queued = np.maximum(BURST_BUCKET_S * (peak_rate - mu), 0.0)  # at the burst's end
    net = rest_rate - mu
    drain_s = np.where(net < 0, queued / np.maximum(-net, 1e-12), np.inf)
    drains = drain_s <= rest_s
    left = np.where(drains, 0.0, np.maximum(queued + rest_s * net, 0.0))
    after = np.where(drains, queued * np.minimum(drain_s, rest_s) / 2.0, rest_s * (queued + left) / 2.0)
    return queued * BURST_BUCKET_S / 2.0 + after + left * d / 2.0


def _burst_queue_sizes(fa: ForecastArrays, rows: np.ndarray, size_even: np.ndarray, size_peak: np.ndarray,
                       burst: np.ndarray, rps: np.ndarray, cost: np.ndarray, d: np.ndarray, c_idle: np.ndarray
                       ) -> np.ndarray:
    """(B, H) replicas of the bursty models ``rows`` that minimise a minute's idle cost plus the expected wait
    of its burst's queue (:func:`_burst_queue_wait`), between the even-arrival and the peak-rate sizes.

    Sizing every busy minute for its burst's peak holds capacity that a queue of a few seconds would have made
    unnecessary (``docs/results.md``, "Sizing for a burst's queue"). The minute's count is read at
    :data:`_BURST_SAMPLES` quantiles evenly spread over the mass above zero; the best size is bisected on the convex
    cost."""
    given = fa.coherent()
    p_any = fa.p_any[rows]
    sub = ForecastArrays(levels=fa.levels, values=given.values[rows], p_any=p_any, known=fa.known[rows])
    shape = p_any.shape
    counts = np.stack([sub.quantile(1.0 - p_any * (j + 0.5) / _BURST_SAMPLES) for j in range(_BURST_SAMPLES)],
                      axis=2).reshape(-1, _BURST_SAMPLES)  # (B x H, S)
    per_minute = [np.broadcast_to(np.asarray(v, dtype="float64")[:, None], shape).ravel()
                  for v in (burst, rps, d, c_idle, cost)]
    weight = p_any.ravel()

    def total(at: np.ndarray, replicas: np.ndarray) -> np.ndarray:
        b, r, dd, idle, c = (v[at] for v in per_minute)
        wait = _burst_queue_wait(replicas[:, None], counts[at], b[:, None], r[:, None], dd[:, None]).mean(axis=1)
        return replicas * idle + c * weight[at] * wait

    lo = np.minimum(size_even, size_peak).astype("float64").ravel()
    hi = np.asarray(size_peak, dtype="float64").ravel().copy()
    active = np.flatnonzero(lo < hi)
    while len(active):  # the smallest size whose next replica saves less than it costs
        mid = np.floor((lo[active] + hi[active]) / 2.0)
        gains = total(active, mid) - total(active, mid + 1.0) > 1e-9
        lo[active] = np.where(gains, mid + 1.0, lo[active])
        hi[active] = np.where(gains, hi[active], mid)
        active = active[lo[active] < hi[active]]
    return lo.reshape(shape)


def _keep_minutes(lead_s: np.ndarray, bridge_ratio: np.ndarray, h_count: int, release_hold_min: int) -> np.ndarray:
    """(N,) last horizon minute whose desired replicas keep a running one up: at least the lead time, and as many
    minutes as one restart's wait cost buys of idling (``bridge_ratio`` = C_cold / C_idle), plus the hold."""
    bridge = np.minimum(np.floor(bridge_ratio), h_count - 1)
    return np.maximum(np.ceil(lead_s / 60.0), bridge).astype(np.int64) + release_hold_min


def _held_next_minute(desired: np.ndarray, current: np.ndarray, lead_s: np.ndarray, keep_minutes: np.ndarray
                      ) -> np.ndarray:
    """(N,) replicas the plan's scale and release rules leave up in the minute after ``now``, for ``desired``.

    The rules of :func:`plan`, read for one minute: a replica wanted within the lead time is started in it, and
    a running one is kept while the keep window (:func:`_keep_minutes`) still wants it. Tiers, the GPU budget
    and the concurrency limits are left out: this is a prediction for budget mode's spend curve, not the plan.
    """
    cols = np.arange(desired.shape[1])[None, :]
    starting = np.where(cols <= np.ceil(lead_s / 60.0)[:, None], desired, 0).max(axis=1)
    keep = np.where(cols <= keep_minutes[:, None], desired, 0).max(axis=1)
    return np.maximum(starting, np.minimum(current, keep)).astype("float64")


#: Quantile levels sampled per model, evenly over the mass above zero, for the expected replicas a minute uses.
_NEED_SAMPLES = 16


def _need_given_any(fa: ForecastArrays, cap: np.ndarray, busy: str) -> np.ndarray:
    """(N, S) replicas the first forecast minute's requests use, at :data:`_NEED_SAMPLES` quantiles evenly spread
    over the mass above zero (levels ``1 - p_any (j + 1/2) / S``), counted as the driver counts them (``busy``,
    see :func:`forecaster.planning.budget.idle_gpu_seconds`: whole replicas, at least one with any request; or
    the share of a replica's capacity)."""
    given_any = fa.coherent()
    first = ForecastArrays(levels=fa.levels, values=given_any.values[:, :1], p_any=fa.p_any[:, :1], known=fa.known)
    samples = np.concatenate([first.quantile(1.0 - first.p_any * (j + 0.5) / _NEED_SAMPLES)
                              for j in range(_NEED_SAMPLES)], axis=1)
    per_replica = np.maximum(samples, 0.0) / cap[:, None]
    if busy == "replicas":
        return np.maximum(1.0, np.ceil(per_replica - 1e-9))
    if busy == "requests":
        return per_replica
    raise ValueError(f"busy must be 'replicas' or 'requests', got {busy!r}")


def _expected_idle_gpu_s(fa: ForecastArrays, held: np.ndarray, need_given_any: np.ndarray, gpus: np.ndarray
                         ) -> float:
    """Expected idle GPU-seconds of ``held`` replicas in the first forecast minute: E[(held - need)+] x GPUs x 60,
    with ``E[min(need, held)] = p_any x mean(min(need | any, held))`` (:func:`_need_given_any`)."""
    used = fa.p_any[:, 0] * np.minimum(need_given_any, held[:, None]).mean(axis=1)
    idle = np.where(fa.known, np.maximum(held - used, 0.0), held)
    return float((idle * gpus).sum() * 60.0)


def _queued_wait_cost(cold_cost: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``c_u``: the wait cost of one request that finds no capacity while a replica starts in ``d`` seconds (it
    waits ``d / 2`` on average), what the sizing and the budget's share both weigh a replica's capacity by."""
    return cold_cost * np.maximum(d, 1e-9) / 2.0


def _share_budget(fa: ForecastArrays, target: np.ndarray, cap: np.ndarray, c_cold: np.ndarray,
                  c_u: np.ndarray, c_idle: np.ndarray, gpus: np.ndarray, budget: float) -> np.ndarray:
    """Replicas granted per model: units (model, k-th replica) by expected wait avoided per GPU-second.

    A model's first replica avoids its cold start (``p_any x C_cold``); each further one serves the requests
    beyond the capacity of those before it, at most a replica's capacity of them, each of which would otherwise
    wait (``P(demand > (k - 1) capacity) x capacity x c_u``, the sizing's own marginal value). Valued at the
    whole cold start like the first, every replica of a busy model outranked the first replica of every quieter
    one, and a plan under a binding budget released the rest of the fleet for it. No model is offered more
    replicas than the budget holds (a runaway forecast would otherwise allocate a row per wanted replica).
    """
    if float((target * gpus).sum()) <= budget + 1e-9:
        return target.copy()
    target = np.minimum(target, np.floor(max(budget, 0.0) / np.maximum(gpus, 1e-9) + 1e-9)).astype(np.int64)
    rows = np.repeat(np.arange(len(target)), target)
    k = np.concatenate([np.arange(1, t + 1) for t in target]) if len(rows) else np.zeros(0, dtype=np.int64)
    if not len(rows):
        return target.copy()
    # P(the k-th replica is needed) at its most likely minute
    x = ((k - 1) * cap[rows])[:, None] * np.ones((1, fa.p_any.shape[1]))
    sub = ForecastArrays(levels=fa.levels, values=fa.values[rows], p_any=fa.p_any[rows], known=fa.known[rows])
    avoided = np.where(k[:, None] == 1, fa.p_any[rows] * c_cold[rows],
                       sub.exceed(x) * (cap[rows] * c_u[rows])[:, None])
    value = avoided.max(axis=1) / np.maximum(c_idle[rows], 1e-12)
    order = np.lexsort((k, -value))
    spent = np.cumsum(gpus[rows][order])
    take = order[spent <= budget + 1e-9]
    granted = np.zeros_like(target)
    np.add.at(granted, rows[take], 1)
    return granted


def _plan_tiers(fa, fleet, settings, now, desired, cap, gpus, cold_cost, rate, d_by_state, lat, best_state,
                cache_index, ledger) -> tuple[list[Action], np.ndarray, np.ndarray, int]:
    """Prepull/preload actions for replicas the forecast may need beyond the warm ones.

    Returns the actions, each model's warmest state after them, the seconds
    after ``now`` when that state is ready, and how many were deferred.
    """
    models = fleet.models
    ids = models.index.astype(str)
    n, h_count = fa.p_any.shape
    horizon_s = h_count * 60.0
    # P(a replica beyond the planned warm ones is needed) per node rank j = 1.. (the j-th extra replica)
    warm = desired.astype("float64")
    p_first = np.where(warm == 0, fa.p_any, fa.exceed(warm * cap[:, None]))
    p_new = p_first.max(axis=1)
    top = fa.quantile(float(fa.levels[-1]))
    current = models["replicas"].to_numpy(dtype="float64")
    # replicas this plan will start (their start gets shorter), then the ones the top quantile may still need
    scale_ups = np.maximum(warm.max(axis=1) - current, 0.0).astype(np.int64)
    overflow = np.ceil(np.maximum(top / cap[:, None] - warm, 0.0) - 1e-9).max(axis=1)
    overflow = np.maximum(overflow, (p_new > 0).astype("float64"))
    extra = np.clip(scale_ups + overflow, 0, settings.max_tier_nodes).astype(np.int64)
    rate_max = rate.max(axis=1)
    queued = settings.count_queued_wait
    wait = lambda d: _wait_seconds(d, rate_max, queued)  # noqa: E731
    image_bytes = models["image_bytes"].to_numpy(dtype="float64")
    weights_bytes = models["weights_bytes"].to_numpy(dtype="float64")

    nodes = fleet.nodes
    free_gpus = nodes["gpus_free"].to_numpy(dtype="float64")
    host_free = nodes["host_free_bytes"].to_numpy(dtype="float64").copy()
    disk_free = nodes["disk_free_bytes"].to_numpy(dtype="float64").copy()
    node_ids = cache_index.node_ids
    image_refs = models["image_ref"].astype(str).to_numpy()
    weights_uris = models["weights_uri"].to_numpy()
    image_nodes = {ref: mask.copy() for ref, mask in cache_index.image_nodes.items()}
    node_index = pd.Index(node_ids)
    model_index = pd.Index(ids)
    in_flight: set[tuple[int, int]] = set()
    if len(fleet.transfers):
        t_node = node_index.get_indexer(fleet.transfers["node_id"].astype(str))
        t_model = model_index.get_indexer(fleet.transfers["model_id"].astype(str))
        for node_k, row, kind in zip(t_node, t_model, fleet.transfers["kind"].to_numpy()):
            if node_k < 0 or row < 0:
                continue
            in_flight.add((int(row), int(node_k)))
            if kind == "prepull":
                image_nodes.setdefault(image_refs[row], np.zeros(len(node_ids), dtype=bool))[node_k] = True

    tier_state = best_state.copy()
    ready_s = np.zeros(n)
    actions: list[Action] = []
    deferred = 0
    node_load = np.zeros(len(node_ids))  # tiers planned per node in this plan: spread them
    # an upper bound of each model's gain, to try the most valuable first and skip the hopeless
    host_nodes = np.bincount(cache_index.model_row[cache_index.rank >= 3], minlength=n)
    d_gap = np.maximum(d_by_state[:, 0] - d_by_state[:, 3], 0.0)
    upper = np.maximum(p_new * cold_cost * wait(d_by_state[:, 0]) - p_new * cold_cost * wait(d_by_state[:, 3]),
                       np.where(scale_ups > 0, gpus * settings.gpu_second_cost * d_gap, 0.0))
    floor_cost = np.minimum(weights_bytes, image_bytes) * settings.byte_cost
    wanted = (extra > host_nodes) & (p_new > 0) & fa.known & (upper > floor_cost)
    value_order = [i for i in np.argsort(-upper, kind="stable") if wanted[i]]
    for i in value_order:
        if len(actions) >= settings.max_tier_actions:
            deferred += 1
            continue
        model_id = ids[i]
        image_ref = image_refs[i]
        weights_uri = weights_uris[i]
        first_need = int(np.argmax(p_first[i] > 0))
        deadline_s = first_need * 60.0
        # candidate nodes: room for a replica, the model's own warm nodes first, then images, then emptiest
        room = np.flatnonzero(free_gpus >= gpus[i])
        if not len(room):
            continue
        image_mask = image_nodes.setdefault(image_ref, np.zeros(len(node_ids), dtype=bool))
        state_on = np.maximum(cache_index.warmth(i), image_mask.astype(np.int64))
        order = room[np.lexsort((-free_gpus[room], node_load[room], -state_on[room]))]
        chosen = 0
        for k in order:
            if chosen >= extra[i]:
                break
            node_id = str(node_ids[k])
            if (int(i), int(k)) in in_flight:
                chosen += 1
                continue
            state_now = int(max(state_on[k], 1 if image_mask[k] else 0))
            # a replica the plan starts anyway saves its start-up GPU-seconds; one beyond the warm ones saves
            # the wait of the requests it serves, if it is needed (P of the j-th extra replica)
            planned_start = chosen < scale_ups[i]
            beyond = chosen - scale_ups[i]
            p_j = 1.0 if planned_start else (p_new[i] if beyond == 0 else float(
                fa.row(i).exceed(np.full((1, h_count), (warm[i, :].max() + beyond) * cap[i])).max()))
            best_net, best_target = 0.0, state_now
            for target_state in (1, 2, 3):
                if target_state <= state_now:
                    continue
                moved = (image_bytes[i] if state_now < 1 else 0.0) + (weights_bytes[i] if state_now < 2 else 0.0)
                held = weights_bytes[i] if target_state == 3 else 0.0
                if held > host_free[k] or moved - (image_bytes[i] if state_now < 1 else 0.0) > disk_free[k] + held:
                    continue
                if planned_start:
                    gain = gpus[i] * settings.gpu_second_cost * (d_by_state[i, state_now] - d_by_state[i, target_state])
                else:
                    rate_i = rate_max[i]
                    gain = p_j * cold_cost[i] * (_wait_seconds(d_by_state[i, state_now], rate_i, queued)
                                                 - _wait_seconds(d_by_state[i, target_state], rate_i, queued))
                cost = moved * settings.byte_cost + held * horizon_s * settings.host_byte_second_cost
                if gain - cost > best_net:
                    best_net, best_target = gain - cost, target_state
            if best_target <= state_now:
                break  # nodes further down the order only cost more
            new_actions, ready, reached = _tier_actions(
                i, model_id, node_id, image_ref, weights_uri, state_now, best_target, lat, ledger, now, deadline_s,
                p_j, cold_cost[i], d_by_state[i], image_bytes[i], weights_bytes[i], settings)
            if not new_actions:
                deferred += 1
                break  # no slot in time on the best node: the registry or bucket is busy, try a later plan
            actions.extend(new_actions)
            chosen += 1
            node_load[k] += 1
            if reached == 3:
                host_free[k] -= weights_bytes[i]
            if reached >= 2:
                disk_free[k] -= weights_bytes[i]
            if state_now < 1:
                image_mask[k] = True
            if chosen == 1 and reached > tier_state[i]:
                # the next replica of the model starts from here once the transfers are done
                tier_state[i] = reached
                ready_s[i] = ready
    return actions, tier_state, ready_s, deferred


def _tier_actions(i, model_id, node_id, image_ref, weights_uri, state_now, target_state, lat, ledger, now,
                  deadline_s, p_j, cold_cost, d_row, image_bytes, weights_bytes, settings):
    """The prepull and/or preload bringing ``node_id`` from ``state_now`` to ``target_state``, booked in the ledger.

    Returns ``(actions, ready_seconds_after_now, state_reached)``; no actions
    when the concurrency limits leave no slot in time for the first step (a
    preload that does not fit leaves the prepull alone, state ``image``).
    """
    def phase(state: str, name: str) -> float:
        value = lat.get(f"{state}:{name}")
        return float(np.nan_to_num(value[i], nan=0.0)) if value is not None else 0.0

    pull_s = phase("none", "image_pull_s") if state_now < 1 else 0.0
    fetch_s = phase("image", "weight_fetch_s") if state_now < 2 else 0.0
    # disk -> host copy: about the disk load time
    copy_s = phase("disk", "weight_load_s") if target_state == 3 else 0.0
    latest_end = max(deadline_s, 0.0) + 60.0 * settings.horizon_min  # a late tier still shortens later starts
    node_r = f"node:{node_id}"
    out: list[Action] = []
    t = 0.0
    wait = lambda d: _wait_seconds(d, 0.0, False)  # noqa: E731
    gain = float(p_j * cold_cost * (wait(d_row[state_now]) - wait(d_row[target_state])))
    if state_now < 1:
        start = ledger.place([node_r, f"registry:{registry_of(image_ref)}"], max(pull_s, 1.0), t,
                             latest_end - max(pull_s, 1.0), prefer_late=False)
        if start is None:
            return [], 0.0, state_now
        t = start + pull_s
        out.append(Action(kind=ActionKind.PREPULL, model_id=model_id, reason=Reason.CACHE_WARM,
                          not_before=now + timedelta(seconds=start), deadline=now + timedelta(seconds=max(
                              deadline_s, start + pull_s)), node_id=node_id, target=str(image_ref or model_id),
                          expected_benefit_s=gain if target_state == 1 else 0.0, expected_cost=float(image_bytes)))
    if target_state >= 2:
        duration = max(fetch_s + copy_s, 1.0)
        resources = [node_r] + ([f"registry:{registry_of(weights_uri)}"] if fetch_s > 0 else [])
        start = ledger.place(resources, duration, t, latest_end - duration, prefer_late=False)
        if start is None:
            return out, t, (1 if out else state_now)
        t = start + duration
        out.append(Action(kind=ActionKind.PRELOAD, model_id=model_id, reason=Reason.CACHE_WARM,
                          not_before=now + timedelta(seconds=start),
                          deadline=now + timedelta(seconds=max(deadline_s, t)), node_id=node_id,
                          target=str(weights_uri or model_id), tier=_TIER_OF_STATE["host" if target_state == 3
                                                                                  else "disk"],
                          expected_benefit_s=gain, expected_cost=float(weights_bytes if fetch_s > 0 else 0.0)))
    return out, t, (target_state if target_state >= 2 else 1)
