"""Ingest benchmark: the whole Azure Functions 2019 day through COPY vs plain ORM inserts.

Usage:
    python bench/ingest.py [--traces DIR] [--json PATH] [--orm-limit N]
    python bench/ingest.py --memory [FILE ...]

Both paths start from the same validated batch (1,350 functions x 1,440
minutes; zero minutes are covered but not stored) and each writes into its own
fresh database on the same PostgreSQL server (embedded unless
PREWARM_BENCH_ADMIN_URL names one). Figures:

* end-to-end: read + validate + write, as ``prewarm ingest trace`` does;
* write only: the database part, COPY vs ``Session.add_all`` of ORM objects;
* rows = non-zero (model, minute) rows written.

``--memory`` instead runs ``prewarm ingest trace FILE --register`` (default: the Azure day) in a child process
per file, each into a fresh database, and reports its peak RSS and wall time; it checks that the invocations
stored add up to the sum of the file's minute cells (read here with plain csv). Peak RSS of ``prewarm ingest trace``
(``/usr/bin/time -f "%e s maxrss %M KB"``, one shared 2-CPU machine, 2026-12-07, same PostgreSQL; times are
noisy there, RSS is not):

=====================================  =========  ====================  ======================
Azure 2019 wide CSV                    main       reader: no zero rows  + COPY in pieces, no
                                                                        key arrays for zeroed
=====================================  =========  ====================  ======================
the day, 1,350 fn (4.2 MB csv)         584 MB     484 MB                321 MB
az19_x5.csv, 6,750 fn (20.8 MB csv)    1,890 MB   1,591 MB              703 MB
=====================================  =========  ====================  ======================

Stored rows, sums and coverage are identical before and after (md5 of the ordered rows). Before, every cell
(83% zeros) became a row of a long frame; the write then held the whole COPY text at once and sent the batch's
keys as Python lists of datetimes to find the stored counts it zeroes.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchdb import fresh_database, on_bench_server  # noqa: E402
from forecaster.ingest.traces import read_trace  # noqa: E402
from forecaster.ingest.validate import build_count_batch  # noqa: E402
from forecaster.store.catalog import register_missing  # noqa: E402
from forecaster.store.db import make_engine  # noqa: E402
from forecaster.store.invocations import write_count_batch  # noqa: E402
from forecaster.store.partitions import ensure_partitions  # noqa: E402
from forecaster.store.tables import Invocation  # noqa: E402

AZURE_DAY = "azure_functions_2019_sample1350/invocations_per_function_1day_1350fn.csv.gz"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def parse_and_validate(path: Path, now: datetime):
    trace = read_trace(path, fmt="azure2019")
    return build_count_batch(trace.raw, source=trace.source, step_seconds=trace.step_seconds, now=now,
                             windows=trace.windows)


def run(admin_url: str, path: Path, orm_limit: int | None) -> dict:
    now = datetime.now(timezone.utc)

    # --- COPY path, end to end ------------------------------------------
    engine = make_engine(fresh_database(admin_url, "bench_ingest_copy"))
    started = time.perf_counter()
    batch = parse_and_validate(path, now)
    parsed_at = time.perf_counter()
    result = write_count_batch(engine, batch, register_models=True)
    copy_end = time.perf_counter()
    copy_peak = peak_rss_mb()
    started_again = time.perf_counter()
    again = write_count_batch(engine, batch, register_models=True)
    duplicate_s = time.perf_counter() - started_again
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT count(*), sum(count) FROM invocations")).one()
    engine.dispose()
    assert stored[0] == result.rows_written and stored[1] == batch.total_invocations, stored
    assert again.duplicate

    # --- ORM path: same validated rows, one Invocation object each ----------
    counts = batch.counts if orm_limit is None else batch.counts.head(orm_limit)
    engine = make_engine(fresh_database(admin_url, "bench_ingest_orm"))
    ensure_partitions(engine, batch.windows["start"].min().to_pydatetime(), batch.windows["end"].max().to_pydatetime())
    orm_started = time.perf_counter()
    with Session(engine) as session, session.begin():
        register_missing(session.connection(), batch.model_ids)
        session.add_all(
            Invocation(model_id=m, minute=d.to_pydatetime(), count=int(y))
            for m, d, y in zip(counts["unique_id"], counts["ds"], counts["y"])
        )
    orm_write_s = time.perf_counter() - orm_started
    engine.dispose()

    parse_s = parsed_at - started
    copy_write_s = copy_end - parsed_at
    copy_total_s = copy_end - started
    rows = result.rows_written
    orm_rows = len(counts)
    orm_total_s = parse_s + orm_write_s * (rows / orm_rows)  # extrapolated only when --orm-limit is set
    return {
        "models": result.models,
        "cells": result.covered_steps,
        "rows_written": rows,
        "invocations": result.invocations,
        "parse_validate_seconds": round(parse_s, 3),
        "copy_seconds": round(copy_total_s, 3),
        "copy_write_seconds": round(copy_write_s, 3),
        "copy_rows_per_s": round(rows / copy_total_s, 1),
        "copy_write_rows_per_s": round(rows / copy_write_s, 1),
        "copy_cells_per_s": round(result.covered_steps / copy_total_s, 1),
        "duplicate_reingest_seconds": round(duplicate_s, 3),
        "orm_rows": orm_rows,
        "orm_write_seconds": round(orm_write_s, 3),
        "orm_seconds": round(orm_total_s, 3),
        "orm_rows_per_s": round(rows / orm_total_s, 1),
        "orm_write_rows_per_s": round(orm_rows / orm_write_s, 1),
        "ratio": round((rows / copy_total_s) / (rows / orm_total_s), 2),
        "write_ratio": round((rows / copy_write_s) / (orm_rows / orm_write_s), 2),
        "peak_rss_mb": round(copy_peak, 1),
        "peak_rss_mb_after_orm": round(peak_rss_mb(), 1),
    }


def file_total(path: Path) -> int:
    """The sum of an Azure 2019 file's minute cells, read with plain csv."""
    with (gzip.open(path, "rt", newline="") if path.read_bytes()[:2] == b"\x1f\x8b" else open(path, newline="")) as fh:
        reader = csv.reader(fh)
        header = next(reader)
        minutes = [i for i, name in enumerate(header) if name.strip().startswith("minute_")]
        return sum(int(row[i]) for row in reader if row for i in minutes)


def ingest_memory(admin_url: str, paths: list[Path]) -> list[dict]:
    """Peak RSS and wall time of ``prewarm ingest trace`` on each file, each in its own child and database."""
    figures = []
    for k, path in enumerate(paths):
        url = fresh_database(admin_url, f"bench_ingest_memory_{k}")
        env = {**os.environ, "PREWARM_DATABASE_URL": url, "PYTHONPATH": str(REPO)}
        started = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "forecaster.cli", "ingest", "trace", str(path), "--register"],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        out = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
        if child.returncode:
            sys.exit(f"ingest of {path} exited {child.returncode}")
        engine = make_engine(url)
        with engine.connect() as conn:
            stored = int(conn.execute(text("SELECT coalesce(sum(count), 0) FROM invocations")).scalar())
        engine.dispose()
        expected = file_total(path)
        assert stored == expected == json.loads(out)["invocations"], (stored, expected)
        figures.append({"file": str(path), "peak_rss_mb": round(usage.ru_maxrss / 1024.0, 1),
                        "seconds": round(seconds, 2), "invocations": stored})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path,
                        default=Path(os.environ.get("PREWARM_TRACES_DIR", REPO.parent / "shared" / "traces")))
    parser.add_argument("--json", type=Path, help="Also write the figures to this JSON file.")
    parser.add_argument("--orm-limit", type=int, help="Insert only N rows through the ORM and extrapolate.")
    parser.add_argument("--memory", nargs="*", type=Path, metavar="FILE",
                        help="Peak RSS of 'prewarm ingest trace' on each FILE (default: the Azure day).")
    args = parser.parse_args()
    path = args.traces / AZURE_DAY
    if args.memory is not None:
        paths = args.memory or [path]
        figures = on_bench_server(lambda url: ingest_memory(url, paths), prefix="prewarm-bench-ingest-")
        for row in figures:
            print(f"{row['file']}: peak RSS {row['peak_rss_mb']:,.0f} MB, {row['seconds']:.1f} s, "
                  f"{row['invocations']:,} invocations stored (= the file's sum)")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")
        return
    if not path.is_file():
        sys.exit(f"trace not found: {path} (set --traces or PREWARM_TRACES_DIR)")

    figures = on_bench_server(lambda url: run(url, path, args.orm_limit), prefix="prewarm-bench-ingest-")

    print(f"Azure Functions 2019 day: {figures['models']:,} functions, {figures['cells']:,} model-minutes, "
          f"{figures['rows_written']:,} non-zero rows, {figures['invocations']:,} invocations")
    print(f"{'path':<8}{'end-to-end s':>14}{'rows/s':>12}{'write-only s':>14}{'write rows/s':>14}")
    print(f"{'COPY':<8}{figures['copy_seconds']:>14.2f}{figures['copy_rows_per_s']:>12,.0f}"
          f"{figures['copy_write_seconds']:>14.2f}{figures['copy_write_rows_per_s']:>14,.0f}")
    print(f"{'ORM':<8}{figures['orm_seconds']:>14.2f}{figures['orm_rows_per_s']:>12,.0f}"
          f"{figures['orm_write_seconds']:>14.2f}{figures['orm_write_rows_per_s']:>14,.0f}")
    print(f"ratio COPY/ORM: end-to-end {figures['ratio']:.1f}x, write-only {figures['write_ratio']:.1f}x; "
          f"parse+validate {figures['parse_validate_seconds']:.2f} s; duplicate re-ingest "
          f"{figures['duplicate_reingest_seconds']:.2f} s; peak RSS {figures['peak_rss_mb']:.0f} MB "
          f"(after ORM: {figures['peak_rss_mb_after_orm']:.0f} MB)")
    if args.orm_limit:
        print(f"note: ORM inserted {figures['orm_rows']:,} rows; its end-to-end time is extrapolated")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
