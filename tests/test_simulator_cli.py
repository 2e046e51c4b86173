"""``prewarm simulate`` on the shipped LLM sample: every policy runs, the table and JSON come out."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from forecaster.cli import app
from forecaster.data import AZURE2019_TOP100, AZURE_LLM2023_CODE_HEAD, sample_path


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("PREWARM_") or name == "DATABASE_URL":
            monkeypatch.delenv(name)
    monkeypatch.setenv("PREWARM_DATA_DIR", str(tmp_path / "data"))


def test_simulate_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, ["simulate", str(sample_path(AZURE_LLM2023_CODE_HEAD)), "--policy",
                                      "reactive,prewarm,oracle", "--nodes", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("keepalive_10", "reactive", "prewarm", "oracle"):
        assert name in result.stdout
    figures = json.loads(out.read_text())
    assert set(figures["policies"]) == {"keepalive_10", "reactive", "prewarm", "oracle"}
    assert figures["policies"]["keepalive_10"]["wasted_norm_pct"] == pytest.approx(100.0)
    for row in figures["policies"].values():
        assert row["requests"] > 0 and 0.0 <= row["slo_attainment"] <= 1.0 and row["gpu_seconds"] > 0


def test_simulate_rejects_an_unknown_policy(tmp_path):
    result = CliRunner().invoke(app, ["simulate", str(sample_path(AZURE_LLM2023_CODE_HEAD)), "--policy", "magic"])
    assert result.exit_code == 2
    assert "unknown policy 'magic'" in result.output


def test_simulate_in_budget_mode_reports_the_spend_and_the_controller(tmp_path):
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, ["simulate", str(sample_path(AZURE_LLM2023_CODE_HEAD)), "--policy",
                                      "prewarm_empirical", "--nodes", "4", "--waste-budget", "50%", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "budget mode" in result.stdout and "budget_factor" in result.stdout
    row = json.loads(out.read_text())["policies"]["prewarm_empirical"]
    state = row["budget_state"]
    assert state["updates"] > 0 and 1e-3 <= state["factor"] <= 1e3 and state["allowed_total"] >= 0


@pytest.mark.parametrize("value", ["-5%", "nan", "lots"])
def test_simulate_rejects_a_bad_waste_budget(value):
    result = CliRunner().invoke(app, ["simulate", str(sample_path(AZURE_LLM2023_CODE_HEAD)), "--policy",
                                      "prewarm_empirical", "--waste-budget", value])
    assert result.exit_code == 2 and "--waste-budget" in result.output


def test_simulate_with_even_arrivals_plans_without_the_burst_factor(tmp_path):
    """The sample's minutes come in bursts (the trace reader measures a factor of 3.7). Sized for them, the planner
    holds more replicas than it does when it plans as a deployment with no sub-minute data."""
    gpu_seconds = {}
    for flag in ([], ["--even-arrivals"]):
        out = tmp_path / f"sim{len(flag)}.json"
        result = CliRunner().invoke(app, ["simulate", str(sample_path(AZURE_LLM2023_CODE_HEAD)), "--policy",
                                          "prewarm_empirical", "--nodes", "4", "--json", str(out), *flag])
        assert result.exit_code == 0, result.output
        gpu_seconds[bool(flag)] = json.loads(out.read_text())["policies"]["prewarm_empirical"]["gpu_seconds"]
    assert gpu_seconds[True] < gpu_seconds[False]


def test_the_model_mapping_says_what_ordered_it(tmp_path, monkeypatch):
    """Many series: by the Azure memory file when it covers them all, else by request volume (the busiest get the
    biggest models); the frame says which, and ``prewarm simulate`` prints it."""
    import numpy as np
    import pandas as pd

    from forecaster.simulation.runner import AZURE_MEMORY, models_for
    from forecaster.simulation.workload import load_workload

    workload = load_workload(sample_path(AZURE2019_TOP100)).window(0, 30 * 60.0)
    by_volume = models_for(workload, traces_dir=tmp_path)
    assert by_volume.attrs["mapped_by"].startswith("request volume")
    memory = tmp_path / AZURE_MEMORY
    memory.parent.mkdir(parents=True)
    ids = workload.ids.astype(str)
    mb = np.arange(len(ids), 0, -1) * 100.0  # the first series uses the most memory
    pd.DataFrame({"HashApp": ids, "AverageAllocatedMb": mb}).to_csv(memory, index=False)
    by_memory = models_for(workload, traces_dir=tmp_path)
    assert by_memory.attrs["mapped_by"].startswith("memory")
    assert by_memory.loc[ids[0], "gpus"] >= by_memory.loc[ids[-1], "gpus"]  # the most memory, the biggest model
    pd.DataFrame({"HashApp": ids[:-1], "AverageAllocatedMb": mb[:-1]}).to_csv(memory, index=False)
    assert models_for(workload, traces_dir=tmp_path).attrs["mapped_by"].startswith("request volume")  # not covered
    monkeypatch.setenv("PREWARM_TRACES_DIR", str(tmp_path / "elsewhere"))
    result = CliRunner().invoke(app, ["simulate", str(sample_path(AZURE2019_TOP100)), "--policy", "keepalive_10",
                                      "--minutes", "20", "--nodes", "8"])
    assert result.exit_code == 0, result.output
    assert "models mapped by request volume" in " ".join(result.output.split())


@pytest.fixture
def tiny_trace(tmp_path):
    """Two models, an hour of minutes, in the long format."""
    import pandas as pd

    minutes = pd.date_range("2024-01-01", periods=60, freq="min")
    frame = pd.concat([pd.DataFrame({"unique_id": m, "ds": minutes, "y": [(i * k) % 5 for i in range(60)]})
                       for k, m in ((1, "a"), (3, "b"))])
    path = tmp_path / "tiny.csv"
    frame.to_csv(path, index=False)
    return path


@pytest.mark.parametrize(("args", "expected"), [
    (["--nodes", "0"], "error: --nodes: expected 1 to 100,000 nodes, got 0"),  # ran on 16 nodes
    (["--nodes", "-3"], "error: --nodes: expected 1 to 100,000 nodes, got -3"),
    (["--minutes", "-5"], "error: --minutes: expected at least 1 minute, got -5"),  # an empty replay, exit 0
    (["--minutes", "0"], "error: --minutes: expected at least 1 minute, got 0"),  # the whole trace
    (["--warmup-minutes", "-1"], "error: --warmup-minutes: expected 0 or more minutes, got -1"),
    (["--cold-cost", "-1"], "error: --cold-cost: expected a number from 0 to 1e+09"),  # "cannot reshape array"
    (["--cold-cost", "nan"], "error: --cold-cost: expected a number from 0 to 1e+09"),  # ran at the default
    (["--cold-cost", "inf"], "error: --cold-cost: expected a number from 0 to 1e+09"),
    (["--cold-cost", "1e12"], "error: --cold-cost: expected a number from 0 to 1e+09"),
])
def test_simulate_refuses_numbers_it_cannot_run_on(tiny_trace, args, expected):
    result = CliRunner().invoke(app, ["simulate", str(tiny_trace), "--format", "long", "--forecaster", "empirical",
                                      "--policy", "reactive,prewarm_empirical", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(expected) and result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == ""


def test_simulate_checks_its_json_folder_before_the_run(tiny_trace, tmp_path):
    out = tmp_path / "no" / "such" / "sim.json"
    result = CliRunner().invoke(app, ["simulate", str(tiny_trace), "--format", "long", "--policy", "reactive",
                                      "--json", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: --json {out}: the folder {out.parent} does not exist\n"
    assert result.stdout == ""
