"""Folders import downward only: the layer map below is the architecture, and this test holds the code to it.

A folder may import its own modules and any folder on a *lower* floor; an import of a folder on the same or a
higher floor fails the test with the file and line. ``api`` sits on top: nothing under ``forecaster/`` imports
it except the CLI, which wires the processes together.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: floor of each folder (a module directly under ``forecaster/`` counts as a folder of its own)
LAYERS: dict[str, int] = {
    "forecaster/contracts": 0, "forecaster/settings": 0, "forecaster/data": 0,
    "forecaster/store": 1,
    "forecaster/ingest": 2, "forecaster/distributed": 2,
    "forecaster/forecast": 3, "forecaster/coldstart": 3,
    "forecaster/planning": 4,
    "forecaster/agent": 5, "forecaster/actuation": 5,
    "forecaster/simulation": 6,
    "forecaster/jobs": 7,
    "forecaster/demo": 8, "forecaster/report": 8,
    "api": 9,
    "forecaster/cli": 10,
}
#: same-floor pairs allowed one way (none today: add one only with a reason)
SIDEWAYS: set[tuple[str, str]] = set()


def folder_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "api":
        return "api"
    if parts[0] == "forecaster" and len(parts) > 1:
        return f"forecaster/{parts[1]}"
    return None


def imports(path: Path) -> list[tuple[int, str]]:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            name = node.module
            if node.level:
                name = ".".join(module.split(".")[:-node.level] + [node.module])
            found.append((node.lineno, name))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def violations() -> list[str]:
    bad = []
    for path in sorted([*(ROOT / "forecaster").rglob("*.py"), *(ROOT / "api").rglob("*.py")]):
        source = folder_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if source is None or source == "forecaster/__init__":
            continue
        for line, name in imports(path):
            target = folder_of(name)
            if target is None or target == source or target == "forecaster/__init__":
                continue
            if source not in LAYERS or target not in LAYERS:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {source} or {target} has no floor in LAYERS")
            elif LAYERS[target] >= LAYERS[source] and (source, target) not in SIDEWAYS:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {source} (floor {LAYERS[source]}) imports {name} "
                           f"({target}, floor {LAYERS[target]})")
    return bad


def test_every_folder_imports_only_downward():
    assert violations() == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a store module importing the planner is reported."""
    fake = tmp_path / "forecaster" / "store"
    fake.mkdir(parents=True)
    (tmp_path / "api").mkdir()
    (fake / "bad.py").write_text("from forecaster.planning.planner import plan\nfrom forecaster.contracts import fleet\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = violations()
    assert len(found) == 1 and "forecaster/store (floor 1) imports forecaster.planning.planner" in found[0]


@pytest.mark.parametrize("folder", ["forecaster/contracts"])
def test_ground_floor_imports_nothing_of_the_project(folder):
    for path in (ROOT / folder).rglob("*.py"):
        for line, name in imports(path):
            target = folder_of(name)
            assert target in (None, folder), f"{path.relative_to(ROOT)}:{line} imports {name}"
