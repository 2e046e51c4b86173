"""Wall time of ``prewarm report --since 7d`` on 7 days x 100 models held in a real PostgreSQL, per stage.

The history is the shipped one-day sample (the 100 busiest Azure Functions 2019 functions) made into ``--days``
days by :func:`forecaster.report.sample.sample_history`: day ``d`` of a function is its own day with each minute's
count redrawn from a Poisson law around the observed count (seed ``d``), so each day keeps the daily shape and
sparsity and none repeats another. It is ingested with the product's ingest (COPY, coverage) into an embedded
PostgreSQL of its own, the models get catalogue entries and 32 nodes of 8 GPUs (``prewarm demo``'s fleet), and the
command runs as a user would run it: the product's default ensemble and planner settings.

Stages printed: seeding the store (not part of the report), then the report's own (``read_store``: counts and
catalogue; ``forecast``: the ensemble's fit and every minute's forecast; ``simulate_*``: each policy's replay, the
baselines in a second process while the main one forecasts and replays prewarm; ``write``), the whole command,
and the CPU seconds of all its processes (divided by the cores: the least wall time any schedule could reach).

    .venv/bin/python bench/report.py [--days 7] [--models 100] [--since 7d] [--json out.json] [--out report.html]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from typer.testing import CliRunner  # noqa: E402

from forecaster.cli import app  # noqa: E402
from forecaster.demo import DEMO_CLUSTER, register_fleet  # noqa: E402
from forecaster.ingest.service import ingest_frame  # noqa: E402
from forecaster.report.sample import sample_history, sample_windows  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
from forecaster.store.db import embedded_server, make_engine, upgrade  # noqa: E402

TARGET_S = 300.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--since", default="7d")
    parser.add_argument("--out", type=Path, default=None, help="Keep the HTML here (default: a temp dir).")
    parser.add_argument("--json", type=Path, default=None, help="Write the figures here.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prewarm-bench-report-") as tmp_text:
        tmp = Path(tmp_text)
        os.chmod(tmp, 0o755)
        with embedded_server(tmp / "pgdata") as url:
            engine = make_engine(url)
            upgrade(engine)
            settings = Settings(database_url=url, data_dir=tmp / "data", models_dir=tmp / "models")
            started = time.perf_counter()
            history = sample_history(args.models, args.days)
            ingest_frame(engine, settings, history, source="bench-report", step_seconds=60,
                         now=datetime.now(timezone.utc), windows=sample_windows(history, args.days), register=True)
            register_fleet(engine, history, config=DEMO_CLUSTER)
            engine.dispose()
            seed_s = time.perf_counter() - started
            print(f"seeded {args.models} models x {args.days} days ({int(history['y'].sum()):,} requests, "
                  f"{len(history):,} non-zero minutes) in {seed_s:.1f} s", flush=True)
            out = args.out or tmp / "report.html"
            figures = tmp / "report.json"
            env = {"DATABASE_URL": url, "PREWARM_DATA_DIR": str(tmp / "data"),
                   "PREWARM_MODELS_DIR": str(tmp / "models")}
            started, cpu, children = time.perf_counter(), time.process_time(), _children_cpu_s()
            result = CliRunner().invoke(app, ["report", "--since", args.since, "--out", str(out), "--json",
                                              str(figures)], env=env)
            wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
            children_cpu_s = _children_cpu_s() - children
            print(result.output, flush=True)
            if result.exit_code != 0:
                raise SystemExit(f"prewarm report failed ({result.exit_code}): {result.exception!r}")
            numbers = json.loads(figures.read_text())
            write = re.search(r"write_s ([0-9.]+)", result.output)
            stages = {**numbers["report"]["stage_seconds"], "write_s": float(write.group(1)) if write else None}
    print(f"\nprewarm report --since {args.since}: {args.models} models, {numbers['report']['scored_minutes']:,} "
          f"minutes scored")
    for name, seconds in stages.items():
        print(f"  {name:<28}{seconds:>8.1f} s")
    print(f"  {'whole command (wall)':<28}{wall_s:>8.1f} s   (main process CPU {cpu_s:.1f} s; target "
          f"{TARGET_S:.0f} s: {'met' if wall_s <= TARGET_S else 'NOT met'}); load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    total_cpu_s = cpu_s + children_cpu_s
    print(f"  {'CPU, all processes':<28}{total_cpu_s:>8.1f} s   (main {cpu_s:.1f} s + the report's child processes "
          f"{children_cpu_s:.1f} s): no schedule on {os.cpu_count()} cores can finish in less than "
          f"{total_cpu_s / (os.cpu_count() or 1):.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"models": args.models, "days": args.days, "since": args.since,
                                         "seed_s": seed_s, "wall_s": wall_s, "main_cpu_s": cpu_s,
                                         "children_cpu_s": children_cpu_s, "stages": stages,
                                         "target_s": TARGET_S}, indent=1))


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished child processes (the report's forecasting and baseline
    processes once joined; the embedded PostgreSQL is still running, so it is not counted)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
