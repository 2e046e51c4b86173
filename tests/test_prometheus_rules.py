"""The alerting rules on prewarm's own metrics: promtool checks and unit-tests them, and every metric they read is
one the API exports."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import yaml
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.main import create_app
from forecaster.planning.budget import BudgetState, WasteBudget, update_budget
from tests.runtime_fixtures import require_binary

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RULES = DEPLOY / "prometheus-rules.yml"
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_checks_the_config_and_the_rules_pass_their_unit_tests():
    promtool = require_binary("promtool")
    for command in (["check", "config", "prometheus.yml"], ["test", "rules", "prometheus-rules.test.yml"]):
        out = subprocess.run([promtool, *command], cwd=DEPLOY, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
    # each alert has a unit test that makes it fire
    tested = yaml.safe_load((DEPLOY / "prometheus-rules.test.yml").read_text())["tests"]
    fired = {case["alertname"] for test in tested for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == {rule["alert"] for rule in _rules()}


def test_the_clusters_configmap_holds_the_same_rules():
    configmap = yaml.safe_load((DEPLOY / "base" / "prometheus-rules.yaml").read_text())
    assert yaml.safe_load(configmap["data"]["prewarm-rules.yml"]) == yaml.safe_load(RULES.read_text())


def test_every_metric_the_rules_read_is_exported(engine, settings):
    """A store with a plan in budget mode and a job run: the API's /metrics names every metric of every rule."""
    state = update_budget(BudgetState(), WasteBudget(pct=100.0), spent_gpu_s=30.0, reference_idle_gpu_s=10.0)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO plans (planned_at, summary) VALUES (:t, CAST(:s AS jsonb))"),
                     {"t": NOW, "s": json.dumps({"budget": state.as_dict()})})
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        exported = set(re.findall(r"^# TYPE (\S+)", client.get("/metrics").text, flags=re.MULTILINE))
    read = {name for rule in _rules() for name in re.findall(r"\b(prewarm_[a-z_]+)", rule["expr"])}
    assert read and read <= exported, read - exported
