"""Check the latency model's member kinds on real cold starts: AWS Lambda's daily measurements.

``lambda_perf_coldstarts_daily.csv.gz`` (maxday/lambda-perf, Apache-2.0) holds,
per day and runtime configuration (runtime x package type x memory x
architecture), about ten measured ``Init Duration`` values and their mean.
The task: on each day, forecast each configuration's mean cold start on its
next measured day. Members:

* ``last_value`` and ``trailing_median`` (last 7 measured days): the baselines;
* ``recent`` (time-series member): an exponentially weighted mean of the log
  cold start (alpha 0.3);
* ``trees``: LightGBM on the log ratio of the next day to the trailing median,
  from lags (last, median and mean of 7 and 28, spread, EWMA, the day's own
  samples' spread), the gap in days, weekday, memory, package type,
  architecture and runtime family;
* ``ensemble``: trees, recent and the trailing median averaged in log space,
  with the weights (a grid of quarters) that do best on the last 10 % of the
  fit period.

Protocol (EVALUATION.md section 1 in spirit): parameters are fitted once on
targets before ``split_date``; later forecasts condition on the latest lags but
never refit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import lightgbm as lgb
import numpy as np
import pandas as pd

LAMBDA_FILE = "aws_lambda_coldstarts_lambda_perf/lambda_perf_coldstarts_daily.csv.gz"
TREE_FEATURES = ("log_last", "log_med7", "log_mean7", "log_med28", "std7", "log_ewma", "sample_spread", "gap_days",
                 "weekday", "memory_mb", "package", "arch", "family", "n_obs")


def _family(runtime_id: str) -> str:
    name = runtime_id.removeprefix("lambda-perf-")
    match = re.match(r"[a-z]+", name)
    return match.group(0) if match else name


def load_lambda(path: str | Path, *, configs: int | None = None, seed: int = 0) -> pd.DataFrame:
    """Configuration-days with ``config``, ``date``, ``y`` (mean init ms) and static attributes.

    Args:
        configs: keep a random subset of this many configurations (for quick checks).
    """
    frame = pd.read_csv(path, usecols=["date", "runtime_id", "package_type", "memory_mb", "architecture",
                                       "init_durations_ms", "avg_cold_start_ms"])
    frame["package_type"] = frame["package_type"].fillna("-")
    frame["architecture"] = frame["architecture"].fillna("-")
    frame["config"] = (frame["runtime_id"] + "|" + frame["package_type"] + "|" + frame["memory_mb"].astype(str)
                       + "|" + frame["architecture"])
    if configs is not None:
        chosen = pd.Series(frame["config"].unique()).sample(n=min(configs, frame["config"].nunique()),
                                                            random_state=seed)
        frame = frame[frame["config"].isin(set(chosen))]
    frame["date"] = pd.to_datetime(frame["date"])
    samples = frame["init_durations_ms"].astype(str).str.split(";")
    spread = samples.map(lambda v: np.std(np.log([float(x) for x in v if x])) if len(v) > 1 else 0.0)
    out = pd.DataFrame({"config": frame["config"], "date": frame["date"], "y": frame["avg_cold_start_ms"],
                        "memory_mb": frame["memory_mb"], "package": frame["package_type"],
                        "arch": frame["architecture"], "family": frame["runtime_id"].map(_family),
                        "sample_spread": spread})
    out = out.groupby(["config", "date"], as_index=False).agg(
        y=("y", "mean"), memory_mb=("memory_mb", "first"), package=("package", "first"), arch=("arch", "first"),
        family=("family", "first"), sample_spread=("sample_spread", "mean"))
    return out.sort_values(["config", "date"]).reset_index(drop=True)


def lag_features(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration-day ``d`` with lags up to ``d`` and the target: the next measured day."""
    f = frame.copy()
    g = f.groupby("config", sort=False)["y"]
    logy = np.log(f["y"])
    lg = logy.groupby(f["config"], sort=False)
    f["log_last"] = logy
    f["log_med7"] = np.log(g.transform(lambda s: s.rolling(7, min_periods=1).median()))
    f["log_mean7"] = lg.transform(lambda s: s.rolling(7, min_periods=1).mean())
    f["log_med28"] = np.log(g.transform(lambda s: s.rolling(28, min_periods=1).median()))
    f["std7"] = lg.transform(lambda s: s.rolling(7, min_periods=2).std()).fillna(0.0)
    f["log_ewma"] = lg.transform(lambda s: s.ewm(alpha=0.3, adjust=False).mean())
    f["n_obs"] = g.cumcount().astype("float64")
    f["target_date"] = f.groupby("config", sort=False)["date"].shift(-1)
    f["target"] = g.shift(-1)
    f["gap_days"] = (f["target_date"] - f["date"]).dt.days
    f["weekday"] = f["target_date"].dt.day_of_week
    for column in ("package", "arch", "family"):
        f[column] = f[column].astype("category")
    return f[f["target"].notna()].reset_index(drop=True)


@dataclass
class LambdaLatencyModel:
    """Trees + recent member for next-day cold starts (see the module docstring)."""

    n_estimators: int = 300
    learning_rate: float = 0.05
    num_leaves: int = 31
    min_child_samples: int = 50
    validation_share: float = 0.1

    def _x(self, f: pd.DataFrame) -> pd.DataFrame:
        return f[list(TREE_FEATURES)]

    def fit(self, rows: pd.DataFrame) -> "LambdaLatencyModel":
        rows = rows.sort_values("target_date")
        self.categories_ = {c: rows[c].cat.categories for c in ("package", "arch", "family")}
        cut = rows["target_date"].quantile(1 - self.validation_share)
        head, tail = rows[rows["target_date"] < cut], rows[rows["target_date"] >= cut]
        trees = self._booster(head)
        members = np.column_stack([trees.predict(self._x(tail)) + tail["log_med7"].to_numpy(),
                                   tail["log_ewma"].to_numpy(), tail["log_med7"].to_numpy()])
        best_w, best = (1.0, 0.0, 0.0), np.inf
        quarters = [w / 4 for w in range(5)]
        for w_trees in quarters:
            for w_recent in quarters:
                w = (w_trees, w_recent, 1.0 - w_trees - w_recent)
                if w[2] < -1e-9:
                    continue
                err = np.mean(np.abs(np.exp(members @ np.array(w)) - tail["target"].to_numpy()))
                if err < best - 1e-12:
                    best_w, best = w, err
        self.weights_ = best_w
        self.weight_ = best_w[0]
        self.booster_ = self._booster(rows)
        return self

    def _booster(self, rows: pd.DataFrame) -> lgb.LGBMRegressor:
        model = lgb.LGBMRegressor(n_estimators=self.n_estimators, learning_rate=self.learning_rate,
                                  num_leaves=self.num_leaves, min_child_samples=self.min_child_samples,
                                  subsample=0.8, subsample_freq=1, colsample_bytree=0.8, n_jobs=2, verbose=-1,
                                  random_state=0)
        model.fit(self._x(rows), np.log(rows["target"].to_numpy()) - rows["log_med7"].to_numpy())
        return model

    def predict(self, rows: pd.DataFrame) -> pd.DataFrame:
        rows = rows.copy()
        for c, cats in self.categories_.items():
            rows[c] = pd.Categorical(rows[c].astype(str), categories=cats)
        trees = np.exp(self.booster_.predict(self._x(rows)) + rows["log_med7"].to_numpy())
        recent = np.exp(rows["log_ewma"].to_numpy())
        w_trees, w_recent, w_median = self.weights_
        ensemble = np.exp(w_trees * np.log(trees) + w_recent * np.log(recent) + w_median * rows["log_med7"].to_numpy())
        return pd.DataFrame({"trees": trees, "recent": recent, "ensemble": ensemble,
                             "last_value": np.exp(rows["log_last"].to_numpy()),
                             "trailing_median": np.exp(rows["log_med7"].to_numpy())}, index=rows.index)


def evaluate_lambda(path: str | Path, *, split_date: str = "2025-06-01", configs: int | None = None,
                    model: LambdaLatencyModel | None = None) -> dict:
    """Fit before ``split_date``, forecast every later next-day cold start; MAE and MAPE per method.

    Returns:
        ``{"rows_fit", "rows_test", "configs", "weight", "methods": {name: {"mae_ms", "mape_pct",
        "median_ape_pct", "win_rate_vs_last", "win_rate_vs_median"}}}``.
    """
    frame = load_lambda(path, configs=configs)
    rows = lag_features(frame)
    split = pd.Timestamp(split_date)
    fit_rows, test_rows = rows[rows["target_date"] < split], rows[rows["target_date"] >= split]
    model = (model or LambdaLatencyModel()).fit(fit_rows)
    pred = model.predict(test_rows)
    actual = test_rows["target"].to_numpy()
    methods = {}
    err = {name: np.abs(pred[name].to_numpy() - actual) for name in pred.columns}
    for name in pred.columns:
        methods[name] = {
            "mae_ms": float(err[name].mean()),
            "mape_pct": float((err[name] / actual).mean() * 100),
            "median_ape_pct": float(np.median(err[name] / actual) * 100),
            "win_rate_vs_last": float((err[name] < err["last_value"]).mean()),
            "win_rate_vs_median": float((err[name] < err["trailing_median"]).mean()),
        }
    return {"rows_fit": int(len(fit_rows)), "rows_test": int(len(test_rows)),
            "configs": int(frame["config"].nunique()), "split_date": split_date,
            "ensemble_weights": dict(zip(("trees", "recent", "trailing_median"), model.weights_)),
            "methods": methods}


def lambda_sampling_floor(path: str | Path, *, split_date: str = "2025-06-01") -> dict:
    """The error no forecaster can go below on the Lambda test days: the sampling noise of each day's mean.

    Each configuration-day's target is the mean of about ten measured cold starts, so even a forecaster that knew
    the configuration's true mean for that day would miss the observed mean by the sampling error of ten draws.
    Two estimates of that error's expectation ``E|mean - mu|`` over the days :func:`evaluate_lambda` scores
    (configuration-days on or after ``split_date`` with an earlier measured day):

    * ``normal_ms``: ``sqrt(2 / pi) * sd / sqrt(n)`` per day, the normal approximation of the mean's error;
    * ``split_half_ms``: half of ``|mean(odd draws) - mean(even draws)|`` per day (days with >= 4 draws), which
      makes no assumption about the draws' distribution beyond independence: the difference of the two half
      means has twice the spread of the full mean's error.

    Returns:
        ``{"days", "median_draws", "normal_ms", "split_half_ms"}``.
    """
    frame = pd.read_csv(path, usecols=["date", "runtime_id", "package_type", "memory_mb", "architecture",
                                       "init_durations_ms"])
    config = (frame["runtime_id"] + "|" + frame["package_type"].fillna("-") + "|" + frame["memory_mb"].astype(str)
              + "|" + frame["architecture"].fillna("-"))
    draws = frame["init_durations_ms"].astype(str).str.split(";").map(
        lambda v: [float(x) for x in v if x and x != "nan"])
    days = pd.DataFrame({"config": config, "date": pd.to_datetime(frame["date"]), "draws": draws})
    days = days.groupby(["config", "date"], as_index=False)["draws"].agg(lambda v: [x for d in v for x in d])
    days = days.sort_values(["config", "date"])
    scored = (days["date"] >= pd.Timestamp(split_date)) & days.duplicated("config", keep="first")
    normal, split_half, counts = [], [], []
    for values in days.loc[scored, "draws"]:
        x = np.asarray(values, dtype=np.float64)
        counts.append(len(x))
        if len(x) >= 2:
            normal.append(np.sqrt(2.0 / np.pi) * x.std(ddof=1) / np.sqrt(len(x)))
        if len(x) >= 4:
            split_half.append(abs(x[::2].mean() - x[1::2].mean()) / 2.0)
    return {"days": int(scored.sum()), "median_draws": float(np.median(counts)) if counts else 0.0,
            "normal_ms": float(np.mean(normal)) if normal else float("nan"),
            "split_half_ms": float(np.mean(split_half)) if split_half else float("nan")}
