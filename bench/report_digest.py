"""A SHA-256 of the numbers of ``prewarm report``, to hold a speed-up to bit-identical results.

Every number of the report's JSON goes into the digest except those that measure this machine's time: the stage
seconds, ``generated_at``, each policy's ``wall_s`` and the forecaster's fit and forecast seconds
(:data:`TIMINGS`). The JSON is canonicalised (sorted keys, Python's shortest round-trip float repr), so two
reports have the same digest exactly when every other number is bit-identical. Per-section digests say where two
reports differ.

Either digest a report already written (its ``--json``, or the HTML page, which embeds the same JSON), or run one
with ``bench/report.py``'s seeding (the shipped sample resampled into ``--days`` days of ``--models`` models in an
embedded PostgreSQL, the product's defaults) in the checkout ``--repo`` (default: this one), so that a base commit
checked out elsewhere gives the reference digest::

    .venv/bin/python bench/report_digest.py /tmp/rep/final.html
    nice -n 19 .venv/bin/python bench/report_digest.py --run [--days 2] [--models 40] [--since 1d] [--repo DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: keys whose values measure time on this machine, not the replay: left out of the digest wherever they appear
TIMINGS = frozenset({"stage_seconds", "generated_at", "wall_s", "fit_seconds", "member_fit_seconds",
                     "forecast_seconds"})
REPORT_DATA = re.compile(r'<script type="application/json" id="report-data">(.*?)</script>', re.DOTALL)


def load_numbers(path: Path) -> dict:
    """The report's numbers from its ``--json`` file or from the HTML page that embeds them."""
    text = path.read_text()
    if path.suffix.lower() in (".html", ".htm"):
        match = REPORT_DATA.search(text)
        if match is None:
            raise SystemExit(f"{path}: no report-data script in the page")
        text = html.unescape(match.group(1)) if "&quot;" in match.group(1) else match.group(1)
    return json.loads(text)


def without_timings(value):
    """``value`` with every key of :data:`TIMINGS` removed, recursively."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def digest(value) -> str:
    """SHA-256 of ``value``'s canonical JSON (sorted keys, no whitespace), timings left out."""
    text = json.dumps(without_timings(value), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def show(numbers: dict) -> None:
    """Print the digest, one per top-level section, and the headline cold-start requests."""
    print(f"digest {digest(numbers)}")
    for section in sorted(numbers):
        print(f"  {section:<12}{digest(numbers[section])}")
    cold = {name: row.get("cold_requests") for name, row in numbers.get("policies", {}).items()}
    print(f"  cold-start requests: {cold}; scored minutes {numbers['report'].get('scored_minutes')}")


def run(repo: Path, days: int, models: int, since: str) -> dict:
    """Run ``bench/report.py`` of ``repo`` on ``days`` x ``models`` and return the numbers of its report."""
    with tempfile.TemporaryDirectory(prefix="prewarm-digest-") as tmp:
        page = Path(tmp) / "report.html"
        started = time.perf_counter()
        subprocess.run([sys.executable, str(repo / "bench" / "report.py"), "--days", str(days), "--models",
                        str(models), "--since", since, "--out", str(page)], cwd=repo, check=True)
        print(f"ran {days} days x {models} models (--since {since}) in {repo} in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        return load_numbers(page)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", nargs="?", type=Path, help="A report's --json file or HTML page.")
    parser.add_argument("--run", action="store_true", help="Run bench/report.py and digest its report.")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--days", type=int, default=2)
    parser.add_argument("--models", type=int, default=40)
    parser.add_argument("--since", default="1d")
    args = parser.parse_args()
    if (args.report is None) == (not args.run):
        parser.error("give a report file or --run, not both")
    show(load_numbers(args.report) if args.report else run(args.repo.resolve(), args.days, args.models, args.since))


if __name__ == "__main__":
    main()
