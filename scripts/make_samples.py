"""Regenerate the small trace samples shipped in ``forecaster/data/``.

Usage::

    python scripts/make_samples.py /path/to/shared/traces [--out forecaster/data]

The cut is deterministic: source lines are copied byte for byte (no
re-formatting of numbers), and gzip output has a zero mtime and no embedded
file name, so running this twice gives identical files. See
``forecaster/data/README.md`` for what each sample is and where it comes from.

The Huawei 5-minute slice is deliberately not sampled: it has no licence.
"""

from __future__ import annotations

import argparse
import gzip
import io
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

AZURE2019_SOURCE = "azure_functions_2019_sample1350/invocations_per_function_1day_1350fn.csv.gz"
AZURE2021_SOURCE = "azure_functions_2021_excerpt/Azure2021_200.csv"
AZURE_LLM_SOURCE = "azure_llm_inference_2023/AzureLLMInferenceTrace_code.csv"
MOONCAKE_SOURCE = "mooncake_kimi_fast25/conversation_trace.jsonl.gz"

TOP_FUNCTIONS = 100  # busiest Azure 2019 functions kept
HEAD_REQUESTS = 2000  # requests kept from the per-request traces


def _read_lines(path: Path) -> list[str]:
    """All lines of a plain or gzip text file, line endings kept."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", newline="") as fh:
        return fh.readlines()


def _write_gzip(path: Path, text: str) -> None:
    """Write ``text`` gzip-compressed, reproducibly (mtime 0, no file name)."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as gz:
        gz.write(text.encode("utf-8"))
    path.write_bytes(buffer.getvalue())


def azure2019_top(source: Path, out: Path, top: int = TOP_FUNCTIONS) -> int:
    """Keep the ``top`` functions with the most invocations over the day.

    Ties are broken by original position (earlier wins); the kept rows stay in
    their original order with the original header. Returns the rows kept.
    """
    header, *rows = _read_lines(source)
    columns = header.rstrip("\r\n").split(",")
    first_minute = columns.index("minute_1")
    totals = [sum(int(v) for v in row.rstrip("\r\n").split(",")[first_minute:]) for row in rows]
    ranked = sorted(range(len(rows)), key=lambda i: (-totals[i], i))
    keep = sorted(ranked[:top])
    _write_gzip(out, header + "".join(rows[i] for i in keep))
    return len(keep)


def head_lines(source: Path, out: Path, n: int, *, has_header: bool) -> int:
    """Copy the header (if any) plus the first ``n`` data lines; gzip if ``out`` ends in .gz."""
    lines = _read_lines(source)
    kept = lines[: n + 1] if has_header else lines[:n]
    text = "".join(kept)
    if out.suffix == ".gz":
        _write_gzip(out, text)
    else:
        with open(out, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
    return len(kept) - int(has_header)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", type=Path, help="folder holding the public traces (shared/traces)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "forecaster" / "data")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    n = azure2019_top(args.traces / AZURE2019_SOURCE, args.out / "azure2019_top100.csv.gz")
    print(f"azure2019_top100.csv.gz: {n} functions")
    shutil.copyfile(args.traces / AZURE2021_SOURCE, args.out / "azure2021_excerpt.csv")
    print("azure2021_excerpt.csv: copied")
    n = head_lines(args.traces / AZURE_LLM_SOURCE, args.out / "azure_llm2023_code_head.csv", HEAD_REQUESTS, has_header=True)
    print(f"azure_llm2023_code_head.csv: {n} requests")
    n = head_lines(args.traces / MOONCAKE_SOURCE, args.out / "mooncake_head.jsonl.gz", HEAD_REQUESTS, has_header=False)
    print(f"mooncake_head.jsonl.gz: {n} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
