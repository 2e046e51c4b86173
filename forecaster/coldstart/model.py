"""The cold-start latency model: tree members per phase, a time-series member on recent cold starts.

Events (one row per observed cold start) carry ``model_id``, ``node_id``,
``started_at`` (UTC) or ``started_s``, ``total_seconds``, the phases of
:data:`~forecaster.contracts.phases.PHASES` (NaN when not reported),
``cache_state`` (none, image, disk, host, gpu, sleeping), ``image_bytes``,
``weights_bytes`` and, when known, ``node_bytes_per_s`` (the node's network
bandwidth), ``concurrent_node_transfers`` and
``concurrent_registry_pulls`` (pulls/fetches already running on the node, and
against the same registry, when the start began). :func:`load_cold_starts`
builds this frame from the store, deriving the concurrency from overlapping
cold starts with a sort and sweep (:func:`running_at_start`, O(n log n)).
Rows the model cannot use (a start dated ``0001-01-01``, no ``cache_state``, NaN or infinite
seconds) are skipped and counted (:func:`clean_events`), never raised.

Transfers (pre-pulls and pre-loads the node agents carried out, from the
``transfers`` table) are not cold starts: :class:`TransferRateMember` learns
the image pull and weight fetch rates (bytes/s) from them, and those rates set
the physics prior every other member corrects.

Members (the ensemble's member kinds, STYLE.md contract: ``__init__`` stores
settings, ``fit`` returns ``self``, fitted state ends in ``_``):

* :class:`TreePhaseMember`: one LightGBM per target (each phase and the
  total) on log seconds, features: cache tier, log sizes, node bandwidth,
  concurrency, the bandwidth prior of :mod:`forecaster.coldstart.physics`, and
  the history (:data:`HISTORY_LEVELS`): the last and median recent cold start
  of the same (model, tier) and of the same (model, node, tier), and the
  node's own speed (median log error of the prior on that node, per tier and
  over all tiers). No hour of day: trees on it extrapolate to hours the
  training window never saw; peak hours enter through the prior only.
* :class:`RecentLatencyMember`: an exponentially weighted mean of the tree
  member's recent log errors per (model, node, tier), falling back to (node,
  tier), then (model, tier): it tracks drift (a slower registry, a degraded
  node) between refits.
* the (model, node, tier) trailing median (``log_median_node_total``).

:class:`ColdStartModel` adds the recent member's correction to the trees' log
prediction and blends in the node's trailing median, with the two weights
chosen by a fixed rule on the last 20 % (by time) of the training events (see
its docstring; ``validation_`` keeps the figures). A node with no history gets
the model's and tier's history, then the global; with fewer than
``min_events`` events it answers with the physics prior alone (no data yet is
a normal answer, not an error).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import lightgbm as lgb
import numpy as np
import pandas as pd
from sqlalchemy import Engine

from forecaster.coldstart.physics import phase_seconds
from forecaster.coldstart.treegrid import TreeGrid, UnsupportedBooster
from forecaster.contracts.latency import NodeLatencyTable
from forecaster.contracts.phases import PHASES, START_STATES
from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.store.fields import MIN_COLD_START_S

TARGETS = (*PHASES, "total_seconds")
STATE_RANKS = {"none": 0, "image": 1, "disk": 2, "host": 3, "gpu": 4, "sleeping": 4}
#: Hour of day is deliberately not a tree feature: a fleet's training window need not cover every hour, and
#: trees on hour_sin/hour_cos extrapolate to hours never seen (the issue-13 production fleet). Peak hours
#: still enter through the physics prior (``log_prior_total``), whose slowdown is a stated parameter.
SHARED_FEATURES = ("state_rank", "log_image_bytes", "log_weights_bytes", "log_node_bandwidth",
                   "concurrent_node_transfers", "concurrent_registry_pulls", "log_prior_total")
#: History features, each from strictly earlier events: of the same (model, tier); of the same
#: (model, node, tier); and the node's own speed, as the median log error of the prior on that node
#: (per tier and over all tiers), which carries over to models the node never started.
HISTORY_FEATURES = ("log_last_total", "log_median_total", "n_previous",
                    "log_last_node_total", "log_median_node_total", "n_node_previous",
                    "node_state_residual", "n_node_state", "node_residual", "n_node")
#: Per target: the shared features, the log prior of that target, the history features.
FEATURES = (*SHARED_FEATURES, "log_prior_phase", *HISTORY_FEATURES)
#: Indices in :data:`FEATURES` of the features a node supplies (its speed), the rest coming from the model's side.
NODE_FEATURE_INDEX = tuple(FEATURES.index(f) for f in ("node_state_residual", "n_node_state", "node_residual",
                                                       "n_node"))
#: (key columns, value column, window, feature names: last, median, count) of the history features.
HISTORY_LEVELS = (
    (("model_id", "cache_state"), "total_seconds", 5, ("log_last_total", "log_median_total", "n_previous")),
    (("model_id", "node_id", "cache_state"), "total_seconds", 5,
     ("log_last_node_total", "log_median_node_total", "n_node_previous")),
    (("node_id", "cache_state"), "log_residual", 9, (None, "node_state_residual", "n_node_state")),
    (("node_id",), "log_residual", 15, (None, "node_residual", "n_node")),
)
FILE_NAMES = {"metadata": "metadata.json", "booster": "{target}.txt"}
#: A model with no registered sizes (image and weights both 0 or unknown: auto-registered by a push) is predicted
#: from its own observed starts, not by the 0-byte physics prior (about 12-15 s from every tier), until it has
#: this many of its own starts and the trees are fitted (see :meth:`ColdStartModel.sizeless_fallback`).
SIZELESS_OWN_STARTS = 10
#: The level of a sizeless model's own starts it is predicted at: the p90 (a lead time too short misses the
#: start, one too long only warms a replica a little early), per tier where the tier has starts.
SIZELESS_QUANTILE = 0.9


# --------------------------------------------------------------------------- features


#: A cold start stamped before this (UTC) is a broken clock, not an observation (e.g. ``0001-01-01``).
EARLIEST_STARTED_S = 946_684_800.0  # 2000-01-01T00:00:00Z
_EPOCH = pd.Timestamp("1970-01-01", tz="UTC")
#: The shortest total the model learns from (what ingest accepts): 0 s is no cold start.
MIN_TOTAL_S = MIN_COLD_START_S


def _started_seconds(events: pd.DataFrame) -> np.ndarray:
    """Start of each event in seconds since the epoch (or simulated seconds); NaN where unreadable.

    Never raises: a date pandas cannot hold in its unit (``0001-01-01`` read
    as nanoseconds) or text that is no date becomes NaN, for the caller to skip.
    """
    if "started_s" in events.columns:
        return pd.to_numeric(events["started_s"], errors="coerce").to_numpy(dtype="float64")
    if "started_at" not in events.columns:
        return np.full(len(events), np.nan)
    try:
        started = pd.to_datetime(events["started_at"], utc=True, errors="coerce")
        seconds = ((started - _EPOCH) / pd.Timedelta(seconds=1)).to_numpy(dtype="float64")
    except (OverflowError, ValueError, pd.errors.OutOfBoundsDatetime):
        seconds = np.array([_one_started_seconds(v) for v in events["started_at"]], dtype="float64")
    return np.where(np.isfinite(seconds), seconds, np.nan)


def _one_started_seconds(value) -> float:
    try:
        stamp = pd.Timestamp(value)
        stamp = stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp.tz_convert("UTC")
        return float((stamp - _EPOCH) / pd.Timedelta(seconds=1))
    except (TypeError, ValueError, OverflowError):
        return float("nan")


def clean_events(events: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, int]]:
    """Drop cold starts the model cannot learn from; say how many of each kind were dropped.

    Dropped (counted under the key in brackets): an unreadable start, or a
    dated one before 2000-01-01 (``bad_started_at``); a total that is missing,
    NaN, infinite, negative or below :data:`MIN_TOTAL_S` (``bad_total``: stored before ingest refused it); a phase that is infinite or
    negative (``bad_phase``; NaN means "not reported" and is kept); an infinite
    or negative size (``bad_size``); no ``cache_state`` (``unknown_cache_state``: the collector leaves it out
    when it found no kubelet ``Pulled`` event, the API calls such a start ``unknown``). A start of unknown tier is
    never guessed into one: taken as a start from nothing, ten warm 16 s starts made the from-nothing prediction
    16 s. It cannot feed the node-wide residual either, since that residual is measured against the prior of the
    start's own tier. Adds ``started_s`` (seconds).

    Returns:
        The kept rows (index reset) and ``{reason: count}`` for the dropped ones.
    """
    frame = events.copy()
    frame["started_s"] = _started_seconds(frame)
    bad_start = ~np.isfinite(frame["started_s"].to_numpy())
    if "started_s" not in events.columns and "started_at" in events.columns:
        bad_start |= frame["started_s"].to_numpy() < EARLIEST_STARTED_S
    total = pd.to_numeric(frame.get("total_seconds", pd.Series(np.nan, index=frame.index)), errors="coerce") \
        .to_numpy(dtype="float64")
    bad_total = ~np.isfinite(total) | (total < MIN_TOTAL_S)
    bad_phase = np.zeros(len(frame), dtype=bool)
    for phase in PHASES:
        if phase in frame.columns:
            values = pd.to_numeric(frame[phase], errors="coerce").to_numpy(dtype="float64")
            bad_phase |= np.isinf(values) | (values < 0)
            frame[phase] = values
    state = frame["cache_state"] if "cache_state" in frame.columns else pd.Series(None, index=frame.index)
    unknown_state = ~state.isin(list(STATE_RANKS)).to_numpy()
    bad_size = np.zeros(len(frame), dtype=bool)
    for column in ("image_bytes", "weights_bytes"):
        if column in frame.columns:
            values = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype="float64")
            bad_size |= np.isinf(values) | (values < 0)
            frame[column] = values
    skipped = {}
    drop = np.zeros(len(frame), dtype=bool)
    for name, mask in (("bad_started_at", bad_start), ("bad_total", bad_total), ("bad_phase", bad_phase),
                       ("bad_size", bad_size), ("unknown_cache_state", unknown_state)):
        mask = mask & ~drop  # each dropped row counted once, under its first reason
        if mask.any():
            skipped[name] = int(mask.sum())
        drop |= mask
    frame["total_seconds"] = total
    return frame[~drop].reset_index(drop=True), skipped


def prepare_events(events: pd.DataFrame, config: FleetConfig = FleetConfig(), *, history: bool = True
                   ) -> pd.DataFrame:
    """Sort events by start, fill optional columns, and add the features of :data:`FEATURES` (causal).

    History features (:data:`HISTORY_LEVELS`) use only earlier events: the
    last total and the median of the last five of the same (model, tier) and
    of the same (model, node, tier), how many there were, and the node's own
    speed: the median log error of the prior (``log_residual``, log1p actual -
    log1p prior total) over the node's last 9 starts in that tier and its last
    15 in any tier. A row that already carries ``log_residual`` (history kept by
    a fitted model) keeps it. A missing ``node_id`` is ``"-"``.
    """
    frame = events.copy()
    frame["started_s"] = _started_seconds(frame)
    frame = frame.sort_values("started_s", kind="stable").reset_index(drop=True)
    for column in ("concurrent_node_transfers", "concurrent_registry_pulls"):
        if column not in frame.columns:
            frame[column] = 0.0
        frame[column] = frame[column].fillna(0.0).astype("float64")
    for phase in PHASES:
        if phase not in frame.columns:
            frame[phase] = np.nan
    if "hour" not in frame.columns:
        if "started_at" in frame.columns:
            frame["hour"] = pd.to_datetime(frame["started_at"], utc=True).dt.hour
        else:
            frame["hour"] = (frame["started_s"] // 3600 % 24).astype(np.int64)
    frame["node_id"] = (frame["node_id"] if "node_id" in frame.columns else pd.Series("-", index=frame.index)) \
        .fillna("-").astype(str)
    frame["cache_state"] = frame["cache_state"].fillna("none").astype(str)
    frame["state_rank"] = frame["cache_state"].map(STATE_RANKS).fillna(0).astype("float64")
    frame["log_image_bytes"] = np.log1p(frame["image_bytes"].fillna(0).astype("float64"))
    frame["log_weights_bytes"] = np.log1p(frame["weights_bytes"].fillna(0).astype("float64"))
    if "node_bytes_per_s" not in frame.columns:
        frame["node_bytes_per_s"] = np.nan
    frame["node_bytes_per_s"] = pd.to_numeric(frame["node_bytes_per_s"], errors="coerce").astype("float64") \
        .fillna(config.node_nic_bytes_per_s)
    frame["log_node_bandwidth"] = np.log(frame["node_bytes_per_s"])
    prior = phase_seconds(frame["image_bytes"].fillna(0).to_numpy(), frame["weights_bytes"].fillna(0).to_numpy(),
                          np.minimum(frame["state_rank"].to_numpy(), 3).astype(np.int64),
                          concurrent=frame["concurrent_node_transfers"].to_numpy(),
                          registry_pulls=frame["concurrent_registry_pulls"].to_numpy(),
                          hour=frame["hour"].to_numpy(), node_bytes_per_s=frame["node_bytes_per_s"].to_numpy(),
                          config=config)
    frame["log_prior_total"] = np.log1p(prior["total_s"])
    for phase in PHASES:
        frame[f"prior_{phase}"] = prior[phase]
    residual = np.log1p(pd.to_numeric(frame["total_seconds"], errors="coerce").astype("float64")) \
        - frame["log_prior_total"] if "total_seconds" in frame.columns else pd.Series(np.nan, index=frame.index)
    if "log_residual" in frame.columns:
        residual = pd.to_numeric(frame["log_residual"], errors="coerce").astype("float64").fillna(residual)
    frame["log_residual"] = residual
    if not history:
        return frame
    for keys, value, window, (last_name, median_name, count_name) in HISTORY_LEVELS:
        group = frame.groupby([frame[k] for k in keys], sort=False)[value]
        previous = group.shift(1)
        # median of the last ``window`` earlier values: a (rows, window) matrix of within-group lags
        lags = np.column_stack([previous.to_numpy(dtype="float64")]
                               + [group.shift(j).to_numpy(dtype="float64") for j in range(2, window + 1)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: no history yet
            median = pd.Series(np.nanmedian(lags, axis=1), index=frame.index)
        log = (lambda v: np.log1p(v)) if value == "total_seconds" else (lambda v: v)
        if last_name is not None:
            frame[last_name] = log(previous)
        frame[median_name] = log(median)
        frame[count_name] = group.cumcount().astype("float64")
    return frame


def _history_tables(seen: pd.DataFrame) -> list[pd.DataFrame]:
    """Per level of :data:`HISTORY_LEVELS`, the ``last``, ``n`` and trailing ``median`` of each group of ``seen``
    (sorted by start): what :func:`_history_stats` looks rows up in."""
    tables = []
    for keys, value, window, _ in HISTORY_LEVELS:
        keys = list(keys)
        grouped = seen.groupby(keys, sort=False)[value]
        stats = pd.DataFrame({"last": grouped.last(), "n": grouped.size()})
        stats["median"] = seen.groupby(keys, sort=False).tail(window).groupby(keys)[value].median()
        tables.append(stats)
    return tables


def _history_stats(tables: list[pd.DataFrame], rows: pd.DataFrame) -> pd.DataFrame:
    """The :data:`HISTORY_FEATURES` of ``rows`` from :func:`_history_tables`' tables, one lookup per level."""
    out = pd.DataFrame(index=rows.index)
    for stats, (keys, value, window, (last_name, median_name, count_name)) in zip(tables, HISTORY_LEVELS):
        keys = list(keys)
        index = pd.MultiIndex.from_frame(rows[keys]) if len(keys) > 1 else pd.Index(rows[keys[0]])
        joined = stats.reindex(index)
        log = np.log1p if value == "total_seconds" else (lambda v: v)
        if last_name is not None:
            out[last_name] = log(joined["last"].to_numpy(dtype="float64"))
        out[median_name] = log(joined["median"].to_numpy(dtype="float64"))
        out[count_name] = joined["n"].fillna(0).to_numpy(dtype="float64")
    return out


# --------------------------------------------------------------------------- members


class TreePhaseMember:
    """One LightGBM regressor per target on the log error of the bandwidth prior.

    The target is ``log1p(seconds) - log1p(prior seconds)``: with little data
    the trees predict about zero and the member is the prior; with more they
    learn what the prior misses (slow hours, contention it underrates, models
    whose start-up differs).
    """

    name = "trees"

    def __init__(self, n_estimators: int = 300, learning_rate: float = 0.05, num_leaves: int = 15,
                 min_child_samples: int = 10, seed: int = 0, n_jobs: int = 2):
        self.params = {"n_estimators": n_estimators, "learning_rate": learning_rate, "num_leaves": num_leaves,
                       "min_child_samples": min_child_samples, "subsample": 0.8, "subsample_freq": 1,
                       "colsample_bytree": 0.9, "random_state": seed, "n_jobs": n_jobs, "verbose": -1}

    def _matrix(self, frame: pd.DataFrame, target: str) -> np.ndarray:
        """The :data:`FEATURES`, with ``log_prior_phase`` the prior of ``target`` itself."""
        prior = frame[f"prior_{target}"] if target in PHASES else np.expm1(frame["log_prior_total"])
        shared = frame[list(SHARED_FEATURES)].to_numpy(dtype="float64")
        history = frame[list(HISTORY_FEATURES)].to_numpy(dtype="float64")
        return np.column_stack([shared, np.log1p(np.asarray(prior, dtype="float64")), history])

    def fit(self, frame: pd.DataFrame) -> "TreePhaseMember":
        self.boosters_: dict[str, lgb.Booster] = {}
        for target in TARGETS:
            y = frame[target].to_numpy(dtype="float64")
            ok = np.isfinite(y)
            if ok.sum() < 10:
                continue
            model = lgb.LGBMRegressor(**self.params)
            prior = self._log_prior(frame, target)
            model.fit(self._matrix(frame, target)[ok], np.log1p(np.maximum(y[ok], 0.0)) - prior[ok])
            self.boosters_[target] = model.booster_
        return self

    def predict_log(self, frame: pd.DataFrame, targets: tuple[str, ...] = TARGETS) -> dict[str, np.ndarray]:
        """log1p seconds per target (default all); the bandwidth prior where no booster was fitted."""
        out = {}
        for target in targets:
            booster = self.boosters_.get(target)
            prior = self._log_prior(frame, target)
            out[target] = prior if booster is None else prior + booster.predict(self._matrix(frame, target))
        return out

    @staticmethod
    def _log_prior(frame: pd.DataFrame, target: str) -> np.ndarray:
        if target in PHASES:
            return np.log1p(frame[f"prior_{target}"].to_numpy(dtype="float64"))
        return frame["log_prior_total"].to_numpy(dtype="float64")


class RecentLatencyMember:
    """Exponentially weighted mean of the tree member's recent log errors, per (model, node, tier) first.

    Each error updates three levels: (model, node, tier), (node, tier) and
    (model, tier). A correction is read from the first level that has one, so
    a node that never started this model still gets its own recent drift, and
    a node never seen gets the model's.
    """

    name = "recent"
    #: the key levels, most specific first (column names of an event frame)
    LEVELS = (("model_id", "node_id", "cache_state"), ("node_id", "cache_state"), ("model_id", "cache_state"))

    def __init__(self, alpha: float = 0.3):
        self.alpha = alpha

    @classmethod
    def keys_of(cls, frame: pd.DataFrame) -> list[tuple[tuple, ...]]:
        """Per row of ``frame``, its key at every level (most specific first)."""
        columns = [list(zip(*(frame[c].astype(str) for c in level))) for level in cls.LEVELS]
        return [tuple((i, *k) for i, k in enumerate(keys)) for keys in zip(*columns)]

    def fit(self, keys: list[tuple[tuple, ...]], log_errors: np.ndarray) -> "RecentLatencyMember":
        self.level_: dict[tuple, float] = {}
        for key, err in zip(keys, log_errors):
            self.observe(key, float(err))
        return self

    def observe(self, key: tuple[tuple, ...], log_error: float) -> None:
        for k in key:
            prev = self.level_.get(k)
            self.level_[k] = log_error if prev is None else (1 - self.alpha) * prev + self.alpha * log_error

    def one(self, key: tuple[tuple, ...]) -> float:
        for k in key:
            value = self.level_.get(k)
            if value is not None:
                return value
        return 0.0

    def correction(self, keys: list[tuple[tuple, ...]]) -> np.ndarray:
        return np.array([self.one(k) for k in keys], dtype="float64")


class TransferRateMember:
    """Image pull and weight fetch rates (bytes/s) learned from the transfers the node agents carried out.

    A pre-pull measures ``image_pull_s`` for ``bytes`` of image, a pre-load
    ``weight_fetch_s`` for ``bytes`` of weights: the same phases a cold start
    from nothing pays, measured without a replica waiting. The rate per phase
    is the geometric mean of the last ``max_transfers`` observed rates (those
    measured in the prior's peak hours scaled back to the off-peak base), shrunk
    toward the fleet prior's rate (``FleetConfig.image_pull_bytes_per_s``,
    ``weight_fetch_bytes_per_s``) as if the prior were ``prior_weight`` more
    observations: one slow pull moves the prediction a quarter of the way (in
    log rate), a hundred pulls decide it. The fitted rates replace the prior's
    in the physics prior every other member corrects.
    """

    name = "transfers"
    #: phase -> the FleetConfig field holding its per-transfer rate (bytes/s)
    RATE_FIELDS = {"image_pull_s": "image_pull_bytes_per_s", "weight_fetch_s": "weight_fetch_bytes_per_s"}
    KIND_OF_PHASE = {"image_pull_s": "prepull", "weight_fetch_s": "preload"}

    def __init__(self, prior_weight: float = 3.0, max_transfers: int = 1000):
        self.prior_weight = prior_weight
        self.max_transfers = max_transfers

    def fit(self, transfers: pd.DataFrame | None, config: FleetConfig) -> "TransferRateMember":
        self.rates_: dict[str, float] = {}
        self.n_: dict[str, int] = {}
        for phase, field_name in self.RATE_FIELDS.items():
            prior = float(getattr(config, field_name))
            rates = np.zeros(0)
            if transfers is not None and len(transfers) and phase in transfers.columns:
                rows = transfers[transfers["kind"] == self.KIND_OF_PHASE[phase]] if "kind" in transfers.columns \
                    else transfers
                size = pd.to_numeric(rows["bytes"], errors="coerce").to_numpy(dtype="float64")
                seconds = pd.to_numeric(rows[phase], errors="coerce").to_numpy(dtype="float64")
                ok = np.isfinite(size) & np.isfinite(seconds) & (size > 0) & (seconds > 0)
                rates = (size[ok] / seconds[ok] * _peak_derating(rows, config)[ok])[-self.max_transfers:]
            n = len(rates)
            log_rate = (np.log(rates).sum() + self.prior_weight * np.log(prior)) / (n + self.prior_weight)
            self.rates_[field_name] = float(np.exp(log_rate))
            self.n_[phase] = int(n)
        return self

    def config_for(self, config: FleetConfig) -> FleetConfig:
        """``config`` with the learned rates in place of the prior's."""
        return replace(config, **self.rates_)


def _peak_derating(transfers: pd.DataFrame, config: FleetConfig) -> np.ndarray:
    """Per transfer, the factor that turns its measured rate into the off-peak base rate the physics holds.

    The prior slows every rate by ``config.peak_slowdown`` in
    ``config.peak_hours_utc``; a rate measured in those hours is that slowed
    rate, so it is scaled back up before it joins the base rate (otherwise a
    pull measured at 14:00 and predicted at 14:00 would be slowed twice).
    Transfers without a start time count as off-peak.
    """
    if "started_at" not in transfers.columns:
        return np.ones(len(transfers))
    hour = pd.to_datetime(transfers["started_at"], utc=True, errors="coerce").dt.hour.to_numpy(dtype="float64")
    lo, hi = config.peak_hours_utc
    return np.where((hour >= lo) & (hour < hi), config.peak_slowdown, 1.0)


# --------------------------------------------------------------------------- the model


#: What a fitted model keeps of each cold start to condition later predictions on.
HISTORY_COLUMNS = ("model_id", "node_id", "cache_state", "started_s", "total_seconds", "log_residual",
                   "node_bytes_per_s")


def _sizeless_tiers(per_tier: dict[str, float], default_s: float) -> list[float]:
    """A sizeless model's seconds per :data:`START_STATES` tier from its own starts' figure per cache state
    (``per_tier``; any :data:`STATE_RANKS` state, warmer ones included): a tier's own figure, else the largest
    figure of a colder tier, else ``default_s``; then, warmest to coldest, never below the warmer tier's."""
    out = []
    for state in START_STATES:
        if state in per_tier:
            out.append(per_tier[state])
            continue
        colder = [v for s, v in per_tier.items() if STATE_RANKS.get(s, -1) <= STATE_RANKS[state]
                  and s in STATE_RANKS]
        out.append(max(colder) if colder else default_s)
    for k in range(len(out) - 2, -1, -1):  # START_STATES runs coldest first: a colder tier >= the warmer one
        out[k] = max(out[k], out[k + 1])
    return out


@dataclass
class ColdStartModel:
    """Trees + recent-error correction + the node's own trailing median; physics prior when there are too few events.

    Member weights are chosen by a rule fixed here, on the last
    ``validation_share`` (by start time) of the training events, walking
    forward through them: trees fitted on the first part predict each
    validation event from the history before it; the recent member's weight
    ``w`` (``weights_grid``) and the weight ``a`` (``node_weights_grid``) of
    the (model, node, tier) trailing median (log space; where the triple has
    no history the trees' answer stands in) are the pair with the lowest
    validation MAE, the smaller weights on a tie. ``validation_`` keeps those
    figures (MAE in seconds of each member alone, of the chosen blend, and of
    the per-node and global trailing medians on the same events).
    """

    config: FleetConfig = FleetConfig()
    min_events: int = 30
    validation_share: float = 0.2
    weights_grid: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    node_weights_grid: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    tree_params: dict | None = None  # passed to TreePhaseMember (n_estimators, learning_rate, num_leaves, ...)

    def fit(self, events: pd.DataFrame, transfers: pd.DataFrame | None = None) -> "ColdStartModel":
        """Fit on observed cold starts and, when given, the transfers the agents carried out.

        Args:
            events: cold starts (see the module docstring); unusable rows are
                skipped and counted in ``skipped_`` (see :func:`clean_events`).
            transfers: pre-pulls and pre-loads (``kind``, ``bytes``,
                ``image_pull_s`` / ``weight_fetch_s``, as
                :func:`forecaster.store.transfers.read_transfers` returns them):
                they set the pull and fetch rates of the prior
                (:class:`TransferRateMember`); they are not cold starts and
                never enter the totals or the history.
        """
        events, self.skipped_ = clean_events(events)
        self.rates_ = TransferRateMember().fit(transfers, self.config)
        self.n_transfers_ = int(0 if transfers is None else len(transfers))
        self.config_ = self.rates_.config_for(self.config)
        frame = prepare_events(events, self.config_)
        self.n_events_ = len(frame)
        self.trees_: TreePhaseMember | None = None
        self.recent_ = RecentLatencyMember().fit([], np.zeros(0))
        self.weight_ = 0.0
        self.node_weight_ = 0.0
        self.validation_: dict = {}
        self.history_ = frame[list(HISTORY_COLUMNS)].copy()
        if len(frame) < self.min_events:
            return self
        cut = int(len(frame) * (1 - self.validation_share))
        head, tail = frame.iloc[:cut], frame.iloc[cut:]
        trees = TreePhaseMember(**(self.tree_params or {})).fit(head)
        err_head = np.log1p(head["total_seconds"].to_numpy()) - trees.predict_log(head)["total_seconds"]
        base = trees.predict_log(tail)["total_seconds"]
        actual = tail["total_seconds"].to_numpy(dtype="float64")
        # the recent member's correction before each validation event, walking forward (it does not depend on w)
        recent = RecentLatencyMember().fit(RecentLatencyMember.keys_of(head), err_head)
        correction = np.zeros(len(tail))
        for k, (key, b, y) in enumerate(zip(RecentLatencyMember.keys_of(tail), base, actual)):
            correction[k] = recent.one(key)
            recent.observe(key, float(np.log1p(y) - b))
        node = tail["log_median_node_total"].to_numpy(dtype="float64")
        best, best_err = (0.0, 0.0), np.inf
        for w in self.weights_grid:
            for a in self.node_weights_grid:
                err = float(np.mean(np.abs(np.expm1(_blend(base + w * correction, node, a)) - actual)))
                if err < best_err - 1e-9:
                    best, best_err = (w, a), err
        self.weight_, self.node_weight_ = best
        node_med = np.where(np.isnan(node), np.nan, np.expm1(node))
        global_med = np.expm1(tail["log_median_total"].to_numpy(dtype="float64"))
        self.validation_ = {
            "events": int(len(tail)), "recent_weight": self.weight_, "node_weight": self.node_weight_,
            "mae_s": {"trees": float(np.mean(np.abs(np.expm1(base) - actual))),
                      "chosen": best_err,
                      "node_trailing_median_where_known": _mae(node_med, actual),
                      "trailing_median_where_known": _mae(global_med, actual)},
            "node_history_share": float(np.isfinite(node).mean())}
        self.trees_ = TreePhaseMember(**(self.tree_params or {})).fit(frame)
        errors = np.log1p(frame["total_seconds"].to_numpy()) - self.trees_.predict_log(frame)["total_seconds"]
        self.recent_ = RecentLatencyMember().fit(RecentLatencyMember.keys_of(frame), errors)
        return self

    @property
    def fitted_config(self) -> FleetConfig:
        """The fleet physics with the rates learned from transfers (the prior's own before ``fit``)."""
        return getattr(self, "config_", self.config)

    def observed_copy(self, events: pd.DataFrame) -> "ColdStartModel":
        """A copy of this model that has observed ``events`` (:meth:`observe`); this one is left as it is (the
        service keeps the champion as loaded and observes on a copy, so the same events give the same copy)."""
        import copy

        other = copy.copy(self)
        other.recent_ = RecentLatencyMember(self.recent_.alpha)
        other.recent_.level_ = dict(self.recent_.level_)
        other.observe(events)
        return other

    def observe(self, events: pd.DataFrame) -> None:
        """Condition on newer cold starts without refitting (history and recent errors)."""
        events, _ = clean_events(events)
        if not len(events):
            return
        frame = self._with_history(events)
        if self.trees_ is not None:
            base = self.trees_.predict_log(frame, ("total_seconds",))["total_seconds"]
            for key, b, actual in zip(RecentLatencyMember.keys_of(frame), base, frame["total_seconds"].to_numpy()):
                self.recent_.observe(key, float(np.log1p(actual) - b))
        self.history_ = pd.concat([self.history_, frame[list(HISTORY_COLUMNS)]], ignore_index=True)

    def _seen_tables(self) -> list[pd.DataFrame]:
        """:func:`_history_tables` of ``history_``, kept until ``history_`` is replaced (:meth:`observe` and the
        loaders assign a new frame; nothing changes one in place): every planner or API question reads the same
        statistics, which took about a third of a one-model prediction's time at 3,000 stored cold starts."""
        cached = getattr(self, "_seen_tables_of", None)
        if cached is None or cached[0] is not self.history_:
            seen = self.history_.sort_values("started_s", kind="stable")
            cached = self._seen_tables_of = (self.history_, _history_tables(seen))
        return cached[1]

    def _with_history(self, events: pd.DataFrame) -> pd.DataFrame:
        """Features for ``events`` with history from everything already seen plus earlier rows of ``events``."""
        new = events.copy()
        new["started_s"] = _started_seconds(new)
        if "total_seconds" not in new.columns:
            new["total_seconds"] = np.nan
        # rows with a total come through clean_events (no unknown tier); a question asked without a tier is
        # answered for a start from nothing, the slowest tier (never a stored start's guessed tier)
        new["cache_state"] = new["cache_state"].fillna("none").astype(str)
        new["node_id"] = (new["node_id"] if "node_id" in new.columns else pd.Series("-", index=new.index)) \
            .fillna("-").astype(str)
        if not new.duplicated(["model_id", "node_id", "cache_state"]).any() or new["total_seconds"].isna().all():
            # no row can be another's history: statistics straight from what was seen (the planner's case)
            prepared = prepare_events(new, self.fitted_config, history=False)
            stats = _history_stats(self._seen_tables(), prepared)
            for column in stats.columns:
                prepared[column] = stats[column].to_numpy()
            return prepared
        seen = self.history_.assign(_known=True)
        both = pd.concat([seen, new.drop(columns=["log_residual"], errors="ignore").assign(_known=False)],
                         ignore_index=True, sort=False)
        for column in ("image_bytes", "weights_bytes"):
            if column not in both.columns:
                both[column] = 0.0
        prepared = prepare_events(both.drop(columns=[c for c in ("started_at",) if c in both.columns]),
                                  self.fitted_config)
        return prepared[~prepared["_known"].astype(bool)].reset_index(drop=True)

    def predict(self, events: pd.DataFrame, *, phases: bool = True) -> pd.DataFrame:
        """Predicted seconds per phase and ``total_seconds`` for each row of ``events`` (order kept).

        ``phases=False`` predicts the total only (the per-node planner table: one booster, not six).
        """
        events = events.reset_index(drop=True).assign(_row=lambda f: np.arange(len(f)))
        frame = self._with_history(events)
        shown = PHASES if phases else ()
        if self.trees_ is None:
            out = pd.DataFrame({p: frame[f"prior_{p}"] for p in shown}, index=frame.index)
            out["total_seconds"] = np.expm1(frame["log_prior_total"])
        else:
            logs = self.trees_.predict_log(frame, (*shown, "total_seconds"))
            keys = RecentLatencyMember.keys_of(frame)
            total = logs["total_seconds"] + self.weight_ * self.recent_.correction(keys)
            total = _blend(total, frame["log_median_node_total"].to_numpy(dtype="float64"), self.node_weight_)
            out = pd.DataFrame({t: np.maximum(np.expm1(logs[t]), 0.0) for t in shown}, index=frame.index)
            out["total_seconds"] = np.maximum(np.expm1(total), 0.0)
        out["_row"] = frame["_row"].to_numpy()
        return out.sort_values("_row").drop(columns="_row").reset_index(drop=True)

    def latency_table(self, models: pd.DataFrame, *, hour: int, concurrent: float = 0.0,
                      registry_pulls: float = 0.0, nodes=None, default_s: float | None = None) -> pd.DataFrame:
        """Planner latency input for every model (index ``model_id``, ``image_bytes``, ``weights_bytes``) and state.

        Args:
            nodes: None for one row per (model, state) with no node (history
                of the model and tier, then global). Otherwise the node ids
                to answer for (a sequence, an index, or a frame indexed by
                ``node_id`` with an optional ``node_bytes_per_s``): one row
                per (model, node, state) with a ``node_id`` column, from that
                node's own history; a node with no history (or unknown) falls
                back to the model's and tier's, then the global. The phases
                of a per-node row are the node-less ones (only ``total_s`` is
                per node). A node's bandwidth, when not given, is the last it
                reported in the history. The long frame of
                :meth:`node_latency_table` (meant for a few models or nodes;
                the planner reads the arrays).
            default_s: where given (the service passes ``PREWARM_DEFAULT_COLD_START_S``), a model without
                sizes is answered from its own starts, else with this (:meth:`sizeless_fallback`).

        Returns:
            ``model_id, state, total_s``, the phases, and ``node_id`` when ``nodes`` is given.
        """
        if nodes is not None:
            return self.node_latency_table(models, hour=hour, concurrent=concurrent, registry_pulls=registry_pulls,
                                           nodes=nodes, default_s=default_s).to_frame()
        base = self._base_rows(models, hour=hour, concurrent=concurrent, registry_pulls=registry_pulls)
        pred = self.predict(base)
        total = pred["total_seconds"].to_numpy(dtype="float64", copy=True).reshape(len(models), len(START_STATES))
        if default_s is not None:
            rows, seconds, _ = self.sizeless_fallback(models, default_s)
            total[rows] = seconds
        out = pd.DataFrame({"model_id": base["model_id"], "state": base["cache_state"],
                            "total_s": total.reshape(-1)})
        for phase in PHASES:
            out[phase] = pred[phase].to_numpy()
        return out

    def node_latency_table(self, models: pd.DataFrame, *, hour: int, nodes, concurrent: float = 0.0,
                           registry_pulls: float = 0.0, default_s: float | None = None) -> NodeLatencyTable:
        """Predicted seconds per (model, node, state) as arrays: what :meth:`latency_table` answers per node.

        Exact: every cell is what :meth:`predict` gives for that (model, node,
        state) row (up to float32 storage, about 6e-8 relative, and the order of
        summing the trees, about 1e-15). It is computed without the models x
        nodes x states rows: a cell's features come from the model's side (sizes,
        its history, the prior at the node's bandwidth) or the node's side (its
        speed statistics), so the total booster is evaluated on the two sides
        apart and combined with one matrix product per state and bandwidth
        (:class:`~forecaster.coldstart.treegrid.TreeGrid`); the recent member's
        correction is the node's (node, tier) level where it has one, else the
        model's (model, tier). The cells whose (model, node, tier) has history
        or a recent error of its own (at most one per kept cold start) are
        predicted row by row, as before. Phases are node-less (``per_model``).
        Cost: one pass over the models per distinct node bandwidth (nodes of one
        hardware class share one); a fleet whose every node reports its own
        bandwidth pays one pass per node (not measured; memory stays bounded).

        Args:
            nodes: as :meth:`latency_table`'s (a sequence of node ids, or a frame indexed by ``node_id`` with an
                optional ``node_bytes_per_s``).
            default_s: as :meth:`latency_table`'s (a sizeless model's cells are its own starts' on every node).
        """
        base = self._base_rows(models, hour=hour, concurrent=concurrent, registry_pulls=registry_pulls)
        node_ids, bandwidth = self._node_inputs(nodes)
        n_models, n_states = len(models), len(START_STATES)
        pred = self.predict(base)
        per_model = {p: pred[p].to_numpy(dtype="float32").reshape(n_models, n_states) for p in PHASES}
        try:
            total = self._node_totals(base, node_ids, bandwidth)
        except UnsupportedBooster as exc:  # a booster TreeGrid cannot read: row by row, one node at a time
            warnings.warn(f"per-node latency row by row ({exc})", RuntimeWarning, stacklevel=2)
            total = self._node_totals_by_row(base, node_ids, bandwidth)
        if default_s is not None:
            rows, seconds, _ = self.sizeless_fallback(models, default_s)
            total[rows] = seconds[:, None, :].astype("float32")
        return NodeLatencyTable(model_ids=pd.Index(models.index.astype(str)), node_ids=pd.Index(node_ids),
                                per_node={"total_s": total}, per_model=per_model)

    def sizeless_fallback(self, models: pd.DataFrame, default_s: float
                          ) -> tuple[np.ndarray, np.ndarray, pd.Series]:
        """What a model without registered sizes is predicted at, where the latency model cannot answer for it.

        A model whose ``image_bytes`` and ``weights_bytes`` are both 0 or missing (auto-registered by a push)
        would get the physics prior of 0 bytes (about 12-15 s from every tier), and trees that never saw its
        sizes. While it has fewer than :data:`SIZELESS_OWN_STARTS` starts of its own in the history, or no trees
        are fitted (fewer than ``min_events`` in the fleet), it is predicted from its own starts instead: per
        tier the :data:`SIZELESS_QUANTILE` of that tier's starts; a tier without any the largest such figure of
        its colder tiers (a warm tier then gets the colder figure: a longer lead, never a missed start), else
        ``default_s`` (``PREWARM_DEFAULT_COLD_START_S``): starts from warmer states (a GPU-resident restart of
        3 s) never set a colder tier's figure. The tiers are then made monotone (a colder tier is never faster
        than a warmer one), and with no start of its own every tier is ``default_s``.

        Returns:
            The positions in ``models`` of the models that fall back, their seconds (positions x
            :data:`START_STATES`) and, per model id of ``models``, the source of its figures: ``latency_model``,
            ``observed`` (its own starts) or ``default``.
        """
        ids = models.index.astype(str)
        sizes = models[["image_bytes", "weights_bytes"]].apply(pd.to_numeric, errors="coerce").fillna(0.0)
        sizeless = ((sizes["image_bytes"] <= 0) & (sizes["weights_bytes"] <= 0)).to_numpy()
        source = pd.Series("latency_model", index=ids, dtype=object)
        if not sizeless.any():
            return np.zeros(0, dtype=np.int64), np.zeros((0, len(START_STATES))), source
        history = self.history_[self.history_["model_id"].astype(str).isin(set(ids[sizeless]))]
        totals = pd.to_numeric(history["total_seconds"], errors="coerce")
        own = history.assign(total_seconds=totals)[np.isfinite(totals.to_numpy(dtype="float64"))]
        counts = own.groupby(own["model_id"].astype(str)).size()
        per_tier = own.groupby([own["model_id"].astype(str), own["cache_state"].astype(str)])["total_seconds"] \
            .quantile(SIZELESS_QUANTILE)
        tiers_of: dict[str, dict[str, float]] = {}
        for (model_id, state), value in per_tier.items():
            tiers_of.setdefault(model_id, {})[state] = float(value)
        rows, seconds = [], []
        for position in np.flatnonzero(sizeless):
            model_id = ids[position]
            n = int(counts.get(model_id, 0))
            if self.trees_ is not None and n >= SIZELESS_OWN_STARTS:
                continue
            if n == 0:
                seconds.append([float(default_s)] * len(START_STATES))
                source[model_id] = "default"
            else:
                seconds.append(_sizeless_tiers(tiers_of.get(model_id, {}), float(default_s)))
                source[model_id] = "observed"
            rows.append(position)
        return (np.asarray(rows, dtype=np.int64), np.asarray(seconds, dtype="float64").reshape(-1, len(START_STATES)),
                source)

    def _base_rows(self, models: pd.DataFrame, *, hour: int, concurrent: float, registry_pulls: float
                   ) -> pd.DataFrame:
        """One row per (model, state), model-major, dated after the last kept cold start, with no node."""
        base = self._table_rows(models, hour=hour, concurrent=concurrent, registry_pulls=registry_pulls)
        base["started_s"] = float(self.history_["started_s"].max()) + 1.0 if len(self.history_) else 0.0
        base["node_id"] = "-"
        return base

    def _node_totals_by_row(self, base: pd.DataFrame, node_ids: np.ndarray, bandwidth: np.ndarray) -> np.ndarray:
        """(models, nodes, states) float32 totals from :meth:`predict` on each node's rows (the reference path)."""
        n_models, n_states = len(base) // len(START_STATES), len(START_STATES)
        out = np.empty((n_models, len(node_ids), n_states), dtype="float32")
        for k, (node, bytes_per_s) in enumerate(zip(node_ids, bandwidth)):
            rows = base.assign(node_id=node, node_bytes_per_s=bytes_per_s)
            out[:, k, :] = self.predict(rows, phases=False)["total_seconds"].to_numpy().reshape(n_models, n_states)
        return out

    def _node_totals(self, base: pd.DataFrame, node_ids: np.ndarray, bandwidth: np.ndarray) -> np.ndarray:
        """(models, nodes, states) float32 totals, the two sides apart (see :meth:`node_latency_table`)."""
        n_states = len(START_STATES)
        n_models, n_nodes = len(base) // n_states, len(node_ids)
        out = np.empty((n_models, n_nodes, n_states), dtype="float32")
        if n_nodes == 0 or n_models == 0:
            return out
        config = self.fitted_config
        filled = np.where(np.isfinite(bandwidth), bandwidth, config.node_nic_bytes_per_s)
        seen_nodes = set(self.history_["node_id"].astype(str))
        seen_models = set(self.history_["model_id"].astype(str))
        no_node = _unused_id("\x00no-node", seen_nodes)
        no_model = _unused_id("\x00no-model", seen_models)
        states = np.asarray(START_STATES, dtype=object)
        booster = None if self.trees_ is None else self.trees_.boosters_.get("total_seconds")
        node_side = None
        if booster is not None:
            # the node's side: its speed statistics per state (the model's columns of these rows are not read)
            node_rows = pd.DataFrame({
                "model_id": no_model, "node_id": np.repeat(node_ids, n_states),
                "cache_state": np.tile(states, n_nodes), "image_bytes": 0.0, "weights_bytes": 0.0,
                "node_bytes_per_s": np.repeat(filled, n_states), "concurrent_node_transfers": 0.0,
                "concurrent_registry_pulls": 0.0, "hour": int(base["hour"].iloc[0]),
                "started_s": float(base["started_s"].iloc[0])})
            node_side = self.trees_._matrix(self._features_in_order(node_rows), "total_seconds") \
                .reshape(n_nodes, n_states, -1)
            grid = self._tree_grid(booster)
        node_fix, node_has, model_fix = self._recent_levels(base, node_ids)
        for value in np.unique(filled):
            cols = np.flatnonzero(filled == value)
            rows = self._features_in_order(base.assign(node_id=no_node, node_bytes_per_s=value))
            log_prior = rows["log_prior_total"].to_numpy(dtype="float64").reshape(n_models, n_states)
            if self.trees_ is None:  # the prior alone, as predict answers it
                out[:, cols, :] = np.expm1(log_prior)[:, None, :]
                continue
            model_side = None if booster is None else \
                self.trees_._matrix(rows, "total_seconds").reshape(n_models, n_states, -1)
            for s in range(n_states):
                raw = 0.0 if booster is None else grid.grid(model_side[:, s, :], node_side[cols, s, :],
                                                            NODE_FEATURE_INDEX)
                fix = np.where(node_has[cols, s][None, :], node_fix[cols, s][None, :], model_fix[:, s][:, None])
                total = log_prior[:, s][:, None] + raw + self.weight_ * fix
                # _blend where the cell has no (model, node, tier) median (those cells are redone below)
                total = (1.0 - self.node_weight_) * total + self.node_weight_ * total
                out[:, cols, s] = np.maximum(np.expm1(total), 0.0)
        self._own_history_cells(out, base, node_ids, filled)
        return out

    def _features_in_order(self, rows: pd.DataFrame) -> pd.DataFrame:
        """:meth:`_with_history` of ``rows``, in ``rows``' order."""
        frame = self._with_history(rows.reset_index(drop=True).assign(_row=lambda f: np.arange(len(f))))
        return frame.sort_values("_row").reset_index(drop=True)

    def _tree_grid(self, booster) -> TreeGrid:
        held = getattr(self, "_grid_", None)
        if held is None or held[0] is not booster:
            held = (booster, TreeGrid(booster))
            self._grid_ = held
        return held[1]

    def _recent_levels(self, base: pd.DataFrame, node_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The recent member's (node, tier) corrections and where there is one (nodes x states), and the (model,
        tier) ones (models x states, 0 where none): a cell with no (model, node, tier) level of its own reads the
        first of these that has one, as :meth:`RecentLatencyMember.one` does."""
        level = self.recent_.level_
        keys = [[(1, str(n), s) for s in START_STATES] for n in node_ids]
        node_has = np.array([[k in level for k in row] for row in keys], dtype=bool).reshape(len(node_ids), -1)
        node_fix = np.array([[level.get(k, 0.0) for k in row] for row in keys], dtype="float64") \
            .reshape(len(node_ids), -1)
        model_fix = np.array([level.get((2, m, s), 0.0) for m, s in zip(base["model_id"], base["cache_state"])],
                             dtype="float64").reshape(-1, len(START_STATES))
        return node_fix, node_has, model_fix

    def _own_history_cells(self, out: np.ndarray, base: pd.DataFrame, node_ids: np.ndarray,
                           bandwidth: np.ndarray) -> None:
        """Overwrite the cells whose (model, node, state) has history or a recent error of its own, row by row."""
        n_states = len(START_STATES)
        model_pos = pd.Index(base["model_id"].to_numpy()[::n_states])
        node_pos = pd.Index(node_ids)
        state_pos = pd.Index(START_STATES)
        triples = [(k[1], k[2], k[3]) for k in self.recent_.level_ if k[0] == 0]
        seen = pd.DataFrame(triples, columns=["model_id", "node_id", "cache_state"]) if triples else \
            pd.DataFrame(columns=["model_id", "node_id", "cache_state"])
        seen = pd.concat([seen, self.history_[["model_id", "node_id", "cache_state"]].astype(str)],
                         ignore_index=True).drop_duplicates()
        m = model_pos.get_indexer(seen["model_id"].astype(str))
        n = node_pos.get_indexer(seen["node_id"].astype(str))
        s = state_pos.get_indexer(seen["cache_state"].astype(str))
        ok = (m >= 0) & (n >= 0) & (s >= 0)
        if not ok.any():
            return
        m, n, s = m[ok], n[ok], s[ok]
        rows = base.iloc[m * n_states + s].reset_index(drop=True)
        rows["node_id"] = node_ids[n]
        rows["node_bytes_per_s"] = bandwidth[n]
        out[m, n, s] = self.predict(rows, phases=False)["total_seconds"].to_numpy()

    def _node_inputs(self, nodes) -> tuple[np.ndarray, np.ndarray]:
        """Node ids (object array) and their bandwidths (NaN: the last reported, else the fleet default)."""
        if isinstance(nodes, pd.DataFrame):
            ids = nodes.index.astype(str).to_numpy(dtype=object)
            given = pd.to_numeric(nodes["node_bytes_per_s"], errors="coerce").to_numpy(dtype="float64") \
                if "node_bytes_per_s" in nodes.columns else np.full(len(ids), np.nan)
        else:
            if isinstance(nodes, str) or not all(isinstance(n, str) and n for n in nodes):
                raise ValueError("nodes must be a sequence of non-empty node id strings (or a frame indexed by them)")
            ids = np.asarray(list(nodes), dtype=object)
            given = np.full(len(ids), np.nan)
        seen = self.history_.dropna(subset=["node_bytes_per_s"]).sort_values("started_s", kind="stable")
        reported = seen.groupby(seen["node_id"].astype(str))["node_bytes_per_s"].last()
        fallback = reported.reindex(ids).to_numpy(dtype="float64")
        return ids, np.where(np.isfinite(given), given, fallback)

    @staticmethod
    def _table_rows(models: pd.DataFrame, *, hour: int, concurrent: float, registry_pulls: float) -> pd.DataFrame:
        return pd.DataFrame({
            "model_id": np.repeat(models.index.astype(str).to_numpy(), len(START_STATES)),
            "cache_state": np.tile(np.array(START_STATES, dtype=object), len(models)),
            "image_bytes": np.repeat(models["image_bytes"].to_numpy(dtype="float64"), len(START_STATES)),
            "weights_bytes": np.repeat(models["weights_bytes"].to_numpy(dtype="float64"), len(START_STATES)),
            "concurrent_node_transfers": concurrent, "concurrent_registry_pulls": registry_pulls, "hour": hour,
        })

    # ------------------------------------------------------------------ persistence
    def save(self, folder: str | Path) -> Path:
        """Write the boosters and a small metadata file under ``folder`` (fixed file names)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        targets = []
        if self.trees_ is not None:
            for target, booster in self.trees_.boosters_.items():
                booster.save_model(str(folder / FILE_NAMES["booster"].format(target=target)))
                targets.append(target)
        meta = {"kind": "coldstart", "n_events": self.n_events_, "weight": self.weight_,
                "node_weight": self.node_weight_, "validation": getattr(self, "validation_", {}), "targets": targets,
                "min_events": self.min_events, "skipped": getattr(self, "skipped_", {}),
                "n_transfers": getattr(self, "n_transfers_", 0),
                "rates": {} if getattr(self, "rates_", None) is None else self.rates_.rates_,
                "rate_observations": {} if getattr(self, "rates_", None) is None else self.rates_.n_,
                "recent": [[list(k), v] for k, v in self.recent_.level_.items()],
                "through_id": getattr(self, "through_id_", None),
                "gap_floor_id": getattr(self, "gap_floor_id_", None),
                "gap_ids": (None if getattr(self, "gap_ids_", ()) is None
                            else [int(i) for i in getattr(self, "gap_ids_", ())])}
        (folder / FILE_NAMES["metadata"]).write_text(json.dumps(meta, indent=1))
        self.history_.to_csv(folder / "history.csv.gz", index=False)
        return folder

    @staticmethod
    def load(folder: str | Path, config: FleetConfig = FleetConfig()) -> "ColdStartModel":
        folder = Path(folder)
        meta = json.loads((folder / FILE_NAMES["metadata"]).read_text())
        model = ColdStartModel(config=config, min_events=meta["min_events"])
        model.n_events_ = meta["n_events"]
        model.weight_ = meta["weight"]
        model.node_weight_ = meta.get("node_weight", 0.0)
        model.validation_ = meta.get("validation", {})
        model.skipped_ = meta.get("skipped", {})
        model.n_transfers_ = meta.get("n_transfers", 0)
        # versions saved before it: None, observe nothing (their history's ids are unknown) until the next retrain
        model.through_id_ = meta.get("through_id")
        # ids below through_id its training could not see (observed once they commit); versions saved before
        # gaps were recorded: none. None: too many, the rows above gap_floor_id are re-read and de-duplicated
        model.gap_floor_id_ = meta.get("gap_floor_id")
        model.gap_ids_ = None if "gap_ids" in meta and meta["gap_ids"] is None else \
            tuple(int(i) for i in meta.get("gap_ids") or ())
        model.rates_ = TransferRateMember()
        model.rates_.rates_ = dict(meta.get("rates", {}))
        model.rates_.n_ = dict(meta.get("rate_observations", {}))
        model.config_ = model.rates_.config_for(config)
        model.recent_ = RecentLatencyMember()
        # versions saved before per-node keys hold [model, state, value]: the (model, tier) level
        model.recent_.level_ = {tuple(item[0]) if len(item) == 2 else (2, item[0], item[1]): item[-1]
                                for item in meta["recent"]}
        history = pd.read_csv(folder / "history.csv.gz", dtype={"model_id": str, "cache_state": str, "node_id": str})
        for column in HISTORY_COLUMNS:
            if column not in history.columns:
                history[column] = "-" if column == "node_id" else np.nan
        history["node_id"] = history["node_id"].fillna("-")
        model.history_ = history[list(HISTORY_COLUMNS)]
        model.trees_ = None
        if meta["targets"]:
            trees = TreePhaseMember()
            trees.boosters_ = {t: read_booster(folder / FILE_NAMES["booster"].format(target=t))
                               for t in meta["targets"]}
            model.trees_ = trees
        return model


def read_booster(path: str | Path) -> lgb.Booster:
    """A LightGBM booster from its saved model text, refused with ``ValueError`` unless the text is complete.

    LightGBM does not raise on every damaged model file: on many texts cut short (a crash before the file's data
    reached the disk) its parser calls ``std::terminate`` and SIGABRT ends the whole process (the scheduler, the
    API), or it loads the trees it got to. So the text is read here and checked (:func:`model_text_complete`)
    before LightGBM sees it, and handed over as ``model_str``: a file cut anywhere is a Python error the caller
    can answer with its fallback.
    """
    path = Path(path)
    model_text = path.read_text(encoding="utf-8")
    if not model_text_complete(model_text):
        raise ValueError(f"LightGBM model file {path} is incomplete ({len(model_text)} characters; a complete one "
                         "ends with its 'end of trees' section, parameters and pandas_categorical line)")
    return lgb.Booster(model_str=model_text)


def model_text_complete(model_text: str) -> bool:
    """Whether ``model_text`` is a whole ``Booster.save_model`` text (not empty, not cut short, no zeroed block).

    ``save_model`` writes the trees, an ``end of trees`` line, the feature importances and the parameters, and the
    Python package appends a last line ``pandas_categorical:<json>`` and a newline: only the whole text ends so.
    """
    if "\x00" in model_text or "\nend of trees\n" not in model_text or not model_text.endswith("\n"):
        return False
    last_line = model_text[model_text.rstrip("\n").rfind("\n") + 1:]
    return last_line.startswith("pandas_categorical:")


def _unused_id(stem: str, taken: set[str]) -> str:
    """``stem``, or ``stem`` with a suffix, that is not in ``taken`` (a node or model id with no history)."""
    name, k = stem, 0
    while name in taken:
        k += 1
        name = f"{stem}-{k}"
    return name


def _blend(log_pred: np.ndarray, log_node: np.ndarray, weight: float) -> np.ndarray:
    """``(1 - weight) * log_pred + weight * log_node``, with ``log_pred`` where ``log_node`` is NaN (no history)."""
    log_pred = np.asarray(log_pred, dtype="float64")
    return (1.0 - weight) * log_pred + weight * np.where(np.isnan(log_node), log_pred, log_node)


def _mae(predicted: np.ndarray, actual: np.ndarray) -> float | None:
    ok = np.isfinite(predicted)
    return float(np.mean(np.abs(predicted[ok] - actual[ok]))) if ok.any() else None


# --------------------------------------------------------------------------- baselines and the store


def baseline_predictions(train: pd.DataFrame, test: pd.DataFrame) -> pd.DataFrame:
    """Last value and trailing median (last 5), globally and per node, walking forward through ``test``.

    * ``last_value``, ``trailing_median``: of the same (model, tier), falling
      back to all models in that tier, then to all events;
    * ``node_last_value``, ``node_trailing_median``: of the same (model, node,
      tier), falling back to (model, tier), then tier, then all events;
    * ``node_state_trailing_median``: of the same (node, tier) whatever the
      model, falling back to (model, tier), tier, all.
    """
    both = pd.concat([train.assign(_test=False), test.assign(_test=True)], ignore_index=True)
    both["started_s"] = _started_seconds(both)
    both = both.sort_values("started_s", kind="stable").reset_index(drop=True)
    nodes = (both["node_id"] if "node_id" in both.columns else pd.Series("-", index=both.index)).fillna("-") \
        .astype(str)
    out: dict[str, list[float]] = {k: [] for k in ("last_value", "trailing_median", "node_last_value",
                                                   "node_trailing_median", "node_state_trailing_median")}
    by_triple: dict[tuple, list[float]] = {}
    by_node_state: dict[tuple, list[float]] = {}
    by_pair: dict[tuple[str, str], list[float]] = {}
    by_state: dict[str, list[float]] = {}
    everything: list[float] = []
    for model_id, node, state, total, is_test in zip(both["model_id"], nodes, both["cache_state"],
                                                     both["total_seconds"], both["_test"]):
        if is_test:
            pair = by_pair.get((model_id, state)) or by_state.get(state) or everything or [np.nan]
            triple = by_triple.get((model_id, node, state)) or pair
            node_state = by_node_state.get((node, state)) or pair
            out["last_value"].append(pair[-1])
            out["trailing_median"].append(float(np.median(pair[-5:])))
            out["node_last_value"].append(triple[-1])
            out["node_trailing_median"].append(float(np.median(triple[-5:])))
            out["node_state_trailing_median"].append(float(np.median(node_state[-5:])))
        by_triple.setdefault((model_id, node, state), []).append(total)
        by_node_state.setdefault((node, state), []).append(total)
        by_pair.setdefault((model_id, state), []).append(total)
        by_state.setdefault(state, []).append(total)
        everything.append(total)
    tested = both[both["_test"]]
    return pd.DataFrame({"model_id": tested["model_id"].to_numpy(), "started_s": tested["started_s"].to_numpy(),
                         "actual": tested["total_seconds"].to_numpy(), **out})


def running_at_start(start_s: np.ndarray, end_s: np.ndarray, counted: np.ndarray | None = None) -> np.ndarray:
    """For each event ``i``, how many (counted) events ``j`` had begun before it and were still running.

    ``j`` counts when ``start_j < start_i`` and ``end_j > start_i``, the same
    definition as an n x n overlap matrix, in O(n log n): the events begun
    before ``i`` minus those of them already over (``end_j <= start_i``; an
    event that ended by ``start_i`` began before it, except a zero-length one
    at exactly ``start_i``, which is added back). NaN starts or ends count
    nowhere and get 0. Ends are never before starts (totals are >= 0).

    Args:
        start_s, end_s: (n,) seconds.
        counted: (n,) bool, which events may be counted as running (default all).
    """
    start_s = np.asarray(start_s, dtype="float64")
    end_s = np.asarray(end_s, dtype="float64")
    ok = np.isfinite(start_s) & np.isfinite(end_s)
    pool = ok if counted is None else ok & np.asarray(counted, dtype=bool)
    starts = np.sort(start_s[pool])
    ends = np.sort(end_s[pool])
    instant = np.sort(start_s[pool & (end_s == start_s)])  # zero-length events
    at = np.where(ok, start_s, 0.0)
    begun = np.searchsorted(starts, at, side="left")
    over = np.searchsorted(ends, at, side="right")
    # a zero-length j at exactly start_i is in ``over`` but not in ``begun``
    instant_here = np.searchsorted(instant, at, side="right") - np.searchsorted(instant, at, side="left")
    return np.where(ok, begun - over + instant_here, 0).astype("float64")


def with_concurrency(frame: pd.DataFrame) -> pd.DataFrame:
    """Add ``concurrent_node_transfers`` and ``concurrent_registry_pulls`` derived from the events themselves.

    ``concurrent_node_transfers`` = earlier cold starts on the same node still
    running at this one's start; ``concurrent_registry_pulls`` = cold starts
    from nothing (which pull the image) running fleet-wide at that time. A
    sort and sweep per node (see :func:`running_at_start`), not an n x n matrix.
    """
    frame = frame.copy()
    start = _started_seconds(frame)
    total = pd.to_numeric(frame["total_seconds"], errors="coerce").to_numpy(dtype="float64")
    end = start + np.where(np.isfinite(total) & (total >= 0), total, np.nan)
    pulling = (frame["cache_state"] == "none").to_numpy()  # a start of unknown tier is not counted as a pull
    node_counts = np.zeros(len(frame))
    for rows in frame.groupby(frame["node_id"].astype(str), sort=False).indices.values():
        node_counts[rows] = running_at_start(start[rows], end[rows])
    frame["concurrent_node_transfers"] = node_counts
    frame["concurrent_registry_pulls"] = running_at_start(start, end, counted=pulling)
    return frame


def load_cold_starts(engine: Engine, *, days: float | None = None, max_events: int | None = None,
                     until: datetime | None = None, conn=None) -> pd.DataFrame:
    """Events for :meth:`ColdStartModel.fit` from the ``cold_starts`` table: those of the ``days`` before the
    newest (or ``until``, where earlier), at most ``max_events`` of the newest (every one when None).

    Sizes come from ``serving_models``, node bandwidth from ``nodes`` (when
    the node reported one), concurrency from the events read
    (:func:`with_concurrency`). Rows are as stored; ``fit`` skips the bad ones.
    """
    from forecaster.store.coldstarts import read_cold_start_events

    frame = read_cold_start_events(engine, days=days, max_events=max_events, until=until, conn=conn)
    if frame.empty:
        return frame
    for column in ("total_seconds", *PHASES, "image_bytes", "weights_bytes", "node_bytes_per_s"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    return with_concurrency(frame)
