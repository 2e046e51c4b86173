"""A scheduler process of its own for tests/test_job_leases.py: ``python -m tests.job_lease_child MODE URL ...``.

* ``hold URL JOB EVERY_S OFFSET_S NOW LEASE_S``: runs JOB's slot of NOW (ISO) once, the job sleeping a minute;
  prints ``owner <its claims' owner>`` (when it has one) and ``started`` once the job runs, for the test to kill it;
* ``loop URL JOB EVERY_S SLEEP_S SECONDS``: after a line on stdin, calls ``run_once`` for the current slot every
  50 ms for SECONDS seconds, the job sleeping SLEEP_S; prints one JSON line of its calls ``[start, end, ran]``.

``runs.LEASE_S`` is set as a module attribute, so the same child runs against code without leases.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from datetime import datetime, timezone

from forecaster.jobs import runs
from forecaster.jobs.runs import JobSpec, run_once
from forecaster.settings import Settings
from forecaster.store.db import make_engine


def main(mode: str, url: str, *args: str) -> None:
    engine = make_engine(url)
    settings = Settings(database_url=url, data_dir=tempfile.mkdtemp(prefix="prewarm-lease-child-"))
    if mode == "hold":
        job, every_s, offset_s, now, lease_s = args
        runs.LEASE_S = float(lease_s)
        owner = getattr(runs, "process_owner", None)
        print(f"owner {owner() if owner else ''}", flush=True)

        def hold(engine_, settings_, now_):
            print("started", flush=True)
            time.sleep(60)
            return {}

        run_once(engine, settings, JobSpec(job, hold, int(every_s), int(offset_s)), now=datetime.fromisoformat(now))
    elif mode == "loop":
        job, every_s, sleep_s, seconds = args
        spec = JobSpec(job, lambda e, s, n: time.sleep(float(sleep_s)) or {}, int(every_s))
        print("ready", flush=True)
        sys.stdin.readline()
        calls = []
        end = time.monotonic() + float(seconds)
        while time.monotonic() < end:
            started = time.monotonic()
            ran = run_once(engine, settings, spec, now=datetime.now(timezone.utc)) is not None
            calls.append([started, time.monotonic(), ran])
            time.sleep(0.05)
        print(json.dumps(calls), flush=True)
    engine.dispose()


if __name__ == "__main__":
    main(*sys.argv[1:])
