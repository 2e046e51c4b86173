"""A large, deterministic fleet of per-minute invocation series resampled from real traces.

Scale benchmarks need far more models than any public trace holds (the Azure
Functions 2019 sample has 1,350 functions). This module builds a fleet of
``n_models`` series, each one a *transformed copy of a real series*:

* **pools** (where a series comes from): the Azure Functions 2019 one-day sample
  (1,350 functions, native 1-minute counts) is the main pool; the Huawei Cloud
  5-minute channels (8 channels x 30 days = 240 channel-days) and the per-minute
  arrival counts of the LLM per-request traces (Azure LLM 2023 code and conv,
  Mooncake) are minor pools. :data:`DEFAULT_POOL_WEIGHTS` gives the mix; see
  ``docs/fleet-generator.md`` for why.
* **shift**: a circular roll of the source day by a random number of minutes.
* **scale**: a log-normal factor applied to integer counts by binomial thinning
  (factor < 1) or by adding a Poisson excess to the non-zero minutes
  (factor > 1), so a zero minute stays zero and zero-heavy series stay
  zero-heavy. Minor-pool series are first brought to the volume of a randomly
  drawn Azure function (their sources are whole services with 10^4-10^6
  requests a day, not single models).
* **mix**: a fraction of the models are the sum of two such series, the second
  carrying a share ``mix_weight`` of the volume.

Model ``i`` depends only on ``(seed, i)`` and the source pools: it draws from
its own random generator, the ``i``-th child of ``SeedSequence(seed)``. So the
first 10,000 models of a 100,000 fleet equal the 10,000 fleet, and the chunk
size never changes a series.

The fleet comes out in chunks (:func:`generate_fleet`), so 100,000 x 1,440 is
never one array; :func:`fleet_batches` turns chunks into
:class:`~forecaster.contracts.batches.CountBatch` objects for
:func:`forecaster.store.invocations.write_count_batch`, and
:func:`write_fleet_parquet` into the generic long format (``unique_id, ds, y``)
that ``prewarm ingest trace`` reads.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd

from forecaster.contracts.batches import CountBatch
from forecaster.ingest.traces import read_trace

DAY_MINUTES = 1440
#: Time of minute 0 of a generated fleet unless ``start=`` says otherwise (a fixed UTC midnight).
DEFAULT_START = datetime(2024, 1, 1, tzinfo=timezone.utc)
#: Coverage source name of the batches :func:`fleet_batches` yields.
FLEET_SOURCE = "fleetgen"
#: Share of the models whose primary series comes from each pool (renormalised over the pools present).
DEFAULT_POOL_WEIGHTS: Mapping[str, float] = {"azure2019": 0.90, "huawei5min": 0.08, "llm": 0.02}
#: Share of the models that are the sum of two series.
DEFAULT_MIX_FRACTION = 0.2
#: The second series of a mixed model carries this share of its volume, uniform in the range.
MIX_WEIGHT_RANGE = (0.1, 0.5)
#: Standard deviation of the log of the scale factor (median factor 1).
DEFAULT_SCALE_SIGMA = 0.5
#: Quantiles of the per-model daily totals reported by :func:`fleet_summary`.
SUMMARY_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)

AZURE2019_FILE = Path("azure_functions_2019_sample1350") / "invocations_per_function_1day_1350fn.csv.gz"
HUAWEI_FILE = Path("huawei_cloud_5min_dc4") / "datacentre_4.csv.gz"
LLM_FILES = (
    Path("azure_llm_inference_2023") / "AzureLLMInferenceTrace_code.csv",
    Path("azure_llm_inference_2023") / "AzureLLMInferenceTrace_conv.csv",
    Path("mooncake_kimi_fast25") / "conversation_trace.jsonl.gz",
)
POOL_NAMES = ("azure2019", "huawei5min", "llm")

_MINUTE_NS = 60_000_000_000
_INT32_MAX = np.iinfo(np.int32).max


class FleetgenWarning(UserWarning):
    """A source pool was missing and the generator used less (or a sample)."""


# --------------------------------------------------------------------------- source pools


@dataclass(frozen=True)
class SourcePool:
    """Real day series of one pool.

    Attributes:
        name: ``azure2019``, ``huawei5min`` or ``llm``.
        ids: (n,) source series names (Azure: ``HashFunction``; Huawei:
            ``<channel>@<date>``; LLM: ``<format>:<service>``).
        series: (n, steps) int64 counts of one day; ``steps`` is 1,440 for
            1-minute pools and 288 for the Huawei 5-minute pool. LLM series hold
            the traced hour in their first minutes and zeros after it.
        step_minutes: minutes per step (1 or 5).
        files: the trace files read.
    """

    name: str
    ids: np.ndarray
    series: np.ndarray
    step_minutes: int
    files: tuple[str, ...]

    @functools.cached_property
    def totals(self) -> np.ndarray:
        """(n,) int64 day total of each series."""
        return self.series.sum(axis=1)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class SourcePools:
    """The pools found for one traces directory.

    Attributes:
        pools: pool name -> :class:`SourcePool`, only the pools found.
        traces_dir: the directory searched.
        fallback: the Azure 2019 pool is the shipped top-100 sample, not the
            1,350-function day.
        missing: messages naming each pool that was not found.
    """

    pools: dict[str, SourcePool]
    traces_dir: Path
    fallback: bool
    missing: tuple[str, ...] = field(default=())

    @property
    def volume_totals(self) -> np.ndarray:
        """Daily totals of the main pool's series; minor-pool series are brought to one of these."""
        return self.pools["azure2019"].totals


def _azure2019_pool(path: Path) -> SourcePool:
    trace = read_trace(path, fmt="azure2019")
    raw = trace.raw
    n_rows = int(raw["row"].max())
    n_cols = len(raw) // n_rows
    if n_rows * n_cols != len(raw) or n_cols != DAY_MINUTES:
        raise ValueError(f"{path}: expected {DAY_MINUTES} minute columns per function, found {len(raw) / n_rows:g}")
    values = _whole_counts(raw["y"], path).reshape(n_rows, n_cols)
    order = np.argsort(_ns(raw["ds"].iloc[:n_cols]), kind="stable")  # minute columns in time order
    ids = raw["unique_id"].iloc[::n_cols].astype(str).to_numpy(dtype=str)
    return SourcePool("azure2019", ids, values[:, order], 1, (str(path),))


def _huawei_pool(path: Path) -> SourcePool:
    """Each (channel, calendar day) with all 288 five-minute bins becomes one series."""
    trace = read_trace(path, fmt="huawei5min")
    raw = trace.raw
    values = _whole_counts(raw["y"], path)
    ds_ns = _ns(raw["ds"])
    day_ns = 1440 * _MINUTE_NS
    day = ds_ns // day_ns
    slot = (ds_ns % day_ns) // (5 * _MINUTE_NS)
    channel_codes, channels = pd.factorize(raw["unique_id"].astype(str), sort=False)
    day_codes, days = pd.factorize(day, sort=True)
    cells = np.zeros((len(channels), len(days), 288), dtype="int64")
    seen = np.zeros_like(cells, dtype=bool)
    cells[channel_codes, day_codes, slot] = values
    seen[channel_codes, day_codes, slot] = True
    complete = seen.all(axis=2)  # (channel, day)
    ch, dy = np.nonzero(complete)
    dates = pd.to_datetime(np.asarray(days, dtype="int64") * day_ns).strftime("%Y-%m-%d")
    ids = np.array([f"{channels[c]}@{dates[d]}" for c, d in zip(ch, dy)], dtype=str)
    return SourcePool("huawei5min", ids, cells[ch, dy], 5, (str(path),))


def _llm_pool(paths: list[Path]) -> SourcePool:
    """Per-minute arrivals of each per-request trace: the traced hour, then zeros."""
    ids, rows = [], []
    for path in paths:
        trace = read_trace(path)
        raw, window = trace.raw, trace.windows
        start_ns = _ns(window["start"])[0]
        ds_ns = _ns(raw["ds"])
        minute = (ds_ns - start_ns) // _MINUTE_NS
        keep = minute < DAY_MINUTES  # every trace here is about an hour; a longer one is cut to a day
        row = np.zeros(DAY_MINUTES, dtype="int64")
        row[minute[keep]] = _whole_counts(raw["y"], path)[keep]
        fmt = trace.source.split(":", 1)[1]
        ids.append(f"{fmt}:{window['unique_id'].iloc[0]}")
        rows.append(row)
    return SourcePool("llm", np.array(ids, dtype=str), np.vstack(rows), 1, tuple(str(p) for p in paths))


def _ns(stamps: pd.Series) -> np.ndarray:
    """UTC timestamps as int64 ns since the epoch (no per-element Timestamp objects)."""
    return stamps.dt.tz_convert(None).to_numpy().astype("datetime64[ns]").view("int64")


def _whole_counts(y: pd.Series, path: Path) -> np.ndarray:
    values = pd.to_numeric(y, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)
    if not np.isfinite(values).all() or (values < 0).any() or (values != np.floor(values)).any():
        raise ValueError(f"{path}: counts must be finite, non-negative whole numbers")
    return values.astype("int64")


@functools.lru_cache(maxsize=4)
def _load_pools_cached(traces_dir: str) -> SourcePools:
    root = Path(traces_dir)
    pools: dict[str, SourcePool] = {}
    missing: list[str] = []
    fallback = False
    azure = root / AZURE2019_FILE
    if azure.is_file():
        pools["azure2019"] = _azure2019_pool(azure)
    else:
        from forecaster.data import AZURE2019_TOP100, sample_path

        sample = sample_path(AZURE2019_TOP100)
        pools["azure2019"] = _azure2019_pool(sample)
        fallback = True
        missing.append(
            f"{azure} not found: the main pool is the shipped sample {sample.name} (the 100 busiest of the "
            "1,350 functions), so the fleet is busier and less zero-heavy than one from the full day"
        )
    huawei = root / HUAWEI_FILE
    if huawei.is_file():
        pools["huawei5min"] = _huawei_pool(huawei)
    else:
        missing.append(f"{huawei} not found: no huawei5min pool")
    llm = [root / p for p in LLM_FILES if (root / p).is_file()]
    if llm:
        pools["llm"] = _llm_pool(llm)
    else:
        missing.append(f"none of {[str(p) for p in LLM_FILES]} found under {root}: no llm pool")
    return SourcePools(pools=pools, traces_dir=root, fallback=fallback, missing=tuple(missing))


def load_pools(traces_dir: str | Path | None = None) -> SourcePools:
    """Read the source pools under ``traces_dir`` (default: ``Settings().traces_dir``).

    Without the Azure 2019 day the shipped top-100 sample
    (``forecaster/data/azure2019_top100.csv.gz``) is the main pool; each missing
    pool is announced with a :class:`FleetgenWarning`. Pools are read once per
    directory and cached.
    """
    if traces_dir is None:
        from forecaster.settings import Settings

        traces_dir = Settings().traces_dir
    pools = _load_pools_cached(str(Path(traces_dir).expanduser().resolve()))
    for message in pools.missing:
        warnings.warn(message, FleetgenWarning, stacklevel=2)
    return pools


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class FleetChunk:
    """Consecutive models ``first .. first + len(ids) - 1`` of a fleet.

    Attributes:
        first: index of the first model.
        ids: (n,) model ids, ``fleet-000042`` for model 42.
        counts: (n, minutes) int32 counts; column ``t`` is minute ``start + t``.
        meta: one row per model, see :func:`generate_fleet`.
        start: UTC time of minute 0.
    """

    first: int
    ids: np.ndarray
    counts: np.ndarray
    meta: pd.DataFrame
    start: pd.Timestamp
    step_seconds: int = 60

    @property
    def minutes(self) -> int:
        return self.counts.shape[1]

    @property
    def end(self) -> pd.Timestamp:
        return self.start + pd.Timedelta(minutes=self.minutes)


def model_id(index: int) -> str:
    """The stable id of model ``index``: ``fleet-000042`` (wider past 999,999)."""
    return f"fleet-{index:06d}"


def model_rng(seed: int, index: int) -> np.random.Generator:
    """Model ``index``'s own generator: the ``index``-th child of ``SeedSequence(seed)``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(index,))))


def _start(start: datetime | pd.Timestamp | None) -> pd.Timestamp:
    ts = pd.Timestamp(start if start is not None else DEFAULT_START)
    ts = ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")
    if ts.floor("min") != ts:
        raise ValueError(f"start must be on a whole minute, got {ts.isoformat()}")
    return ts.as_unit("ns")


def _weights(pools: SourcePools, weights: Mapping[str, float] | None) -> tuple[list[str], np.ndarray]:
    """Pool names with positive weight that are present, and their cumulative shares."""
    weights = dict(DEFAULT_POOL_WEIGHTS if weights is None else weights)
    unknown = set(weights) - set(POOL_NAMES)
    if unknown:
        raise ValueError(f"unknown pools {sorted(unknown)}; expected some of {list(POOL_NAMES)}")
    if any(w < 0 or not math.isfinite(w) for w in weights.values()):
        raise ValueError(f"pool weights must be finite and non-negative, got {weights}")
    names = [n for n in POOL_NAMES if weights.get(n, 0) > 0 and n in pools.pools]
    if not names:
        raise ValueError(f"no pool with positive weight is available; asked {weights}, found {list(pools.pools)}")
    share = np.array([weights[n] for n in names], dtype="float64")
    return names, np.cumsum(share / share.sum())


def _pick(u: float, n: int) -> int:
    return min(int(u * n), n - 1)


def _transform(rng: np.random.Generator, source: np.ndarray, step: int, factor: float, shift: int,
               out: np.ndarray) -> None:
    """Add ``source`` scaled by ``factor``, split to minutes and rolled by ``shift`` into ``out`` (one day).

    Thinning and excess act on the source steps; a 5-minute step is then split
    over its minutes by a multinomial draw with equal shares.
    """
    steps = np.flatnonzero(source)
    if not len(steps) or factor <= 0:
        return
    values = source[steps]
    if factor < 1:
        values = rng.binomial(values, factor)
    elif factor > 1:
        values = values + rng.poisson((factor - 1.0) * values)
    keep = values > 0
    steps, values = steps[keep], values[keep]
    if step > 1 and len(values):
        split = rng.multinomial(values, np.full(step, 1.0 / step))
        minutes = (steps[:, None] * step + np.arange(step)).ravel()
        values = split.ravel()
        keep = values > 0
        steps, values = minutes[keep], values[keep]
    out[(steps + shift) % DAY_MINUTES] += values  # minutes are distinct within one series


def _draw_model(
    index: int,
    seed: int,
    pools: SourcePools,
    names: list[str],
    cumulative: np.ndarray,
    mix_fraction: float,
    scale_sigma: float,
    day: np.ndarray,
) -> dict[str, object]:
    """Fill ``day`` (1,440 int64 zeros on entry) with model ``index``'s series; return its metadata.

    Every model draws the same fixed set of parameters first (10 uniforms and 1
    normal), whatever it then uses, then the thinning/excess/split noise.
    """
    rng = model_rng(seed, index)
    u = rng.random(10)
    z = float(rng.standard_normal())
    lognormal = math.exp(scale_sigma * z)
    volumes = pools.volume_totals

    def source(pool_u: float, index_u: float) -> tuple[str, int, SourcePool]:
        name = names[min(int(np.searchsorted(cumulative, pool_u, side="right")), len(names) - 1)]
        pool = pools.pools[name]
        return name, _pick(index_u, len(pool)), pool

    pool_name, src, pool = source(u[0], u[1])
    shift = _pick(u[2], DAY_MINUTES)
    source_total = int(pool.totals[src])
    # Minor pools: whole services; bring them to the day total of a randomly drawn Azure function.
    target = source_total if pool_name == "azure2019" else int(volumes[_pick(u[8], len(volumes))])
    volume = target * lognormal  # expected total of the model
    mixed = u[3] < mix_fraction
    weight = MIX_WEIGHT_RANGE[0] + (MIX_WEIGHT_RANGE[1] - MIX_WEIGHT_RANGE[0]) * u[7] if mixed else 0.0
    scale = volume * (1.0 - weight) / source_total if source_total else 0.0
    _transform(rng, pool.series[src], pool.step_minutes, scale, shift, day)
    meta: dict[str, object] = {
        "kind": "mix" if mixed else "single",
        "source_pool": pool_name,
        "source_id": str(pool.ids[src]),
        "source_index": src,
        "shift_min": shift,
        "scale": scale,
        "lognormal": lognormal,
        "mix_pool": None,
        "mix_source_id": None,
        "mix_source_index": -1,
        "mix_shift_min": -1,
        "mix_weight": weight,
        "mix_scale": 0.0,
    }
    if mixed:
        mix_name, mix_src, mix_pool = source(u[4], u[5])
        mix_shift = _pick(u[6], DAY_MINUTES)
        mix_total = int(mix_pool.totals[mix_src])
        mix_scale = volume * weight / mix_total if mix_total else 0.0
        _transform(rng, mix_pool.series[mix_src], mix_pool.step_minutes, mix_scale, mix_shift, day)
        meta.update(mix_pool=mix_name, mix_source_id=str(mix_pool.ids[mix_src]), mix_source_index=mix_src,
                    mix_shift_min=mix_shift, mix_scale=mix_scale)
    return meta


def generate_fleet(
    n_models: int,
    *,
    seed: int = 0,
    minutes: int = DAY_MINUTES,
    start: datetime | pd.Timestamp | None = DEFAULT_START,
    traces_dir: str | Path | None = None,
    chunk_models: int = 10_000,
    pools: Mapping[str, float] | None = None,
    mix_fraction: float = DEFAULT_MIX_FRACTION,
    scale_sigma: float = DEFAULT_SCALE_SIGMA,
    first: int = 0,
) -> Iterator[FleetChunk]:
    """Yield the fleet in chunks of at most ``chunk_models`` models.

    Args:
        n_models: models to generate (ids ``first .. first + n_models - 1``).
        seed: non-negative integer; the same seed gives the same fleet.
        minutes: length of every series, 1 .. 1,440 (the pools hold one day;
            a shorter fleet is the first ``minutes`` of the rolled day).
        start: UTC time of minute 0 (naive means UTC; a whole minute).
        traces_dir: where the public traces are (default
            ``Settings().traces_dir``); see :func:`load_pools` for the fallback.
        chunk_models: models per chunk; never changes a series.
        pools: pool weights (default :data:`DEFAULT_POOL_WEIGHTS`), renormalised
            over the pools present; e.g. ``{"azure2019": 1}`` for the main
            pool only.
        mix_fraction: share of the models that are the sum of two series.
        scale_sigma: standard deviation of the log of the scale factor.
        first: index of the first model (to generate a slice of a fleet, for
            example in parallel).

    Each chunk's ``meta`` has one row per model: ``unique_id``, ``model_index``,
    ``kind`` (``single`` or ``mix``), ``source_pool``, ``source_id``,
    ``source_index`` (row in the pool), ``shift_min`` (circular roll,
    minutes), ``scale`` (factor applied to the source counts), ``lognormal``
    (the log-normal draw inside ``scale``), ``mix_pool``, ``mix_source_id``,
    ``mix_source_index``, ``mix_shift_min``, ``mix_weight`` (share of the
    volume the second series carries), ``mix_scale`` (factor applied to the
    second series) and ``total`` (the generated total). Unmixed models have
    ``<NA>`` / -1 / 0 in the ``mix_*`` columns.
    """
    if isinstance(n_models, bool) or not isinstance(n_models, (int, np.integer)) or n_models < 0:
        raise ValueError(f"n_models must be a non-negative integer, got {n_models!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not 1 <= minutes <= DAY_MINUTES:
        raise ValueError(f"minutes must be 1 .. {DAY_MINUTES} (the source pools hold one day), got {minutes}")
    if chunk_models < 1:
        raise ValueError(f"chunk_models must be positive, got {chunk_models}")
    if not 0 <= mix_fraction <= 1 or scale_sigma < 0 or first < 0:
        raise ValueError("mix_fraction must be in [0, 1], scale_sigma and first non-negative")
    origin = _start(start)
    source_pools = load_pools(traces_dir)
    names, cumulative = _weights(source_pools, pools)
    return _chunks(int(n_models), int(seed), minutes, origin, source_pools, names, cumulative, chunk_models,
                   mix_fraction, scale_sigma, int(first))


# Fixed dtypes, so that every chunk's frame (and a concatenation of them) looks the same;
# text columns are pandas "string" with <NA> for the mix_* of unmixed models.
_META_DTYPES = {
    "kind": "string", "source_pool": "string", "source_id": "string", "source_index": "int64",
    "shift_min": "int64", "scale": "float64", "lognormal": "float64", "mix_pool": "string",
    "mix_source_id": "string", "mix_source_index": "int64", "mix_shift_min": "int64", "mix_weight": "float64",
    "mix_scale": "float64",
}


def _chunks(n_models: int, seed: int, minutes: int, origin: pd.Timestamp, source_pools: SourcePools,
            names: list[str], cumulative: np.ndarray, chunk_models: int, mix_fraction: float,
            scale_sigma: float, first: int) -> Iterator[FleetChunk]:
    day = np.zeros(DAY_MINUTES, dtype="int64")
    for lo in range(first, first + n_models, chunk_models):
        hi = min(lo + chunk_models, first + n_models)
        counts = np.zeros((hi - lo, minutes), dtype="int32")
        rows = []
        for j, index in enumerate(range(lo, hi)):
            day[:] = 0
            meta = _draw_model(index, seed, source_pools, names, cumulative, mix_fraction, scale_sigma, day)
            row = day[:minutes]
            if row.max(initial=0) > _INT32_MAX:
                raise OverflowError(f"model {index} has a minute above {_INT32_MAX:,} invocations")
            counts[j] = row
            rows.append(meta)
        ids = np.array([model_id(i) for i in range(lo, hi)], dtype=object)
        meta = pd.DataFrame(rows).astype(_META_DTYPES)
        meta.insert(0, "model_index", np.arange(lo, hi, dtype="int64"))
        meta.insert(0, "unique_id", pd.array(ids, dtype="string"))
        meta["total"] = counts.sum(axis=1, dtype="int64")
        yield FleetChunk(first=lo, ids=ids, counts=counts, meta=meta, start=origin)


# --------------------------------------------------------------------------- realism


class _SummaryAccumulator:
    def __init__(self) -> None:
        self.totals: list[np.ndarray] = []
        self.cells = 0
        self.zero_cells = 0
        self.minutes: int | None = None

    def add(self, counts: np.ndarray) -> None:
        counts = np.asarray(counts)
        if counts.ndim != 2:
            raise ValueError(f"expected a (models x minutes) matrix, got shape {counts.shape}")
        self.totals.append(counts.sum(axis=1, dtype="int64"))
        self.cells += counts.size
        self.zero_cells += int(counts.size - np.count_nonzero(counts))
        self.minutes = counts.shape[1]

    def result(self, quantiles: Iterable[float]) -> dict[str, object]:
        totals = np.concatenate(self.totals) if self.totals else np.zeros(0, dtype="int64")
        n = len(totals)
        qs = {f"p{round(q * 100):g}": float(np.quantile(totals, q)) if n else math.nan for q in quantiles}
        return {
            "models": n,
            "minutes": self.minutes or 0,
            "zero_cell_share": self.zero_cells / self.cells if self.cells else math.nan,
            "active_model_share": float((totals > 0).mean()) if n else math.nan,
            "total_invocations": int(totals.sum()),
            "daily_total_mean": float(totals.mean()) if n else math.nan,
            "daily_total_quantiles": qs,
            "daily_total_max": int(totals.max()) if n else 0,
        }


def fleet_summary(
    fleet: Iterable[FleetChunk] | FleetChunk | np.ndarray,
    *,
    quantiles: Iterable[float] = SUMMARY_QUANTILES,
) -> dict[str, object]:
    """Realism statistics of a fleet (chunks, one chunk, or a models x minutes matrix).

    Returns a JSON-friendly dict: ``models``, ``minutes``, ``zero_cell_share``
    (share of (model, minute) cells with no invocation), ``active_model_share``
    (share of models with at least one invocation), ``total_invocations``,
    ``daily_total_mean``, ``daily_total_quantiles`` (``p10`` ... of the
    per-model totals over the span, a day for 1,440 minutes) and
    ``daily_total_max``. Chunks are consumed one at a time.
    """
    acc = _SummaryAccumulator()
    if isinstance(fleet, FleetChunk):
        acc.add(fleet.counts)
    elif isinstance(fleet, np.ndarray):
        acc.add(fleet)
    else:
        for chunk in fleet:
            acc.add(chunk.counts if isinstance(chunk, FleetChunk) else chunk)
    return acc.result(quantiles)


def source_summary(
    traces_dir: str | Path | None = None,
    *,
    pool: str = "azure2019",
    minutes: int = DAY_MINUTES,
    quantiles: Iterable[float] = SUMMARY_QUANTILES,
) -> dict[str, object]:
    """:func:`fleet_summary` of a 1-minute source pool itself (first ``minutes`` of each day)."""
    source = load_pools(traces_dir).pools[pool]
    if source.step_minutes != 1:
        raise ValueError(f"pool {pool!r} has {source.step_minutes}-minute steps; minute statistics need 1-minute")
    return fleet_summary(source.series[:, :minutes], quantiles=quantiles)


# --------------------------------------------------------------------------- long frames and batches


def chunk_to_long(chunk: FleetChunk, *, edge_zeros: bool = False) -> pd.DataFrame:
    """The chunk as a long frame ``unique_id, ds, y`` (int64), zero minutes left out.

    Built with ``np.nonzero`` on the whole matrix; rows are ordered by model,
    then minute. ``edge_zeros=True`` keeps the first and last minute of every
    model even when zero, so that a reader that infers coverage from the first
    to the last row of each model (the generic ``long`` format of ``prewarm
    ingest trace``) covers the whole span, all-zero models included.
    """
    counts = chunk.counts
    mask = counts != 0
    if edge_zeros and counts.shape[1]:
        mask[:, 0] = True
        mask[:, -1] = True
    rows, cols = np.nonzero(mask)
    ds_ns = chunk.start.value + cols.astype("int64") * _MINUTE_NS
    return pd.DataFrame(
        {
            "unique_id": pd.array(chunk.ids[rows], dtype="str"),
            "ds": pd.DatetimeIndex(ds_ns.view("M8[ns]")).tz_localize("UTC"),
            "y": counts[rows, cols].astype("int64"),
        }
    )


def chunk_windows(chunk: FleetChunk) -> pd.DataFrame:
    """One coverage window ``[start, start + minutes)`` per model of the chunk."""
    n = len(chunk.ids)
    return pd.DataFrame(
        {
            "unique_id": pd.array(chunk.ids, dtype="str"),
            "start": pd.Series([chunk.start] * n, dtype="datetime64[ns, UTC]"),
            "end": pd.Series([chunk.end] * n, dtype="datetime64[ns, UTC]"),
        }
    )


def chunk_to_batch(chunk: FleetChunk, *, source: str = FLEET_SOURCE) -> CountBatch:
    """The chunk as a :class:`CountBatch`: zero minutes omitted, windows over the whole span."""
    return CountBatch(source=source, step_seconds=60, counts=chunk_to_long(chunk), windows=chunk_windows(chunk))


def fleet_batches(
    n_models: int,
    *,
    source: str = FLEET_SOURCE,
    chunk_models: int = 10_000,
    **kwargs: object,
) -> Iterator[CountBatch]:
    """Yield one :class:`CountBatch` per chunk of the fleet (arguments as :func:`generate_fleet`).

    Feed each to :func:`forecaster.store.invocations.write_count_batch`
    (``register_models=True`` unless the ``fleet-*`` models are registered).
    """
    for chunk in generate_fleet(n_models, chunk_models=chunk_models, **kwargs):
        yield chunk_to_batch(chunk, source=source)


def write_fleet_parquet(
    path: str | Path,
    chunks: Iterable[FleetChunk],
    *,
    edge_zeros: bool = True,
    metadata_path: str | Path | None = None,
    progress: object = None,
) -> dict[str, object]:
    """Write chunks to one long Parquet file (``unique_id, ds, y``; one row group per chunk).

    Zero minutes are left out, except, with ``edge_zeros`` (the default), the
    first and last minute of each model, so that ``prewarm ingest trace`` (which
    covers each model from its first to its last row) reads every model over
    the whole span. ``metadata_path`` (``.csv`` or ``.parquet``) receives the
    per-model metadata. Returns ``{"rows", "path", "summary"}`` with
    :func:`fleet_summary` of what was written.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("unique_id", pa.string()), ("ds", pa.timestamp("ns", tz="UTC")), ("y", pa.int64())])
    acc = _SummaryAccumulator()
    rows = 0
    metas = []
    path = Path(path)
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for chunk in chunks:
            frame = chunk_to_long(chunk, edge_zeros=edge_zeros)
            writer.write_table(pa.Table.from_pandas(frame, schema=schema, preserve_index=False))
            rows += len(frame)
            acc.add(chunk.counts)
            if metadata_path is not None:
                metas.append(chunk.meta)
            if callable(progress):
                progress(chunk)
    if metadata_path is not None:
        meta = pd.concat(metas, ignore_index=True) if metas else pd.DataFrame()
        metadata_path = Path(metadata_path)
        if metadata_path.suffix == ".parquet":
            meta.to_parquet(metadata_path, index=False)
        else:
            meta.to_csv(metadata_path, index=False)
    return {"rows": rows, "path": str(path), "summary": acc.result(SUMMARY_QUANTILES)}
