"""``prewarm report`` end to end: a real PostgreSQL holding two days of five models from the shipped sample, the
command itself (the product's default ensemble and planner), and the page in a real headless Chromium.

The browser part needs Debian's ``chromium`` and the ``playwright`` package (never its browser download); it is
skipped when either is missing, except under CI, where that fails (as in ``tests/test_dashboard_browser.py``).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from forecaster.cli import app
from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.demo import register_fleet
from forecaster.ingest.service import ingest_frame
from forecaster.report import html as report_html
from forecaster.report.history import ReportError, parse_moment
from forecaster.report.numbers import _bins, bin_minutes
from forecaster.report.sample import SAMPLE_START, sample_history, sample_windows
from forecaster.settings import Settings
from forecaster.store.db import make_engine
from tests.conftest import _admin_execute, fresh_database_url
from tests.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, _browser_or_skip

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
MODELS, DAYS = 5, 2


def _env(url: str, tmp: Path) -> dict[str, str]:
    return {"DATABASE_URL": url, "PREWARM_DATA_DIR": str(tmp / "data"), "PREWARM_MODELS_DIR": str(tmp / "models")}


def _seed(url: str, tmp: Path, *, models: int = MODELS, days: int = DAYS) -> pd.DataFrame:
    engine = make_engine(url)
    try:
        settings = Settings(database_url=url, data_dir=tmp / "data", models_dir=tmp / "models")
        history = sample_history(models, days)
        ingest_frame(engine, settings, history, source="report-test", step_seconds=60, now=NOW,
                     windows=sample_windows(history, days), register=True)
        register_fleet(engine, history, config=FleetConfig(n_nodes=4))
        return history
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def seeded(pg_admin_url, pg_template, tmp_path_factory):
    """A database with the two days, and one run of the report on the second day (the first is history)."""
    tmp = tmp_path_factory.mktemp("report")
    url = fresh_database_url(pg_admin_url, pg_template)
    history = _seed(url, tmp)
    out, as_json = tmp / "report.html", tmp / "report.json"
    result = CliRunner().invoke(app, ["report", "--since", "1d", "--out", str(out), "--json", str(as_json)],
                                env=_env(url, tmp))
    yield {"url": url, "tmp": tmp, "history": history, "result": result, "out": out, "json": as_json}
    _admin_execute(pg_admin_url, f"DROP DATABASE IF EXISTS {make_url(url).database} WITH (FORCE)")


@pytest.mark.slow
def test_the_report_replays_the_stored_day_under_every_policy(seeded):
    result = seeded["result"]
    assert result.exit_code == 0, result.output
    numbers = json.loads(seeded["json"].read_text())
    info = numbers["report"]
    assert info["since"] == (SAMPLE_START + pd.Timedelta(days=1)).isoformat()
    assert info["until"] == (SAMPLE_START + pd.Timedelta(days=2)).isoformat()
    assert info["models"] == MODELS and info["scored_minutes"] == 1440 and info["history_minutes"] == 1440
    assert list(numbers["policies"]) == ["prewarm", "reactive", "keepalive_10"]
    # the scored requests are the stored second day's, under every policy
    history = seeded["history"]
    day2 = history[history["ds"] >= SAMPLE_START + pd.Timedelta(days=1)]
    for row in numbers["policies"].values():
        assert row["requests"] == int(day2["y"].sum())
    # the forecaster is the product's ensemble, fitted once at the window's start on the day before it
    assert info["forecaster"]["retrains"] == 1
    assert info["forecaster"]["first_fit_at"] == info["since"]
    assert info["forecaster"]["minutes_from_ensemble"] == 1440 - 4  # the first 4 target minutes predate any origin
    assert 0 <= info["forecaster"]["error"]["coverage_80_pct"] <= 100
    # per-model figures add up to the policy totals, and the plotted series to them too
    for policy, row in numbers["policies"].items():
        models = numbers["models"]
        assert sum(m["cold_requests"][policy] for m in models) == row["cold_requests"]
        assert sum(m["gpu_seconds"][policy] for m in models) == pytest.approx(row["gpu_seconds"], rel=1e-9)
        assert sum(m["bytes_registry"][policy] for m in models) == pytest.approx(row["bytes_registry"])
        assert sum(v for v in numbers["series"]["fleet"]["cold_requests"][policy] if v) == row["cold_requests"]
        assert sum(v for v in numbers["series"]["fleet"]["gpu_seconds"][policy] if v) == pytest.approx(
            row["gpu_seconds"], rel=1e-9)
    comparison = numbers["comparison"]["reactive"]
    assert comparison["cold_requests_avoided"] == (numbers["policies"]["reactive"]["cold_requests"]
                                                   - numbers["policies"]["prewarm"]["cold_requests"])
    assert "avoided vs reactive" in result.output


@pytest.mark.slow
def test_the_page_renders_offline_and_shows_the_json_numbers(seeded):
    assert seeded["result"].exit_code == 0, seeded["result"].output
    sync_playwright = _browser_or_skip()
    numbers = json.loads(seeded["json"].read_text())
    errors, outside = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith("file://") else None)
        page.goto(seeded["out"].resolve().as_uri())
        page.wait_for_selector("body[data-rendered=true]", timeout=15000)
        assert page.locator(".uplot").count() == 5  # cold, GPU, fleet forecast, model forecast, model cold
        assert page.locator(".uplot canvas").count() == 5
        embedded = json.loads(page.locator("#report-data").text_content())
        cells = page.eval_on_selector_all("[data-path]", "els => els.map(e => [e.dataset.path, e.dataset.value, "
                                          "e.dataset.format, e.textContent])")
        # choosing another model redraws its chart from the embedded series
        other = numbers["models"][-1]["model_id"]
        page.select_option("#model-select", other)
        assert page.locator("#model-select").input_value() == other
        shot = os.environ.get("PREWARM_REPORT_SCREENSHOT")
        page.screenshot(path=shot or str(seeded["tmp"] / "report.png"), full_page=True)
        browser.close()
    assert errors == []
    assert outside == []
    assert embedded == numbers
    assert len(cells) > 50
    for path_text, raw, fmt_name, shown in cells:
        value = numbers
        for key in json.loads(path_text):
            value = value[key]
        if value is None:
            assert raw == "" and shown == "-"
            continue
        assert float(raw) == pytest.approx(value, rel=1e-12, abs=1e-12)
        if fmt_name.startswith("fmt_float"):
            decimals = len(shown.split(".")[1]) if "." in shown else 0
            assert float(shown.replace(",", "")) == pytest.approx(value, abs=0.5 * 10 ** -decimals + 1e-9)
        else:
            assert shown == getattr(report_html, fmt_name)(value)


def test_an_unknown_model_a_bad_since_and_an_empty_window_are_clear_errors(db_url, tmp_path):
    _seed(db_url, tmp_path, models=2, days=1)
    env = _env(db_url, tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["report", "--models", "no-such-model", "--out", str(tmp_path / "r.html")], env=env)
    assert result.exit_code == 2
    assert "'no-such-model' not in the catalogue" in result.output
    result = runner.invoke(app, ["report", "--since", "last tuesday", "--out", str(tmp_path / "r.html")], env=env)
    assert result.exit_code == 2
    assert "--since 'last tuesday': expected a duration such as 7d" in result.output
    result = runner.invoke(app, ["report", "--since", "2018-01-01", "--until", "2018-01-08",
                                 "--out", str(tmp_path / "r.html")], env=env)
    assert result.exit_code == 2
    assert "no data between 2018-01-01 00:00 and 2018-01-08 00:00 UTC (the store holds 2019-07-15 00:00" in \
        result.output
    result = runner.invoke(app, ["report", "--since", "2019-07-15T12:00", "--until", "2019-07-15T06:00",
                                 "--out", str(tmp_path / "r.html")], env=env)
    assert result.exit_code == 2 and "is not before --until" in result.output
    assert not (tmp_path / "r.html").exists()


def test_an_empty_catalogue_says_how_to_fill_it(db_url, tmp_path):
    result = CliRunner().invoke(app, ["report", "--out", str(tmp_path / "r.html")], env=_env(db_url, tmp_path))
    assert result.exit_code == 2
    assert "the catalogue is empty" in result.output


def test_moments_and_bins():
    until = pd.Timestamp("2019-07-22T00:00", tz="UTC")
    assert parse_moment("7d", option="--since", reference=until) == pd.Timestamp("2019-07-15", tz="UTC")
    assert parse_moment("36h", option="--since", reference=until) == pd.Timestamp("2019-07-20T12:00", tz="UTC")
    assert parse_moment("2019-07-16T03:04:59", option="--since") == pd.Timestamp("2019-07-16T03:04", tz="UTC")
    assert parse_moment("2019-07-16T03:00+02:00", option="--since") == pd.Timestamp("2019-07-16T01:00", tz="UTC")
    for bad in ("0d", "7x", "", "12345", "yesterday"):
        with pytest.raises(ReportError):
            parse_moment(bad, option="--since", reference=until)
    assert bin_minutes(1440) == 1 and bin_minutes(2880) == 5 and bin_minutes(7 * 1440) == 10
    binned = _bins(np.array([[1.0, 2.0, np.nan, np.nan, 5.0]]), 2)
    assert binned[0, 0] == 3.0 and np.isnan(binned[0, 1]) and binned[0, 2] == 5.0
