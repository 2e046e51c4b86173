"""Small real trace samples shipped with the package, for the demo and the tests.

See ``README.md`` in this folder for each file's origin, licence and how it was
cut (``scripts/make_samples.py`` regenerates them).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

#: 100 busiest functions of the Azure Functions 2019 one-day sample (wide, per minute).
AZURE2019_TOP100 = "azure2019_top100.csv.gz"
#: Azure Functions 2021 per-invocation excerpt (199 invocations, 31 functions).
AZURE2021_EXCERPT = "azure2021_excerpt.csv"
#: First 2,000 requests of the Azure LLM inference 2023 code trace.
AZURE_LLM2023_CODE_HEAD = "azure_llm2023_code_head.csv"
#: First 2,000 requests of the Mooncake FAST'25 conversation trace.
MOONCAKE_HEAD = "mooncake_head.jsonl.gz"

SAMPLE_FILES = (AZURE2019_TOP100, AZURE2021_EXCERPT, AZURE_LLM2023_CODE_HEAD, MOONCAKE_HEAD)


def sample_path(name: str) -> Path:
    """Filesystem path of the shipped sample ``name`` (one of :data:`SAMPLE_FILES`).

    Raises:
        KeyError: ``name`` is not a shipped sample.
        FileNotFoundError: the package was installed without its data files.
    """
    if name not in SAMPLE_FILES:
        raise KeyError(f"unknown sample {name!r}; expected one of {list(SAMPLE_FILES)}")
    path = Path(str(files(__name__).joinpath(name)))
    if not path.is_file():
        raise FileNotFoundError(f"sample {name!r} is missing at {path}; was package data installed?")
    return path
