"""How requests arrive inside a minute: the burst factor the planner divides a replica's capacity by.

Per-minute counts hide the arrival process inside the minute. A replica that keeps up with a minute's mean rate
queues a 10-second burst at several times that rate, and on per-request LLM traces the planner sizes about half
as many replicas when it assumes even arrivals (Azure LLM code, cold cost 1: 12,751 against 25,177 GPU-seconds,
request wait p99 18.4 against 13.1 s; `bench/policies.py` with the factor held at 1).

The **burst factor** is a minute's peak 10-second request rate over its mean rate. It is smoothed exponentially
(weight :data:`BURST_ALPHA`) over the minutes with at least :data:`BURST_MIN_REQUESTS` requests, because fewer
requests cannot show a rate. A factor of 1 means even arrivals. The factor is at most :data:`MAX_BURST_FACTOR`
(6): every request of a minute falls in one 10-second bucket.

Three places share this one definition:

* the fleet simulator's serving layer, which measures the factor as requests arrive
  (:mod:`forecaster.simulation.engine`);
* the per-request trace readers, which measure it from the timestamps (:func:`burst_factors`) and store it in
  the catalogue (``serving_models.burst_factor``);
* the Prometheus ingest, which reads each minute's busiest 10-second count with a second query
  (``PREWARM_PROMETHEUS_BURST_QUERY_TEMPLATE``), and pushed rows that carry it (``peak_10s``): each such minute
  moves the stored factor once (:func:`smooth_burst_factors`, ``serving_models.burst_through``);
* the catalogue's bound on a declared value (``PUT /v1/models/{id}``, ``prewarm models register
  --burst-factor``).

The plan job reads the stored value. A model without one is planned as if its arrivals were even.
"""

from __future__ import annotations

import numpy as np

#: Width of the buckets whose peak defines a minute's burst, seconds.
BURST_BUCKET_S = 10.0
#: Minutes with fewer requests than this leave the factor as it was.
BURST_MIN_REQUESTS = 20
#: Weight of each new busy minute in the exponentially smoothed factor.
BURST_ALPHA = 0.2
#: Largest possible factor: all of a minute's requests in one bucket.
MAX_BURST_FACTOR = 60.0 / BURST_BUCKET_S


def update_burst_factor(burst: np.ndarray, minute_requests: np.ndarray, minute_peak_bucket: np.ndarray
                        ) -> np.ndarray:
    """The factors after one more minute with ``minute_requests`` requests, ``minute_peak_bucket`` of them in its
    busiest 10-second bucket (arrays per model)."""
    busy = minute_requests >= BURST_MIN_REQUESTS
    # a measured peak can only lie between the mean and the whole minute; a sampled one (Prometheus'
    # increase() extrapolates) may fall outside, and is read as the nearer bound
    ratio = np.clip(minute_peak_bucket * (60.0 / BURST_BUCKET_S) / np.maximum(minute_requests, 1.0),
                    1.0, MAX_BURST_FACTOR)
    return np.where(busy, (1 - BURST_ALPHA) * burst + BURST_ALPHA * ratio, burst)


def smooth_burst_factors(prior: np.ndarray, minute_requests: np.ndarray, minute_peak_bucket: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Factors after minutes of counts and peaks, oldest first: ``minute_requests`` and ``minute_peak_bucket``
    are (models, minutes), ``prior`` the factors before them (NaN: never measured, read as 1).

    Returns the factors and, per model, whether any of the minutes was busy enough to move its factor (a model
    without one keeps its prior, NaN included)."""
    requests = np.asarray(minute_requests, dtype="float64")
    peaks = np.asarray(minute_peak_bucket, dtype="float64")
    burst = np.where(np.isnan(prior), 1.0, np.asarray(prior, dtype="float64"))
    for minute in range(requests.shape[1]):
        burst = update_burst_factor(burst, requests[:, minute], peaks[:, minute])
    moved = (requests >= BURST_MIN_REQUESTS).any(axis=1)
    return np.where(moved, burst, prior), moved


def burst_factors(model_ids: np.ndarray, times_s: np.ndarray) -> dict[str, float]:
    """Per model with at least one busy minute, its factor after all of its requests (``times_s``: arrival
    times in seconds on any clock whose whole minutes are the minutes counted, such as seconds since the epoch).

    This is the serving layer's running factor, computed at once. Every busy minute of a model, oldest first,
    moves the factor from 1 by :func:`update_burst_factor`, which unrolls to
    ``(1 - a)^k + sum_j a (1 - a)^(k - 1 - j) ratio_j`` over its ``k`` busy minutes.
    """
    times_s = np.asarray(times_s, dtype="float64")
    if not len(times_s):
        return {}
    names, model_code = np.unique(np.asarray(model_ids).astype(str), return_inverse=True)
    minute = np.floor(times_s / 60.0).astype(np.int64)
    bucket = np.floor((times_s - minute * 60.0) / BURST_BUCKET_S).astype(np.int64)
    # requests per (model, minute, bucket), then per (model, minute): total and busiest bucket; one int64 key each
    buckets = int(round(60.0 / BURST_BUCKET_S))
    minutes = int(minute.max() - minute.min()) + 1
    cell = model_code.astype(np.int64) * minutes + (minute - minute.min())
    keys, per_bucket = np.unique(cell * buckets + np.minimum(bucket, buckets - 1), return_counts=True)
    cells, cell_of = np.unique(keys // buckets, return_inverse=True)
    requests = np.bincount(cell_of, weights=per_bucket)
    peak = np.zeros(len(requests))
    np.maximum.at(peak, cell_of, per_bucket)
    busy = requests >= BURST_MIN_REQUESTS
    model, ratio = (cells // minutes)[busy], (peak * (60.0 / BURST_BUCKET_S) / requests)[busy]
    # np.unique sorted the cells by (model, minute): each model's busy minutes are a run, oldest first
    models, first, k = np.unique(model, return_index=True, return_counts=True)
    run = np.repeat(np.arange(len(models)), k)
    age = np.repeat(first + k - 1, k) - np.arange(len(model))  # busy minutes after this one
    smoothed = (1.0 - BURST_ALPHA) ** k + np.bincount(
        run, weights=BURST_ALPHA * (1.0 - BURST_ALPHA) ** age * ratio, minlength=len(models))
    return {str(names[m]): float(f) for m, f in zip(models, smoothed)}
