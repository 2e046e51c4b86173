"""SQL lives in ``forecaster/store/``: no other module of ``forecaster/`` runs a SQL statement of its own.

The check reads every string literal passed to SQLAlchemy's ``text()`` outside the store and fails on one that
starts with a SQL verb. ``PENDING`` lists the modules that still hold SQL, each with the reason; it may only
shrink (a test below fails when a listed file no longer needs its place).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SQL = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|DROP|ALTER|COPY|LOCK|SET)\b", re.IGNORECASE)
#: modules outside the store that still run SQL, and why (empty this list, do not grow it)
PENDING: dict[str, str] = {}


def sql_outside_store() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path in sorted((ROOT / "forecaster").rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        if relative.startswith("forecaster/store/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "text"):
                continue
            first = node.args[0] if node.args else None
            if isinstance(first, ast.JoinedStr):
                first = next((v for v in first.values if isinstance(v, ast.Constant)), None)
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and SQL.match(first.value):
                found.setdefault(relative, []).append(node.lineno)
    return found


def test_no_sql_outside_the_store_except_the_listed_modules():
    found = sql_outside_store()
    unexpected = {path: lines for path, lines in found.items() if path not in PENDING}
    assert unexpected == {}, f"SQL outside forecaster/store/ (move it into a store function): {unexpected}"


def test_the_pending_list_only_names_modules_that_still_need_it():
    assert set(PENDING) <= set(sql_outside_store())
