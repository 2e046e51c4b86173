"""Trace readers (forecaster.ingest.traces) on the shipped samples and on malformed files.

Expected figures are computed independently here with plain csv / gzip / json,
not with pandas, so a reader bug cannot hide behind the same bug in the test.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import math
import os
import shutil
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forecaster.data import (
    AZURE2019_TOP100,
    AZURE2021_EXCERPT,
    AZURE_LLM2023_CODE_HEAD,
    MOONCAKE_HEAD,
    SAMPLE_FILES,
    sample_path,
)
from forecaster.contracts.batches import IngestError
from forecaster.ingest.traces import TRACE_FORMATS, RawTrace, detect_format, read_trace
from forecaster.ingest.validate import build_count_batch

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACES_DIR = Path(os.environ.get("PREWARM_TRACES_DIR", REPO_ROOT.parent / "shared" / "traces"))
AZURE2019_FULL = TRACES_DIR / "azure_functions_2019_sample1350" / "invocations_per_function_1day_1350fn.csv.gz"
HUAWEI_FULL = TRACES_DIR / "huawei_cloud_5min_dc4" / "datacentre_4.csv.gz"
needs_traces = pytest.mark.skipif(not TRACES_DIR.is_dir(), reason=f"traces not found at {TRACES_DIR}")

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)
UTC = timezone.utc


def ts(text: str) -> pd.Timestamp:
    return pd.Timestamp(text, tz="UTC")


def batch_of(trace: RawTrace):
    return build_count_batch(
        trace.raw, source=trace.source, step_seconds=trace.step_seconds, now=NOW, windows=trace.windows
    )


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- detection and arguments


@pytest.mark.parametrize(
    "name, fmt",
    [
        (AZURE2019_TOP100, "azure2019"),
        (AZURE2021_EXCERPT, "azure2021"),
        (AZURE_LLM2023_CODE_HEAD, "azure_llm2023"),
        (MOONCAKE_HEAD, "mooncake"),
    ],
)
def test_detect_format_on_shipped_samples(name, fmt):
    assert detect_format(sample_path(name)) == fmt


def test_detect_format_on_synthetic_files(tmp_path):
    huawei = write(tmp_path / "dc.csv", "date,a---1---pool\n2016-07-01 00:00:00,1.0\n")
    long_csv = write(tmp_path / "counts.csv", "unique_id,ds,y\nm,2024-01-01T00:00:00Z,3\n")
    parquet = tmp_path / "counts.bin"  # no extension: sniffed by magic bytes
    pd.DataFrame({"unique_id": ["m"], "ds": [ts("2024-01-01")], "y": [3]}).to_parquet(parquet)
    gz_no_suffix = tmp_path / "mooncake.data"
    gz_no_suffix.write_bytes(gzip.compress(b'{"timestamp": 5, "input_length": 1}\n'))
    bom = tmp_path / "bom.csv"
    bom.write_bytes("\ufeffapp,func,end_timestamp,duration\na,f,1.0,0.5\n".encode("utf-8"))
    assert detect_format(bom) == "azure2021"
    assert read_trace(bom).raw["unique_id"].tolist() == ["f"]
    assert detect_format(huawei) == "huawei5min"
    assert detect_format(long_csv) == "long"
    assert detect_format(parquet) == "long"
    assert detect_format(gz_no_suffix) == "mooncake"
    assert set(TRACE_FORMATS) == {"azure2019", "huawei5min", "azure_llm2023", "mooncake", "azure2021", "long"}


def test_detect_format_unknown_names_the_header(tmp_path):
    odd = write(tmp_path / "odd.csv", "foo,bar\n1,2\n")
    with pytest.raises(ValueError, match=r"'foo,bar'.*azure2019"):
        detect_format(odd)


def test_read_trace_refuses_arguments_that_do_not_apply(tmp_path):
    huawei = write(tmp_path / "dc.csv", "date,a\n2016-07-01 00:00:00,1.0\n")
    with pytest.raises(ValueError, match="unknown trace format 'csv'"):
        read_trace(huawei, fmt="csv")
    with pytest.raises(ValueError, match="start= applies only to"):
        read_trace(huawei, start=datetime(2016, 7, 1, tzinfo=UTC))
    with pytest.raises(ValueError, match="model_id= applies only to"):
        read_trace(sample_path(AZURE2019_TOP100), model_id="x")
    with pytest.raises(ValueError, match="whole minute"):
        read_trace(sample_path(AZURE2019_TOP100), start=datetime(2019, 7, 15, 0, 0, 30, tzinfo=UTC))


# --------------------------------------------------------------------------- azure2019


def _azure2019_rows(path: Path) -> tuple[list[str], list[str], list[list[int]]]:
    """(header, function ids, per-minute counts) read with plain gzip + csv."""
    with gzip.open(path, "rt", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        rows = list(reader)
    first = header.index("minute_1")
    return header, [r[0] for r in rows], [[int(v) for v in r[first:]] for r in rows]


def test_azure2019_sample_shape_times_and_windows():
    header, ids, cells = _azure2019_rows(sample_path(AZURE2019_TOP100))
    trace = read_trace(sample_path(AZURE2019_TOP100))
    raw = trace.raw
    assert (trace.step_seconds, trace.source) == (60, "trace:azure2019")
    assert header[:4] == ["HashFunction", "HashOwner", "HashApp", "minute_1"] and header[-1] == "minute_1440"
    assert len(ids) == 100 and len(raw) == 100 * 1440 == 144_000
    assert raw["ds"].min() == ts("2019-07-15 00:00") and raw["ds"].max() == ts("2019-07-15 23:59")
    assert str(raw["ds"].dt.tz) == "UTC"
    first, last = raw.iloc[0], raw.iloc[-1]
    assert (first["unique_id"], first["row"], first["field"], first["ds"]) == (ids[0], 1, "minute_1", ts("2019-07-15"))
    assert (last["unique_id"], last["row"], last["field"], last["ds"]) == (ids[-1], 100, "minute_1440", ts("2019-07-15 23:59"))
    # cell (function 37, minute_700) lands on row 37, 699 minutes after start, with the source value
    cell = raw[(raw["row"] == 37) & (raw["field"] == "minute_700")]
    assert len(cell) == 1 and cell["ds"].iloc[0] == ts("2019-07-15") + timedelta(minutes=699)
    assert cell["y"].iloc[0] == cells[36][699]
    assert trace.windows["unique_id"].tolist() == ids
    assert (trace.windows["start"] == ts("2019-07-15")).all() and (trace.windows["end"] == ts("2019-07-16")).all()


def test_azure2019_sample_round_trip_through_validation():
    _, ids, cells = _azure2019_rows(sample_path(AZURE2019_TOP100))
    total = sum(map(sum, cells))
    nonzero = sum(v > 0 for row in cells for v in row)
    trace = read_trace(sample_path(AZURE2019_TOP100))
    batch = batch_of(trace)
    assert total == 662_115 and nonzero == 114_269
    assert int(trace.raw["y"].sum()) == total == batch.total_invocations
    assert len(batch.counts) == nonzero  # zero minutes are dropped ...
    assert batch.covered_steps == 144_000  # ... but the windows still speak for them
    per_function = batch.counts.groupby("unique_id")["y"].sum()
    assert {i: int(per_function[i]) for i in ids} == {i: sum(c) for i, c in zip(ids, cells)}
    assert per_function.max() == 57_778
    # a zero minute of the first function: no count row, yet inside its window
    who = next(i for i, c in enumerate(cells) if 0 in c)
    zero_ds = ts("2019-07-15") + timedelta(minutes=cells[who].index(0))
    mine = batch.counts[batch.counts["unique_id"] == ids[who]]
    assert len(mine) == sum(v > 0 for v in cells[who]) and zero_ds not in set(mine["ds"])
    window = batch.windows.set_index("unique_id").loc[ids[who]]
    assert window["start"] <= zero_ds < window["end"]


def test_azure2019_start_override_moves_every_timestamp():
    naive = read_trace(sample_path(AZURE2019_TOP100), start=datetime(2019, 7, 20))  # naive = UTC
    assert naive.raw["ds"].min() == ts("2019-07-20") and naive.raw["ds"].max() == ts("2019-07-20 23:59")
    assert (naive.windows["end"] == ts("2019-07-21")).all()
    berlin = timezone(timedelta(hours=2))
    shifted = read_trace(sample_path(AZURE2019_TOP100), start=datetime(2019, 7, 20, 2, 0, tzinfo=berlin))
    assert shifted.raw["ds"].min() == ts("2019-07-20")


@needs_traces
def test_azure2019_sample_is_the_top_100_of_the_full_day():
    header, ids, cells = _azure2019_rows(AZURE2019_FULL)
    totals = [sum(c) for c in cells]
    cut = sorted(range(len(ids)), key=lambda i: (-totals[i], i))[:100]
    expected = [ids[i] for i in sorted(cut)]
    sample_header, sample_ids, sample_cells = _azure2019_rows(sample_path(AZURE2019_TOP100))
    assert sample_header == header
    assert sample_ids == expected
    assert sample_cells == [cells[i] for i in sorted(cut)]


@needs_traces
def test_azure2019_full_day_reads_fast_and_keeps_every_cell():
    read_trace(sample_path(AZURE2019_TOP100))  # warm the imports
    elapsed = []
    for _ in range(2):  # best of two, so one hiccup on a busy machine does not fail it
        started = time.perf_counter()
        trace = read_trace(AZURE2019_FULL)
        elapsed.append(time.perf_counter() - started)
    assert min(elapsed) < 2.0, f"reading 1,350 x 1,440 took {min(elapsed):.2f} s"
    assert len(trace.raw) == 1350 * 1440
    assert int(trace.raw["y"].sum()) == 927_272
    assert trace.raw["unique_id"].nunique() == len(trace.windows) == 1350
    assert round(float((trace.raw["y"] == 0).mean()), 3) == 0.830


AZURE2019_SMALL = (
    "HashFunction,HashOwner,HashApp,minute_1,minute_2,minute_3\n"
    "f1,f1,f1,1,0,2\n"
    "f2,f2,f2,0,{cell},3\n"
    "f3,f3,f3,0,0,0\n"
)


@pytest.mark.parametrize(
    "cell, reason",
    [("", "nan"), ("-1", "negative_count"), ("1.5", "non_integer_count"), ("abc", "not_a_number")],
)
def test_azure2019_bad_cell_is_reported_with_row_and_minute(tmp_path, cell, reason):
    path = write(tmp_path / "inv.csv", AZURE2019_SMALL.format(cell=cell))
    with pytest.raises(IngestError) as err:  # every cell is checked by the reader, zeros included
        read_trace(path)
    assert (err.value.reason, err.value.row, err.value.field) == (reason, 2, "minute_2")
    if cell:
        assert err.value.value == cell


def test_azure2019_duplicate_function_row_is_not_merged(tmp_path):
    text = AZURE2019_SMALL.format(cell="4") + "f1,f1,f1,5,5,5\n"
    with pytest.raises(IngestError, match=r"rows 1 and 4") as err:
        read_trace(write(tmp_path / "inv.csv", text))
    assert (err.value.reason, err.value.row, err.value.field) == ("duplicate", 4, "HashFunction")
    # all zeros, or spelt with a space: still the same function twice (left to validation, which sees only the
    # non-zero cells at ingest, the zeros of a repeat were never compared)
    text = AZURE2019_SMALL.format(cell="4") + " f3,f1,f1,0,0,0\n"
    with pytest.raises(IngestError, match=r"rows 3 and 4"):
        read_trace(write(tmp_path / "inv.csv", text))


def test_azure2019_blank_line_keeps_row_numbers_honest(tmp_path):
    text = AZURE2019_SMALL.format(cell="4").replace("f2,", "\nf2,", 1)
    with pytest.raises(IngestError) as err:
        batch_of(read_trace(write(tmp_path / "inv.csv", text), fmt="azure2019"))
    assert (err.value.reason, err.value.row) == ("missing_model", 2)


def test_azure2019_all_zero_function_is_covered_but_has_no_counts(tmp_path):
    trace = read_trace(write(tmp_path / "inv.csv", AZURE2019_SMALL.format(cell="4")))
    batch = batch_of(trace)
    assert batch.total_invocations == 1 + 2 + 4 + 3
    assert sorted(batch.counts["unique_id"].unique()) == ["f1", "f2"]
    assert batch.model_ids == ["f1", "f2", "f3"]
    assert batch.covered_steps == 9
    assert batch.windows.set_index("unique_id").loc["f3", "end"] == ts("2019-07-15 00:03")


def test_azure2019_missing_columns(tmp_path):
    no_id = write(tmp_path / "a.csv", "HashOwner,minute_1\nx,1\n")
    with pytest.raises(IngestError, match="HashFunction") as err:
        read_trace(no_id, fmt="azure2019")
    assert (err.value.reason, err.value.field) == ("missing_column", "HashFunction")
    no_minutes = write(tmp_path / "b.csv", "HashFunction,HashOwner\nx,x\n")
    with pytest.raises(IngestError, match="minute_") as err:
        read_trace(no_minutes, fmt="azure2019")
    assert err.value.reason == "missing_column"


# --------------------------------------------------------------------------- huawei5min


HUAWEI_SMALL = (
    "date,296---224---pool22-300-128,83---346---pool23-400-256\n"
    "2016-07-01 00:00:00,10949.0,54.0\n"
    "2016-07-01 00:05:00,0.0,{cell}\n"
    "2016-07-01 00:10:00,17080.0,5.0\n"
)


def test_huawei_synthetic_round_trip(tmp_path):
    trace = read_trace(write(tmp_path / "dc.csv", HUAWEI_SMALL.format(cell="9.0")))
    assert (trace.step_seconds, trace.source) == (300, "trace:huawei5min")
    assert trace.raw["unique_id"].tolist()[:2] == ["296---224---pool22-300-128", "83---346---pool23-400-256"]
    assert trace.raw["row"].tolist() == [1, 1, 2, 2, 3, 3]
    assert trace.raw["field"].tolist()[:2] == trace.raw["unique_id"].tolist()[:2]
    assert trace.raw["ds"].tolist()[::2] == [ts("2016-07-01 00:00"), ts("2016-07-01 00:05"), ts("2016-07-01 00:10")]
    assert (trace.windows["start"] == ts("2016-07-01 00:00")).all()
    assert (trace.windows["end"] == ts("2016-07-01 00:15")).all()
    batch = batch_of(trace)
    assert batch.total_invocations == 10949 + 54 + 9 + 17080 + 5
    assert len(batch.counts) == 5 and batch.covered_steps == 6  # the 0.0 bin is covered, not stored
    assert batch.counts["y"].dtype == np.int64


@pytest.mark.parametrize("cell, reason", [("2.5", "non_integer_count"), ("", "nan"), ("-3.0", "negative_count")])
def test_huawei_bad_cell_names_row_and_channel(tmp_path, cell, reason):
    with pytest.raises(IngestError) as err:
        read_trace(write(tmp_path / "dc.csv", HUAWEI_SMALL.format(cell=cell)))
    assert (err.value.reason, err.value.row, err.value.field) == (reason, 2, "83---346---pool23-400-256")


def test_huawei_bad_date_is_reported_by_the_reader(tmp_path):
    text = HUAWEI_SMALL.format(cell="1.0").replace("2016-07-01 00:10:00", "July the first")
    with pytest.raises(IngestError) as err:
        read_trace(write(tmp_path / "dc.csv", text))
    assert (err.value.reason, err.value.row, err.value.field, err.value.value) == (
        "bad_timestamp", 3, "date", "July the first",
    )


@pytest.mark.skipif(not HUAWEI_FULL.is_file(), reason=f"Huawei slice not found at {HUAWEI_FULL}")
def test_huawei_real_slice():
    trace = read_trace(HUAWEI_FULL)
    assert detect_format(HUAWEI_FULL) == "huawei5min"
    raw = trace.raw
    assert raw["unique_id"].nunique() == 8 and len(raw) == 8 * 8640
    assert raw.groupby("unique_id")["ds"].nunique().eq(8640).all()
    values = raw["y"].to_numpy(dtype="float64")
    assert np.array_equal(values, np.floor(values)) and values.min() >= 0
    assert (trace.windows["start"] == ts("2016-07-01")).all() and (trace.windows["end"] == ts("2016-07-31")).all()
    batch = batch_of(trace)
    assert batch.covered_steps == 8 * 8640
    stored = batch.counts.groupby("unique_id").size()
    # zero bins per channel, from the traces README
    assert stored["296---224---pool22-300-128"] == 8640 - 123
    assert stored["10---134---pool22-300-128"] == 8640 - 2569
    assert stored["83---346---pool23-400-256"] == 8640
    assert batch.counts.groupby("unique_id")["y"].max()["296---224---pool22-300-128"] == 67363


# --------------------------------------------------------------------------- azure_llm2023


def test_azure_llm_sample_per_minute_counts():
    with open(sample_path(AZURE_LLM2023_CODE_HEAD), newline="") as fh:
        stamps = [r["TIMESTAMP"] for r in csv.DictReader(fh)]
    expected = Counter(ts(s[:16]) for s in stamps)  # "2023-11-16 18:17"
    trace = read_trace(sample_path(AZURE_LLM2023_CODE_HEAD))
    assert (trace.step_seconds, trace.source) == (60, "trace:azure_llm2023")
    assert trace.raw["unique_id"].unique().tolist() == ["azure-llm-code"]
    assert dict(zip(trace.raw["ds"], trace.raw["y"])) == expected
    assert len(stamps) == int(trace.raw["y"].sum()) == 2000
    assert trace.raw["row"].iloc[0] == 1 and trace.raw["field"].iloc[0] == "TIMESTAMP"
    window = trace.windows.iloc[0]
    assert (window["start"], window["end"]) == (ts("2023-11-16 18:17"), ts("2023-11-16 18:32"))
    batch = batch_of(trace)
    assert batch.total_invocations == 2000 and batch.covered_steps == 15 and len(batch.counts) == 11
    assert ts("2023-11-16 18:18") not in set(batch.counts["ds"])  # an idle minute: covered zero


def test_azure_llm_model_id_from_file_name_or_argument(tmp_path):
    conv = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    shutil.copyfile(sample_path(AZURE_LLM2023_CODE_HEAD), conv)
    assert read_trace(conv).raw["unique_id"].iloc[0] == "azure-llm-conv"
    named = read_trace(conv, model_id="llama-70b")
    assert named.raw["unique_id"].unique().tolist() == ["llama-70b"]
    assert named.windows["unique_id"].tolist() == ["llama-70b"]


def test_azure_llm_bad_timestamp_and_missing_column(tmp_path):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,1,2\nyesterday,3,4\n"
    with pytest.raises(IngestError) as err:
        read_trace(write(tmp_path / "llm.csv", text))
    assert (err.value.reason, err.value.row, err.value.field, err.value.value) == (
        "bad_timestamp", 2, "TIMESTAMP", "yesterday",
    )
    with pytest.raises(IngestError, match="TIMESTAMP") as err:
        read_trace(write(tmp_path / "llm2.csv", "time,ContextTokens\n1,2\n"), fmt="azure_llm2023")
    assert err.value.reason == "missing_column"


# --------------------------------------------------------------------------- mooncake


def test_mooncake_sample_per_minute_counts():
    with gzip.open(sample_path(MOONCAKE_HEAD), "rt") as fh:
        offsets = [json.loads(line)["timestamp"] for line in fh]
    expected = Counter(ts("2024-01-01") + timedelta(minutes=ms // 60_000) for ms in offsets)
    trace = read_trace(sample_path(MOONCAKE_HEAD))
    assert (trace.step_seconds, trace.source) == (60, "trace:mooncake")
    assert trace.raw["unique_id"].unique().tolist() == ["mooncake-conversation"]
    assert dict(zip(trace.raw["ds"], trace.raw["y"])) == expected
    assert len(offsets) == 2000 and max(offsets) == 669_000
    window = trace.windows.iloc[0]
    assert (window["start"], window["end"]) == (ts("2024-01-01 00:00"), ts("2024-01-01 00:12"))
    batch = batch_of(trace)
    assert batch.total_invocations == 2000 and batch.covered_steps == 12
    moved = read_trace(sample_path(MOONCAKE_HEAD), start=datetime(2025, 3, 1, tzinfo=UTC), model_id="kimi")
    assert moved.raw["ds"].min() == ts("2025-03-01") and moved.windows["unique_id"].tolist() == ["kimi"]


@pytest.mark.parametrize(
    "third_line, reason, field",
    [
        ('{"timestamp": 70000, "input_length": 5', "bad_json", None),
        ('[1, 2]', "bad_json", None),
        ('{"input_length": 5}', "missing_field", "timestamp"),
        ('{"timestamp": -5}', "bad_timestamp", "timestamp"),
        ('{"timestamp": "soon"}', "bad_timestamp", "timestamp"),
    ],
)
def test_mooncake_bad_line_names_its_line_number(tmp_path, third_line, reason, field):
    text = '{"timestamp": 0}\n\n' + third_line + '\n{"timestamp": 61000}\n'  # line 2 is blank
    with pytest.raises(IngestError) as err:
        read_trace(write(tmp_path / "trace.jsonl", text), fmt="mooncake")
    assert (err.value.reason, err.value.row, err.value.field) == (reason, 3, field)


def test_mooncake_blank_lines_are_skipped_and_rows_are_line_numbers(tmp_path):
    text = '{"timestamp": 0}\n\n{"timestamp": 59999}\n{"timestamp": 61000}\n'
    trace = read_trace(write(tmp_path / "trace.jsonl", text))
    assert trace.raw[["y", "row"]].values.tolist() == [[2, 1], [1, 4]]
    assert trace.raw["ds"].tolist() == [ts("2024-01-01 00:00"), ts("2024-01-01 00:01")]


# --------------------------------------------------------------------------- azure2021


def test_azure2021_sample_counts_invocation_starts():
    with open(sample_path(AZURE2021_EXCERPT), newline="") as fh:
        rows = list(csv.DictReader(fh))
    origin = ts("2021-01-31")
    expected = Counter(
        (r["func"], origin + timedelta(minutes=math.floor((float(r["end_timestamp"]) - float(r["duration"])) / 60)))
        for r in rows
    )
    trace = read_trace(sample_path(AZURE2021_EXCERPT))
    assert (trace.step_seconds, trace.source) == (60, "trace:azure2021")
    got = {(u, d): y for u, d, y in zip(trace.raw["unique_id"], trace.raw["ds"], trace.raw["y"])}
    assert got == dict(expected)
    assert len(rows) == 199 and len(got) == 151
    assert len(trace.windows) == 31
    assert (trace.windows["start"] == origin).all() and (trace.windows["end"] == ts("2021-01-31 00:21")).all()
    batch = batch_of(trace)
    assert batch.total_invocations == 199 and batch.covered_steps == 31 * 21


@pytest.mark.parametrize(
    "row3, reason, field",
    [
        ("a,f2,12.5,", "not_a_number", "duration"),
        ("a,f2,ten,1.0", "not_a_number", "end_timestamp"),
        ("a,f2,12.5,-1.0", "negative_duration", "duration"),
        ("a,,12.5,1.0", "missing_model", "func"),
    ],
)
def test_azure2021_bad_row(tmp_path, row3, reason, field):
    text = "app,func,end_timestamp,duration\na,f1,0.5,0.1\na,f1,70.0,5.0\n" + row3 + "\n"
    with pytest.raises(IngestError) as err:
        read_trace(write(tmp_path / "inv.csv", text))
    assert (err.value.reason, err.value.row, err.value.field) == (reason, 3, field)


def test_azure2021_invocation_before_trace_start_widens_the_window(tmp_path):
    text = "app,func,end_timestamp,duration\na,f1,10.0,70.0\na,f2,130.0,1.0\n"
    trace = read_trace(write(tmp_path / "inv.csv", text))
    assert trace.raw["ds"].tolist() == [ts("2021-01-30 23:59"), ts("2021-01-31 00:02")]
    assert (trace.windows["start"] == ts("2021-01-30 23:59")).all()
    assert (trace.windows["end"] == ts("2021-01-31 00:03")).all()
    assert batch_of(trace).covered_steps == 2 * 4


# --------------------------------------------------------------------------- long


def test_long_csv_round_trip_with_step(tmp_path):
    text = (
        "unique_id,ds,y\n"
        "m1,2024-01-01T00:00:00Z,3\n"
        "m1,2024-01-01T00:05:00Z,0\n"
        "m1,2024-01-01T00:10:00Z,4\n"
        "m2,2024-01-01 00:05:00,7\n"
    )
    trace = read_trace(write(tmp_path / "c.csv", text), step_seconds=300)
    assert (trace.step_seconds, trace.source, trace.windows) == (300, "trace:long", None)
    assert trace.raw["row"].tolist() == [1, 2, 3, 4] and set(trace.raw["field"]) == {"y"}
    assert trace.raw["ds"].iloc[3] == ts("2024-01-01 00:05")
    batch = batch_of(trace)
    assert batch.total_invocations == 14 and len(batch.counts) == 3
    assert batch.covered_steps == 3 + 1
    assert batch.windows.set_index("unique_id").loc["m1", "end"] == ts("2024-01-01 00:15")


def test_long_parquet_round_trip(tmp_path):
    frame = pd.DataFrame(
        {
            "unique_id": ["a", "a", "b"],
            "ds": pd.to_datetime(["2024-01-01 01:00", "2024-01-01 01:01", "2024-01-01 01:00"]).tz_localize("Europe/Berlin"),
            "y": [1, 2, 5],
        }
    )
    path = tmp_path / "c.parquet"
    frame.to_parquet(path)
    trace = read_trace(path)
    assert trace.raw["ds"].tolist()[:2] == [ts("2024-01-01 00:00"), ts("2024-01-01 00:01")]
    assert batch_of(trace).total_invocations == 8


@pytest.mark.parametrize(
    "body, reason, row, field",
    [
        ("m,2024-01-01T00:00:00Z,1\nm,2024-01-01T00:01:00Z,-2\n", "negative_count", 2, "y"),
        ("m,2024-01-01T00:00:00Z,1\nm,2024-01-01T00:00:00Z,2\n", "duplicate", 2, "ds"),
        ("m,2024-01-01T00:00:00Z,1\n,2024-01-01T00:01:00Z,2\n", "missing_model", 2, "unique_id"),
    ],
)
def test_long_bad_rows_are_named_by_validation(tmp_path, body, reason, row, field):
    trace = read_trace(write(tmp_path / "c.csv", "unique_id,ds,y\n" + body))
    with pytest.raises(IngestError) as err:
        batch_of(trace)
    assert (err.value.reason, err.value.row, err.value.field) == (reason, row, field)


def test_long_timestamps_and_columns_checked_by_reader(tmp_path):
    with pytest.raises(IngestError) as err:
        read_trace(write(tmp_path / "a.csv", "unique_id,ds,y\nm,2024-01-01,1\nm,not a time,1\n"))
    assert (err.value.reason, err.value.row, err.value.field, err.value.value) == ("bad_timestamp", 2, "ds", "not a time")
    # epoch numbers are refused rather than read as nanoseconds since 1970
    with pytest.raises(IngestError) as err:
        read_trace(write(tmp_path / "b.csv", "unique_id,ds,y\nm,1700000000,1\n"))
    assert (err.value.reason, err.value.row, err.value.value) == ("bad_timestamp", 1, "1700000000")
    epochs = tmp_path / "b.parquet"
    pd.DataFrame({"unique_id": ["m"], "ds": [1_700_000_000], "y": [1]}).to_parquet(epochs)
    with pytest.raises(IngestError, match="numbers") as err:
        read_trace(epochs)
    assert (err.value.reason, err.value.field) == ("bad_timestamp", "ds")
    with pytest.raises(IngestError, match=r"\['ds', 'y'\]") as err:
        read_trace(write(tmp_path / "c.csv", "unique_id,time,count\nm,2024-01-01,1\n"), fmt="long")
    assert (err.value.reason, err.value.field) == ("missing_column", "ds")


# --------------------------------------------------------------------------- shipped data


def test_sample_path_resolves_every_shipped_file():
    for name in SAMPLE_FILES:
        path = sample_path(name)
        assert path.is_file() and path.parent == REPO_ROOT / "forecaster" / "data"
    assert not any("huawei" in name or "datacentre" in name for name in SAMPLE_FILES)
    assert not list((REPO_ROOT / "forecaster" / "data").glob("*datacentre*"))
    with pytest.raises(KeyError, match="unknown sample"):
        sample_path("datacentre_4.csv.gz")


@needs_traces
def test_make_samples_reproduces_the_shipped_files(tmp_path):
    spec = importlib.util.spec_from_file_location("make_samples", REPO_ROOT / "scripts" / "make_samples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([str(TRACES_DIR), "--out", str(tmp_path)]) == 0
    for name in SAMPLE_FILES:
        assert (tmp_path / name).read_bytes() == sample_path(name).read_bytes(), name


# --------------------------------------------------------------------------- a trace split in parts, stored


def _stored_total(engine) -> int:
    from sqlalchemy import text

    with engine.connect() as conn:
        return int(conn.execute(text("SELECT coalesce(sum(count), 0) FROM invocations")).scalar())


@pytest.mark.parametrize("name, split", [(AZURE2021_EXCERPT, 100), (MOONCAKE_HEAD, 1000)])
def test_a_trace_split_in_two_files_keeps_both_parts_but_what_they_share(engine, settings, now, tmp_path, name,
                                                                          split):
    """Per-request traces covered every model from the trace's origin: the second part of a split file zeroed
    the first part's minutes (Azure 2021: 115 of 199 invocations stored; Mooncake 1,000 of 2,000), with exit 0.
    Each file now covers the minutes from its first request to its last; what the second replaces of the first
    (the minutes they share) is named in a warning."""
    from forecaster.ingest.service import ingest_trace_file

    fmt = "azure2021" if name == AZURE2021_EXCERPT else "mooncake"
    source = sample_path(name)
    with (gzip.open(source, "rt") if source.suffix == ".gz" else open(source, newline="")) as fh:
        lines = fh.readlines()
    header, body = (lines[:1], lines[1:]) if fmt == "azure2021" else ([], lines)
    parts = [write(tmp_path / f"part{k}.{'csv' if header else 'jsonl'}", "".join(header + chunk))
             for k, chunk in enumerate((body[:split], body[split:]))]
    results = [ingest_trace_file(engine, settings, part, now=now, fmt=fmt, register=True) for part in parts]
    first, second = (read_trace(part, fmt=fmt) for part in parts)
    covered = {u: (b, e) for u, b, e in second.windows[["unique_id", "start", "end"]].itertuples(index=False)}
    replaced = sum(int(y) for u, d, y in first.raw[["unique_id", "ds", "y"]].itertuples(index=False)
                   if u in covered and covered[u][0] <= d < covered[u][1])
    total = int(read_trace(source).raw["y"].sum())
    assert _stored_total(engine) == total - replaced and replaced < total // 10
    assert not results[0].warnings
    assert any("already stored, and replaced them" in w for w in results[1].warnings) == bool(replaced)




@pytest.mark.parametrize("fmt, text, row, field", [
    ("mooncake", '{"timestamp": 0}\n{"timestamp": 1e308}\n', 2, "timestamp"),
    ("azure2021", "app,func,end_timestamp,duration\na,f1,0.5,0.1\na,f1,1e308,1.0\n", 2, "end_timestamp"),
    ("long", "unique_id,ds,y\nm,2024-01-01T00:00:00Z,1\nm,01/02/2024,1\n", 2, "ds"),
    ("long", "unique_id,ds,y\nm,today,1\n", 1, "ds"),
    ("huawei5min", "date,c1\n2016-07-01 00:00:00,1.0\n13/02/2016,2.0\n", 2, "date"),
])
def test_times_no_reader_can_place_are_refused_naming_the_row(tmp_path, fmt, text, row, field):
    """An offset of 1e308 ms wrapped int64 and was counted at the trace's origin (exit 0); ``01/02/2024`` and
    ``13/02/2024`` were read as two different formats, and ``today`` as the moment of the ingest."""
    with pytest.raises(IngestError) as refused:
        read_trace(write(tmp_path / ("t.jsonl" if fmt == "mooncake" else "t.csv"), text), fmt=fmt)
    assert (refused.value.reason, refused.value.row, refused.value.field) == ("bad_timestamp", row, field)


# --------------------------------------------------------------------------- damaged headers and missing steps


AZ19_HEAD = "HashOwner,HashApp,HashFunction,Trigger,"


@pytest.mark.parametrize("fmt, text, name", [
    ("azure2019", AZ19_HEAD + "minute_1,minute_2,minute_2\no,a,f1,http,1,2,30\n", "minute_2"),
    ("huawei5min", "date,chA,chA\n2016-01-01 00:00:00,5,7\n2016-01-01 00:05:00,1,1\n", "chA"),
    ("long", "unique_id,ds,y,y\nly,2024-04-01T00:00:00Z,1,500\n", "y"),
    ("azure2021", "app,func,end_timestamp,duration,end_timestamp\na,fz,1.0,0.5,99999.0\n", "end_timestamp"),
    ("azure2019", AZ19_HEAD + "minute_1,minute_2, minute_2\no,a,f1,http,1,2,30\n", "minute_2"),
])
def test_a_repeated_header_name_is_refused(tmp_path, fmt, text, name):
    """pandas renamed a repeated name ``name.1``: Azure 2019 dropped the second minute_2 (30 requests lost),
    Huawei ingested ``chA.1`` as a model, long and Azure 2021 ignored the second copy; all exit 0."""
    with pytest.raises(IngestError, match="appears twice") as refused:
        read_trace(write(tmp_path / "t.csv", text), fmt=fmt)
    assert (refused.value.reason, refused.value.field) == ("duplicate_column", name)


@pytest.mark.parametrize("fmt, text", [
    ("long", "unique_id,ds,y\nly,2024-04-01T00:00:00Z,1,7\nly,2024-04-01T00:01:00Z,2,7\n"),
    ("huawei5min", "date,chA\n2016-01-01 00:00:00,5,7\n2016-01-01 00:05:00,1,1\n"),
    ("azure2019", AZ19_HEAD + "minute_1,minute_2\no,a,f1,http,1,2,30\n"),
])
def test_rows_with_one_field_more_than_the_header_are_refused(tmp_path, fmt, text):
    """With one trailing field on every row pandas took the first column as the index and shifted every name one
    column right (the long file's ``y`` read the 7s); each was read without an error."""
    with pytest.raises(IngestError, match="more fields than the header") as refused:
        read_trace(write(tmp_path / "t.csv", text), fmt=fmt)
    assert refused.value.reason == "extra_field"


def test_azure2019_header_names_are_stripped_and_other_columns_refused(tmp_path):
    """``minute_2 `` (a trailing space) was skipped and its minute stored as a known zero (50 requests lost)."""
    spaced = read_trace(write(tmp_path / "a.csv", AZ19_HEAD + "minute_1,minute_2 ,minute_3\no,a,f2,http,1,50,3\n"))
    batch = batch_of(spaced)
    assert batch.total_invocations == 54 and batch.covered_steps == 3
    assert batch.counts.set_index("ds").loc[ts("2019-07-15 00:01"), "y"] == 50
    for header, field in [(AZ19_HEAD + "minute_1,Region,minute_2", "Region"),
                          (AZ19_HEAD + "minute_1,minute_two,minute_2", "minute_two"),
                          (AZ19_HEAD + "minute_1,,minute_2", "column 6")]:
        with pytest.raises(IngestError, match="azure2019") as refused:
            read_trace(write(tmp_path / "b.csv", header + "\no,a,f2,http,1,50,3\n"), fmt="azure2019")
        assert (refused.value.reason, refused.value.field) == ("unknown_column", field)
    # Huawei: every other column is a channel, but it must have a name (pandas called it "Unnamed: 2", a model)
    with pytest.raises(IngestError, match="column 3 has no name") as refused:
        read_trace(write(tmp_path / "c.csv", "date,c1,\n2016-01-01 00:00:00,1,2\n"), fmt="huawei5min")
    assert refused.value.reason == "unknown_column"


@pytest.mark.parametrize("fmt, text, field, value", [
    ("azure2019", AZ19_HEAD + "minute_1,minute_3\no,a,f3,http,1,3\n", "minute_2", None),
    ("azure2019", AZ19_HEAD + "minute_3,minute_2\no,a,f3,http,1,3\n", "minute_1", None),
    ("huawei5min", "date,hwgap\n2016-02-01 00:00:00,5\n2016-02-01 00:15:00,7\n", "date", "2016-02-01T00:05:00+00:00"),
])
def test_a_missing_step_is_refused_not_stored_as_zero(tmp_path, fmt, text, field, value):
    """A missing minute column or date row was covered by the window: stored as a known zero, exit 0."""
    with pytest.raises(IngestError, match="not a zero") as refused:
        read_trace(write(tmp_path / "t.csv", text), fmt=fmt)
    assert (refused.value.reason, refused.value.field) == ("missing_step", field)
    if value:
        assert refused.value.value == value


def test_huawei_dates_must_be_5_minute_steps_each_once(tmp_path):
    with pytest.raises(IngestError) as refused:  # both zero: validation never saw the repeat
        read_trace(write(tmp_path / "t.csv", "date,c\n2016-01-01 00:00:00,0\n2016-01-01 00:00:00,0\n"))
    assert (refused.value.reason, refused.value.row, refused.value.field) == ("duplicate", 2, "date")
    with pytest.raises(IngestError) as refused:
        read_trace(write(tmp_path / "t.csv", "date,c\n2016-01-01 00:00:00,0\n2016-01-01 00:03:00,1\n"))
    assert (refused.value.reason, refused.value.row, refused.value.field) == ("bad_timestamp", 2, "date")


@pytest.mark.parametrize("fmt, text, row, field", [
    ("azure2019", AZ19_HEAD + "minute_1,minute_600000000\no,a,f4,http,1,3\n", None, "minute_600000000"),
    ("huawei5min", "date,c\n2300-01-01 00:00:00,5\n", 1, "date"),
    ("long", "unique_id,ds,y\nm,2300-01-01T00:00:00Z,5\n", 1, "ds"),
])
def test_an_absurd_minute_or_date_is_named(tmp_path, fmt, text, row, field):
    """'Cannot cast 694444 days ... without overflow' / 'Out of bounds nanosecond timestamp' named neither the
    column nor the row."""
    with pytest.raises(IngestError) as refused:
        batch_of(read_trace(write(tmp_path / "t.csv", text), fmt=fmt))
    assert (refused.value.row, refused.value.field) == (row, field)


@pytest.mark.parametrize("path", [AZURE2019_FULL, HUAWEI_FULL])
def test_without_zeros_the_batch_is_the_same(path):
    """Ingest reads a wide file without its zero cells (a raw row per cell took ~90x the file's size in memory):
    the same counts, windows and covered steps as every cell gives."""
    if not path.is_file():
        pytest.skip(f"{path} not found")
    full, sparse = read_trace(path), read_trace(path, keep_zeros=False)
    assert len(sparse.raw) == int((full.raw["y"] != 0).sum()) < len(full.raw)
    a, b = batch_of(full), batch_of(sparse)
    pd.testing.assert_frame_equal(a.counts, b.counts)
    pd.testing.assert_frame_equal(a.windows, b.windows)
    assert a.covered_steps == b.covered_steps and a.total_invocations == b.total_invocations


@pytest.mark.parametrize("fmt, text, row, field", [
    ("long", "unique_id,ds,y\nbig,2024-03-01T00:00:00Z,9007199254740993\n", 1, "y"),
    ("azure2019", AZ19_HEAD + "minute_1,minute_2\no,a,f5,http,1,9007199254740993\n", 1, "minute_2"),
])
def test_a_count_of_2_to_the_53_plus_1_is_refused_not_rounded(tmp_path, fmt, text, row, field):
    """An int64 column went through float64, where 2^53 + 1 is 2^53: stored off by one."""
    with pytest.raises(IngestError, match="9007199254740993") as refused:
        batch_of(read_trace(write(tmp_path / "t.csv", text), fmt=fmt))
    assert (refused.value.reason, refused.value.row, refused.value.field) == ("count_too_large", row, field)
    fine = text.replace("9007199254740993", "9007199254740992")
    assert batch_of(read_trace(write(tmp_path / "t.csv", fine), fmt=fmt)).counts["y"].max() == 2**53


# --------------------------------------------------------------------------- ingest_trace_file: validate, then read


@pytest.mark.parametrize("fmt, text", [
    ("azure2019", AZ19_HEAD + "minute_1,minute_2\no,a,f\x00z,http,1,2\n"),
    ("azure2019", AZ19_HEAD + "minute_1,minute_2\no,a,f1,http,1,2\no,a,f\x00z,http,0,0\n"),  # no count at all
    ("azure2021", "app,func,end_timestamp,duration\na,f\x00z,1.0,0.5\n"),
])
def test_a_nul_in_a_model_id_is_the_validators_message(engine, settings, now, tmp_path, fmt, text):
    """The overlap read ran before validation: PostgreSQL's DataError (exit 1) instead of the precise message."""
    from forecaster.ingest.service import ingest_trace_file

    with pytest.raises(IngestError, match="U\\+0000") as refused:
        ingest_trace_file(engine, settings, write(tmp_path / "t.csv", text), now=now, fmt=fmt, register=True)
    assert (refused.value.reason, refused.value.field) == ("bad_model_id", "unique_id")
    assert _stored_total(engine) == 0


@pytest.mark.parametrize("register", [True, False])
def test_the_reads_before_the_write_are_retried(engine, settings, now, tmp_path, monkeypatch, register):
    """The overlap read and the catalogue read ran once: the database gone for a moment ended the ingest (exit 1)
    where the write retries."""
    from sqlalchemy.exc import OperationalError

    from forecaster.ingest import service
    from forecaster.store.catalog import register_missing

    if not register:
        with engine.begin() as conn:
            register_missing(conn, ["f1"])
    calls = Counter()

    def failing_once(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            if calls[name] == 1:
                raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly"))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(service, "covered_within", failing_once("covered_within", service.covered_within))
    monkeypatch.setattr(service, "known_model_ids", failing_once("known_model_ids", service.known_model_ids))
    path = write(tmp_path / "t.csv", AZ19_HEAD + "minute_1,minute_2\no,a,f1,http,1,2\n")
    result = service.ingest_trace_file(engine, settings, path, now=now, register=register)
    assert result.invocations == 3 and _stored_total(engine) == 3
    assert calls == Counter({"covered_within": 2, **({} if register else {"known_model_ids": 2})})
