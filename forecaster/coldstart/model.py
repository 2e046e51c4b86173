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
Rows the model cannot use (a start dated ``0001-01-01``, NaN or infinite
seconds) are skipped and counted (:func:`clean_events`), never raised.

Transfers (pre-pulls and pre-loads the node agents carried out, from the
``transfers`` table) are not cold starts: :class:`TransferRateMember` learns
the image pull and weight fetch rates (bytes/s) from them, and those rates set
the physics prior every other member corrects.

Members (the ensemble's member kinds, STYLE.md contract: ``__init__`` stores
settings, ``fit`` returns ``self``, fitted state ends in ``_``):

* :class:`TreePhaseMember`: one LightGBM per target (each phase and the
  total) on log seconds, features: cache tier, log sizes, node bandwidth, concurrency, hour,
  the bandwidth prior of :mod:`forecaster.coldstart.physics`, and the last and
  median recent cold start of the same model and tier;
* :class:`RecentLatencyMember`: per (model, tier), an exponentially weighted
  mean of the tree member's recent log errors: it tracks drift (a slower
  registry, a new image) between refits.

:class:`ColdStartModel` adds the second's correction to the first's log
prediction with a weight chosen on the last 20 % (by time) of the training
events; with fewer than ``min_events`` events it answers with the physics prior
alone (no data yet is a normal answer, not an error).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import lightgbm as lgb
import numpy as np
import pandas as pd
from sqlalchemy import Engine

from forecaster.coldstart.physics import phase_seconds
from forecaster.contracts.phases import PHASES, START_STATES
from forecaster.contracts.fleetconfig import FleetConfig

TARGETS = (*PHASES, "total_seconds")
STATE_RANKS = {"none": 0, "image": 1, "disk": 2, "host": 3, "gpu": 4, "sleeping": 4}
SHARED_FEATURES = ("state_rank", "log_image_bytes", "log_weights_bytes", "log_node_bandwidth",
                   "concurrent_node_transfers", "concurrent_registry_pulls", "hour_sin", "hour_cos",
                   "log_prior_total")
HISTORY_FEATURES = ("log_last_total", "log_median_total", "n_previous")
#: Per target: the shared features, the log prior of that target, the history of the same model and tier.
FEATURES = (*SHARED_FEATURES, "log_prior_phase", *HISTORY_FEATURES)
FILE_NAMES = {"metadata": "metadata.json", "booster": "{target}.txt"}


# --------------------------------------------------------------------------- features


#: A cold start stamped before this (UTC) is a broken clock, not an observation (e.g. ``0001-01-01``).
EARLIEST_STARTED_S = 946_684_800.0  # 2000-01-01T00:00:00Z
_EPOCH = pd.Timestamp("1970-01-01", tz="UTC")


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
    NaN, infinite or negative (``bad_total``); a phase that is infinite or
    negative (``bad_phase``; NaN means "not reported" and is kept); an infinite
    or negative size (``bad_size``). Adds ``started_s`` (seconds).

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
    bad_total = ~np.isfinite(total) | (total < 0)
    bad_phase = np.zeros(len(frame), dtype=bool)
    for phase in PHASES:
        if phase in frame.columns:
            values = pd.to_numeric(frame[phase], errors="coerce").to_numpy(dtype="float64")
            bad_phase |= np.isinf(values) | (values < 0)
            frame[phase] = values
    bad_size = np.zeros(len(frame), dtype=bool)
    for column in ("image_bytes", "weights_bytes"):
        if column in frame.columns:
            values = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype="float64")
            bad_size |= np.isinf(values) | (values < 0)
            frame[column] = values
    skipped = {}
    drop = np.zeros(len(frame), dtype=bool)
    for name, mask in (("bad_started_at", bad_start), ("bad_total", bad_total), ("bad_phase", bad_phase),
                       ("bad_size", bad_size)):
        mask = mask & ~drop  # each dropped row counted once, under its first reason
        if mask.any():
            skipped[name] = int(mask.sum())
        drop |= mask
    frame["total_seconds"] = total
    return frame[~drop].reset_index(drop=True), skipped


def prepare_events(events: pd.DataFrame, config: FleetConfig = FleetConfig(), *, history: bool = True
                   ) -> pd.DataFrame:
    """Sort events by start, fill optional columns, and add the features of :data:`FEATURES` (causal).

    History features use only earlier events of the same model and tier: the
    last total, the median of the last five, and how many there were.
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
    frame["cache_state"] = frame["cache_state"].fillna("none").astype(str)
    frame["state_rank"] = frame["cache_state"].map(STATE_RANKS).fillna(0).astype("float64")
    frame["log_image_bytes"] = np.log1p(frame["image_bytes"].fillna(0).astype("float64"))
    frame["log_weights_bytes"] = np.log1p(frame["weights_bytes"].fillna(0).astype("float64"))
    if "node_bytes_per_s" not in frame.columns:
        frame["node_bytes_per_s"] = np.nan
    frame["node_bytes_per_s"] = pd.to_numeric(frame["node_bytes_per_s"], errors="coerce").astype("float64") \
        .fillna(config.node_nic_bytes_per_s)
    frame["log_node_bandwidth"] = np.log(frame["node_bytes_per_s"])
    frame["hour_sin"] = np.sin(2 * np.pi * frame["hour"] / 24.0)
    frame["hour_cos"] = np.cos(2 * np.pi * frame["hour"] / 24.0)
    prior = phase_seconds(frame["image_bytes"].fillna(0).to_numpy(), frame["weights_bytes"].fillna(0).to_numpy(),
                          np.minimum(frame["state_rank"].to_numpy(), 3).astype(np.int64),
                          concurrent=frame["concurrent_node_transfers"].to_numpy(),
                          registry_pulls=frame["concurrent_registry_pulls"].to_numpy(),
                          hour=frame["hour"].to_numpy(), node_bytes_per_s=frame["node_bytes_per_s"].to_numpy(),
                          config=config)
    frame["log_prior_total"] = np.log1p(prior["total_s"])
    for phase in PHASES:
        frame[f"prior_{phase}"] = prior[phase]
    if not history:
        return frame
    keys = [frame["model_id"], frame["cache_state"]]
    group = frame.groupby(keys, sort=False)["total_seconds"]
    previous = group.shift(1)
    frame["log_last_total"] = np.log1p(previous)
    median = previous.groupby(keys, sort=False).rolling(5, min_periods=1).median()
    frame["log_median_total"] = np.log1p(median.reset_index(level=[0, 1], drop=True).sort_index())
    frame["n_previous"] = group.cumcount().astype("float64")
    return frame


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
                 min_child_samples: int = 10, seed: int = 0):
        self.params = {"n_estimators": n_estimators, "learning_rate": learning_rate, "num_leaves": num_leaves,
                       "min_child_samples": min_child_samples, "subsample": 0.8, "subsample_freq": 1,
                       "colsample_bytree": 0.9, "random_state": seed, "n_jobs": 2, "verbose": -1}

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

    def predict_log(self, frame: pd.DataFrame) -> dict[str, np.ndarray]:
        """log1p seconds per target; the bandwidth prior where no booster was fitted."""
        out = {}
        for target in TARGETS:
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
    """Per (model, tier): exponentially weighted mean of recent log errors of the tree member."""

    name = "recent"

    def __init__(self, alpha: float = 0.3):
        self.alpha = alpha

    def fit(self, keys: list[tuple[str, str]], log_errors: np.ndarray) -> "RecentLatencyMember":
        self.level_: dict[tuple[str, str], float] = {}
        for key, err in zip(keys, log_errors):
            self.observe(key, float(err))
        return self

    def observe(self, key: tuple[str, str], log_error: float) -> None:
        prev = self.level_.get(key)
        self.level_[key] = log_error if prev is None else (1 - self.alpha) * prev + self.alpha * log_error

    def correction(self, keys: list[tuple[str, str]]) -> np.ndarray:
        return np.array([self.level_.get(k, 0.0) for k in keys])


class TransferRateMember:
    """Image pull and weight fetch rates (bytes/s) learned from the transfers the node agents carried out.

    A pre-pull measures ``image_pull_s`` for ``bytes`` of image, a pre-load
    ``weight_fetch_s`` for ``bytes`` of weights: the same phases a cold start
    from nothing pays, measured without a replica waiting. The rate per phase
    is the geometric mean of the last ``max_transfers`` observed rates, shrunk
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
                rates = (size[ok] / seconds[ok])[-self.max_transfers:]
            n = len(rates)
            log_rate = (np.log(rates).sum() + self.prior_weight * np.log(prior)) / (n + self.prior_weight)
            self.rates_[field_name] = float(np.exp(log_rate))
            self.n_[phase] = int(n)
        return self

    def config_for(self, config: FleetConfig) -> FleetConfig:
        """``config`` with the learned rates in place of the prior's."""
        return replace(config, **self.rates_)


# --------------------------------------------------------------------------- the model


@dataclass
class ColdStartModel:
    """Trees + recent-error correction; physics prior when there are too few events."""

    config: FleetConfig = FleetConfig()
    min_events: int = 30
    validation_share: float = 0.2
    weights_grid: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
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
        self.history_ = frame[["model_id", "cache_state", "started_s", "total_seconds"]].copy()
        if len(frame) < self.min_events:
            return self
        cut = int(len(frame) * (1 - self.validation_share))
        head, tail = frame.iloc[:cut], frame.iloc[cut:]
        trees = TreePhaseMember(**(self.tree_params or {})).fit(head)
        # choose the recent member's weight on the held-out tail, walking forward through it
        keys_head = list(zip(head["model_id"], head["cache_state"]))
        err_head = np.log1p(head["total_seconds"].to_numpy()) - trees.predict_log(head)["total_seconds"]
        best_w, best_err = 0.0, np.inf
        base_tail = trees.predict_log(tail)["total_seconds"]
        for w in self.weights_grid:
            recent = RecentLatencyMember().fit(keys_head, err_head)
            errors = []
            for key, base, actual in zip(zip(tail["model_id"], tail["cache_state"]), base_tail,
                                         tail["total_seconds"].to_numpy()):
                pred = np.expm1(base + w * recent.level_.get(key, 0.0))
                errors.append(abs(pred - actual))
                recent.observe(key, float(np.log1p(actual) - base))
            if np.mean(errors) < best_err - 1e-12:
                best_w, best_err = w, float(np.mean(errors))
        self.weight_ = best_w
        self.trees_ = TreePhaseMember(**(self.tree_params or {})).fit(frame)
        keys = list(zip(frame["model_id"], frame["cache_state"]))
        errors = np.log1p(frame["total_seconds"].to_numpy()) - self.trees_.predict_log(frame)["total_seconds"]
        self.recent_ = RecentLatencyMember().fit(keys, errors)
        return self

    @property
    def fitted_config(self) -> FleetConfig:
        """The fleet physics with the rates learned from transfers (the prior's own before ``fit``)."""
        return getattr(self, "config_", self.config)

    def observe(self, events: pd.DataFrame) -> None:
        """Condition on newer cold starts without refitting (history and recent errors)."""
        events, _ = clean_events(events)
        if not len(events):
            return
        frame = self._with_history(events)
        if self.trees_ is not None:
            base = self.trees_.predict_log(frame)["total_seconds"]
            for key, b, actual in zip(zip(frame["model_id"], frame["cache_state"]), base,
                                      frame["total_seconds"].to_numpy()):
                self.recent_.observe(key, float(np.log1p(actual) - b))
        self.history_ = pd.concat([self.history_, frame[["model_id", "cache_state", "started_s", "total_seconds"]]],
                                  ignore_index=True)

    def _with_history(self, events: pd.DataFrame) -> pd.DataFrame:
        """Features for ``events`` with history from everything already seen plus earlier rows of ``events``."""
        new = events.copy()
        new["started_s"] = _started_seconds(new)
        if "total_seconds" not in new.columns:
            new["total_seconds"] = np.nan
        keys = ["model_id", "cache_state"]
        new["cache_state"] = new["cache_state"].fillna("none").astype(str)
        if not new.duplicated(keys).any():
            # each (model, tier) once: history statistics straight from what was seen (the planner's case)
            prepared = prepare_events(new, self.fitted_config, history=False)
            seen = self.history_.sort_values("started_s", kind="stable")
            stats = seen.groupby(keys)["total_seconds"].agg(last="last", n="size")
            stats["median"] = seen.groupby(keys).tail(5).groupby(keys)["total_seconds"].median()
            joined = stats.reindex(pd.MultiIndex.from_frame(prepared[keys]))
            prepared["log_last_total"] = np.log1p(joined["last"].to_numpy(dtype="float64"))
            prepared["log_median_total"] = np.log1p(joined["median"].to_numpy(dtype="float64"))
            prepared["n_previous"] = joined["n"].fillna(0).to_numpy(dtype="float64")
            return prepared
        seen = self.history_.assign(_known=True)
        both = pd.concat([seen, new.assign(_known=False)], ignore_index=True, sort=False)
        for column in ("image_bytes", "weights_bytes"):
            if column not in both.columns:
                both[column] = 0.0
        prepared = prepare_events(both.drop(columns=[c for c in ("started_at",) if c in both.columns]),
                                  self.fitted_config)
        return prepared[~prepared["_known"].astype(bool)].reset_index(drop=True)

    def predict(self, events: pd.DataFrame) -> pd.DataFrame:
        """Predicted seconds per phase and ``total_seconds`` for each row of ``events`` (order kept)."""
        events = events.reset_index(drop=True).assign(_row=lambda f: np.arange(len(f)))
        frame = self._with_history(events)
        if self.trees_ is None:
            out = pd.DataFrame({p: frame[f"prior_{p}"] for p in PHASES})
            out["total_seconds"] = np.expm1(frame["log_prior_total"])
        else:
            logs = self.trees_.predict_log(frame)
            keys = list(zip(frame["model_id"], frame["cache_state"]))
            correction = self.weight_ * self.recent_.correction(keys)
            out = pd.DataFrame({t: np.maximum(np.expm1(logs[t]), 0.0) for t in PHASES})
            out["total_seconds"] = np.maximum(np.expm1(logs["total_seconds"] + correction), 0.0)
        out["_row"] = frame["_row"].to_numpy()
        return out.sort_values("_row").drop(columns="_row").reset_index(drop=True)

    def latency_table(self, models: pd.DataFrame, *, hour: int, concurrent: float = 0.0,
                      registry_pulls: float = 0.0) -> pd.DataFrame:
        """Planner latency input for every model (index ``model_id``, ``image_bytes``, ``weights_bytes``) and state."""
        rows = pd.DataFrame({
            "model_id": np.repeat(models.index.astype(str).to_numpy(), len(START_STATES)),
            "cache_state": np.tile(np.array(START_STATES, dtype=object), len(models)),
            "image_bytes": np.repeat(models["image_bytes"].to_numpy(dtype="float64"), len(START_STATES)),
            "weights_bytes": np.repeat(models["weights_bytes"].to_numpy(dtype="float64"), len(START_STATES)),
            "concurrent_node_transfers": concurrent, "concurrent_registry_pulls": registry_pulls, "hour": hour,
            "node_id": "-",
        })
        last = float(self.history_["started_s"].max()) + 1.0 if len(self.history_) else 0.0
        rows["started_s"] = last
        pred = self.predict(rows)
        out = pd.DataFrame({"model_id": rows["model_id"], "state": rows["cache_state"],
                            "total_s": pred["total_seconds"].to_numpy()})
        for phase in PHASES:
            out[phase] = pred[phase].to_numpy()
        return out

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
        meta = {"kind": "coldstart", "n_events": self.n_events_, "weight": self.weight_, "targets": targets,
                "min_events": self.min_events, "skipped": getattr(self, "skipped_", {}),
                "n_transfers": getattr(self, "n_transfers_", 0),
                "rates": {} if getattr(self, "rates_", None) is None else self.rates_.rates_,
                "rate_observations": {} if getattr(self, "rates_", None) is None else self.rates_.n_,
                "recent": [[k[0], k[1], v] for k, v in self.recent_.level_.items()]}
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
        model.skipped_ = meta.get("skipped", {})
        model.n_transfers_ = meta.get("n_transfers", 0)
        model.rates_ = TransferRateMember()
        model.rates_.rates_ = dict(meta.get("rates", {}))
        model.rates_.n_ = dict(meta.get("rate_observations", {}))
        model.config_ = model.rates_.config_for(config)
        model.recent_ = RecentLatencyMember()
        model.recent_.level_ = {(m, s): v for m, s, v in meta["recent"]}
        model.history_ = pd.read_csv(folder / "history.csv.gz", dtype={"model_id": str, "cache_state": str})
        model.trees_ = None
        if meta["targets"]:
            trees = TreePhaseMember()
            trees.boosters_ = {t: lgb.Booster(model_file=str(folder / FILE_NAMES["booster"].format(target=t)))
                               for t in meta["targets"]}
            model.trees_ = trees
        return model


# --------------------------------------------------------------------------- baselines and the store


def baseline_predictions(train: pd.DataFrame, test: pd.DataFrame) -> pd.DataFrame:
    """Last value and trailing median (last 5) of the same (model, tier), walking forward through ``test``.

    Falls back to the same statistic over all models in that tier, then over all
    events, when the pair has no history yet.
    """
    both = pd.concat([train.assign(_test=False), test.assign(_test=True)], ignore_index=True)
    both["started_s"] = _started_seconds(both)
    both = both.sort_values("started_s", kind="stable").reset_index(drop=True)
    last, median = [], []
    by_pair: dict[tuple[str, str], list[float]] = {}
    by_state: dict[str, list[float]] = {}
    everything: list[float] = []
    for model_id, state, total, is_test in zip(both["model_id"], both["cache_state"], both["total_seconds"],
                                               both["_test"]):
        history = by_pair.get((model_id, state)) or by_state.get(state) or everything or [np.nan]
        if is_test:
            last.append(history[-1])
            median.append(float(np.median(history[-5:])))
        by_pair.setdefault((model_id, state), []).append(total)
        by_state.setdefault(state, []).append(total)
        everything.append(total)
    tested = both[both["_test"]]
    return pd.DataFrame({"model_id": tested["model_id"].to_numpy(), "started_s": tested["started_s"].to_numpy(),
                         "actual": tested["total_seconds"].to_numpy(), "last_value": last, "trailing_median": median})


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
    pulling = (frame["cache_state"].fillna("none") == "none").to_numpy()
    node_counts = np.zeros(len(frame))
    for rows in frame.groupby(frame["node_id"].astype(str), sort=False).indices.values():
        node_counts[rows] = running_at_start(start[rows], end[rows])
    frame["concurrent_node_transfers"] = node_counts
    frame["concurrent_registry_pulls"] = running_at_start(start, end, counted=pulling)
    return frame


def load_cold_starts(engine: Engine) -> pd.DataFrame:
    """Events for :meth:`ColdStartModel.fit` from the ``cold_starts`` table.

    Sizes come from ``serving_models``, node bandwidth from ``nodes`` (when
    the node reported one), concurrency from the table itself
    (:func:`with_concurrency`). Rows are as stored; ``fit`` skips the bad ones.
    """
    from forecaster.store.coldstarts import read_cold_start_events

    frame = read_cold_start_events(engine)
    if frame.empty:
        return frame
    for column in ("total_seconds", *PHASES, "image_bytes", "weights_bytes", "node_bytes_per_s"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    return with_concurrency(frame)
