"""The fleet generator (forecaster.simulation.fleetgen): determinism, provenance, realism, batches, CLI.

Runs on the public traces when ``PREWARM_TRACES_DIR`` (or ../shared/traces)
holds them, and on the shipped sample otherwise; the realism check computes the
source pool's statistics here, from the trace file, never from constants.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from forecaster.cli import app
from forecaster.data import AZURE2019_TOP100, sample_path
from forecaster.contracts.batches import CountBatch
from forecaster.ingest.traces import read_trace
from forecaster.ingest.validate import build_count_batch
from forecaster.simulation.fleetgen import (
    AZURE2019_FILE,
    DEFAULT_START,
    FleetgenWarning,
    fleet_batches,
    fleet_summary,
    generate_fleet,
    load_pools,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACES_DIR = Path(os.environ.get("PREWARM_TRACES_DIR", REPO_ROOT.parent / "shared" / "traces"))
NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)

# Realism tolerance (also stated in docs/fleet-generator.md): the generated fleet's share of zero
# cells within 5 percentage points of the source pool's, its median daily total within a factor 1.5.
ZERO_SHARE_TOLERANCE = 0.05
MEDIAN_RATIO_TOLERANCE = 1.5

# The tests run with or without ../shared; a missing pool is warned about, which is expected here.
pytestmark = pytest.mark.filterwarnings("ignore::forecaster.simulation.fleetgen.FleetgenWarning")


def fleet(n: int, **kwargs):
    """The whole fleet as (ids, counts, meta)."""
    kwargs.setdefault("traces_dir", TRACES_DIR)
    chunks = list(generate_fleet(n, **kwargs))
    return (
        np.concatenate([c.ids for c in chunks]),
        np.vstack([c.counts for c in chunks]),
        pd.concat([c.meta for c in chunks], ignore_index=True),
    )


def assert_same(a, b) -> None:
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    pd.testing.assert_frame_equal(a[2], b[2])


def test_same_seed_same_fleet_and_different_seed_differs():
    first, again = fleet(60, seed=7), fleet(60, seed=7)
    assert_same(first, again)
    other = fleet(60, seed=8)
    assert not np.array_equal(first[1], other[1])
    assert not first[2]["source_id"].equals(other[2]["source_id"])


def test_prefix_property_and_stable_ids():
    small, large = fleet(10, seed=3), fleet(100, seed=3)
    assert_same(small, (large[0][:10], large[1][:10], large[2].iloc[:10].reset_index(drop=True)))
    assert list(large[0][:3]) == ["fleet-000000", "fleet-000001", "fleet-000002"]
    assert large[0][42] == "fleet-000042"
    # A slice of the fleet generated on its own (first=) is the same slice.
    ids, counts, meta = fleet(20, seed=3, first=50)
    np.testing.assert_array_equal(counts, large[1][50:70])
    assert list(ids) == list(large[0][50:70])


def test_chunking_does_not_change_the_fleet():
    whole = fleet(45, seed=1, chunk_models=1000)
    pieces = fleet(45, seed=1, chunk_models=7)
    assert_same(whole, pieces)
    sizes = [len(c.ids) for c in generate_fleet(45, seed=1, chunk_models=7, traces_dir=TRACES_DIR)]
    assert sizes == [7, 7, 7, 7, 7, 7, 3]


def test_counts_are_non_negative_integers_over_the_requested_span():
    chunks = list(generate_fleet(30, seed=2, minutes=300, traces_dir=TRACES_DIR, chunk_models=16))
    for chunk in chunks:
        assert np.issubdtype(chunk.counts.dtype, np.integer)
        assert chunk.counts.shape == (len(chunk.ids), 300)
        assert (chunk.counts >= 0).all()
        assert chunk.start == pd.Timestamp(DEFAULT_START)
        np.testing.assert_array_equal(chunk.meta["total"].to_numpy(), chunk.counts.sum(axis=1))
    # The first 300 minutes of the day fleet.
    np.testing.assert_array_equal(np.vstack([c.counts for c in chunks]), fleet(30, seed=2)[1][:, :300])
    with pytest.raises(ValueError, match="minutes"):
        generate_fleet(3, minutes=1441, traces_dir=TRACES_DIR)
    with pytest.raises(ValueError, match="seed"):
        generate_fleet(3, seed=-1, traces_dir=TRACES_DIR)


def rolled(pool, index: int, shift: int) -> np.ndarray:
    return np.roll(pool.series[index], shift)


def test_metadata_names_real_source_series_and_the_transformation():
    ids, counts, meta = fleet(400, seed=5, mix_fraction=0.3)
    pools = load_pools(TRACES_DIR).pools
    assert set(meta["kind"]) == {"single", "mix"}
    for row in meta.itertuples():
        pool = pools[row.source_pool]
        assert pool.ids[row.source_index] == row.source_id
        assert 0 <= row.shift_min < 1440 and row.scale >= 0
        if row.kind == "mix":
            assert pools[row.mix_pool].ids[row.mix_source_index] == row.mix_source_id
            assert 0.1 <= row.mix_weight <= 0.5 and 0 <= row.mix_shift_min < 1440
        else:
            assert pd.isna(row.mix_pool) and row.mix_source_index == -1 and row.mix_weight == 0
    # The series follows from its metadata: thinning (scale < 1) only removes invocations and an
    # excess (scale > 1) only adds to minutes that already had some, so zeros stay zeros.
    checked = 0
    for j, row in enumerate(meta.itertuples()):
        pool = pools[row.source_pool]
        if pool.step_minutes != 1:
            continue
        source = rolled(pool, row.source_index, row.shift_min)
        if row.kind == "single":
            assert ((counts[j] > 0) <= (source > 0)).all()
            assert (counts[j] <= source).all() if row.scale < 1 else (counts[j] >= source).all()
            checked += 1
        elif pools[row.mix_pool].step_minutes == 1:
            other = rolled(pools[row.mix_pool], row.mix_source_index, row.mix_shift_min)
            assert ((counts[j] > 0) <= ((source > 0) | (other > 0))).all()
    assert checked > 100


def test_fallback_to_the_shipped_sample(tmp_path):
    with pytest.warns(FleetgenWarning, match="shipped sample"):
        ids, counts, meta = fleet(25, seed=0, traces_dir=tmp_path)
    sample = read_trace(sample_path(AZURE2019_TOP100))
    sample_ids = set(sample.raw["unique_id"].astype(str).unique())
    assert set(meta["source_pool"]) == {"azure2019"}  # no minor pool in an empty directory
    assert set(meta["source_id"]) <= sample_ids
    assert counts.shape == (25, 1440) and counts.sum() > 0
    assert load_pools(tmp_path).fallback


TOTAL_QUANTILES = ("p25", "p50", "p75", "p90")


def source_pool_statistics(traces_dir: Path) -> tuple[float, dict[str, float]]:
    """Share of zero cells and quantiles of the daily totals of the main pool, from the trace file itself."""
    path = traces_dir / AZURE2019_FILE
    raw = read_trace(path if path.is_file() else sample_path(AZURE2019_TOP100)).raw
    y = raw["y"].to_numpy()
    totals = raw.groupby("unique_id", observed=True)["y"].sum().to_numpy()
    levels = [float(q[1:]) / 100 for q in TOTAL_QUANTILES]
    return float((y == 0).mean()), dict(zip(TOTAL_QUANTILES, np.quantile(totals, levels)))


def test_realism_close_to_the_source_pool():
    zero_share, source_totals = source_pool_statistics(TRACES_DIR)
    summary = fleet_summary(generate_fleet(3000, seed=0, traces_dir=TRACES_DIR, chunk_models=1000))
    assert summary["models"] == 3000 and summary["minutes"] == 1440
    assert abs(summary["zero_cell_share"] - zero_share) <= ZERO_SHARE_TOLERANCE, (summary, zero_share)
    # The body of the volume distribution, not only its median (which the median-1 scale keeps by construction):
    # thinning, Poisson excess, the mixes and the minor pools must not move the quartiles or p90 by more than 1.5x.
    for q in TOTAL_QUANTILES:
        ratio = summary["daily_total_quantiles"][q] / source_totals[q]
        assert 1 / MEDIAN_RATIO_TOLERANCE <= ratio <= MEDIAN_RATIO_TOLERANCE, (q, summary, source_totals)
    assert 0.9 <= summary["active_model_share"] <= 1.0
    # Summaries of chunks and of the whole matrix agree.
    _, counts, _ = fleet(50, seed=4)
    chunked = fleet_summary(generate_fleet(50, seed=4, traces_dir=TRACES_DIR, chunk_models=9))
    assert fleet_summary(counts) == chunked
    assert chunked["zero_cell_share"] == pytest.approx((counts == 0).mean())
    assert chunked["active_model_share"] == pytest.approx((counts.sum(axis=1) > 0).mean())


def test_fleet_batches_match_the_matrix():
    ids, counts, _ = fleet(30, seed=6, minutes=600)
    batches = list(fleet_batches(30, seed=6, minutes=600, chunk_models=8, traces_dir=TRACES_DIR))
    assert len(batches) == 4 and all(isinstance(b, CountBatch) for b in batches)
    long = pd.concat([b.counts for b in batches], ignore_index=True)
    windows = pd.concat([b.windows for b in batches], ignore_index=True)
    assert (long["y"] > 0).all() and long["y"].dtype == np.int64
    assert not long.duplicated(["unique_id", "ds"]).any()
    per_model = long.groupby("unique_id")["y"].sum().reindex(ids, fill_value=0).to_numpy()
    np.testing.assert_array_equal(per_model, counts.sum(axis=1))
    assert len(long) == np.count_nonzero(counts)
    # Cell by cell, and every model covered for the whole span, all-zero ones included.
    minute = ((long["ds"] - pd.Timestamp(DEFAULT_START)) // pd.Timedelta(minutes=1)).to_numpy()
    row = pd.Index(ids).get_indexer(long["unique_id"])
    np.testing.assert_array_equal(counts[row, minute], long["y"].to_numpy())
    assert list(windows["unique_id"]) == list(ids)
    assert (windows["start"] == pd.Timestamp(DEFAULT_START)).all()
    assert (windows["end"] == pd.Timestamp(DEFAULT_START) + pd.Timedelta(minutes=600)).all()
    assert sum(b.covered_steps for b in batches) == 30 * 600
    # Validation accepts a batch as it is and changes nothing.
    checked = build_count_batch(batches[0].counts, source="fleetgen", step_seconds=60, now=NOW,
                                windows=batches[0].windows)
    pd.testing.assert_frame_equal(checked.counts.reset_index(drop=True),
                                  batches[0].counts.astype({"unique_id": checked.counts["unique_id"].dtype}),
                                  check_dtype=False)


def test_cli_writes_a_long_parquet_that_ingest_reads(tmp_path):
    out, meta_path = tmp_path / "fleet.parquet", tmp_path / "meta.csv"
    result = CliRunner().invoke(app, ["fleet", "generate", "--models", "12", "--seed", "9", "--minutes", "180",
                                      "--out", str(out), "--summary", "--metadata", str(meta_path),
                                      "--chunk-models", "5", "--traces-dir", str(TRACES_DIR)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    _, counts, meta = fleet(12, seed=9, minutes=180)
    assert summary == fleet_summary(counts)
    assert len(pd.read_csv(meta_path)) == 12
    frame = pd.read_parquet(out)
    assert list(frame.columns) == ["unique_id", "ds", "y"]
    # The generic long reader (prewarm ingest trace) covers every model for the whole span: the
    # first and last minute of each model are written even when zero; no other zero is.
    trace = read_trace(out)
    assert trace.source == "trace:long"
    batch = build_count_batch(trace.raw, source=trace.source, step_seconds=trace.step_seconds, now=NOW,
                              windows=trace.windows)
    assert batch.covered_steps == 12 * 180
    assert batch.total_invocations == counts.sum()
    assert len(frame) == np.count_nonzero(counts) + int((counts[:, 0] == 0).sum() + (counts[:, -1] == 0).sum())
