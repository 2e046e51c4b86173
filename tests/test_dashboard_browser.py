"""The dashboard in a real headless Chromium, served by uvicorn from a real PostgreSQL.

Needs Debian's ``chromium`` (``apt-get install -y --no-install-recommends chromium``)
and the Python ``playwright`` package (never its browser download). Skipped when
either is missing, except under CI (env ``CI`` set), where that is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import numpy as np
import pytest
from sqlalchemy import text

from api.main import create_app
from forecaster.planning.budget import BudgetState, WasteBudget, update_budget
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecasts import ensure_forecast_partitions
from forecaster.store.partitions import ensure_partitions
from forecaster.store.replays import start_replay, write_replay_outcomes
from forecaster.store.tokens import create_token
from tests.uvicorn_fixtures import serving

#: Budget mode as the served app is configured, and the plans that stored its state.
BUDGET = WasteBudget(pct=100.0)
BUDGET_PLANS = 30
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
NOW = datetime(2026, 11, 29, 12, 0, 30, tzinfo=timezone.utc)
END = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)  # counts known up to here
WEEK_START = END - timedelta(days=7)
MODELS = ("llama-7b", "mistral-7b", "phi-3")
HORIZONS = (1, 5, 15, 60)  # horizons the test looks at; each run stores 60 target minutes: horizons 1 .. 60
#: The page's one time format.
TIME_FORMAT = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC"
#: A stored replay: per policy and model, what a simulator measured.
REPLAY = {policy: {m: {"requests": 1000 * (i + 1), "cold_requests": cold[i], "replica_starts": starts[i],
                       "wait_total_s": wait[i], "wait_max_s": 30.0}
                   for i, m in enumerate(MODELS)}
          for policy, cold, starts, wait in (("prewarm", (12, 40, 9), (5, 7, 3), (300.0, 900.0, 150.0)),
                                             ("reactive", (150, 35, 60), (20, 6, 11), (4200.0, 800.0, 1800.0)))}


def _browser_or_skip():
    reason = None
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} missing: apt-get install -y --no-install-recommends chromium"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = reason or "Python package playwright missing: pip install playwright"
        sync_playwright = None
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"browser test cannot run under CI: {reason}")
        pytest.skip(reason)
    return sync_playwright


def seed(engine) -> dict[str, list[int]]:
    """A week of per-minute counts, forecasts at a few horizons, cold starts and actions for three models."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in MODELS])
    ensure_partitions(engine, WEEK_START, END + timedelta(days=1))
    first_day = (WEEK_START - timedelta(hours=1)).date()
    ensure_forecast_partitions(engine, [first_day + timedelta(days=i)
                                        for i in range((END.date() - first_day).days + 1)])
    params = {"a": WEEK_START, "b": END, "max_h": max(HORIZONS)}
    with engine.begin() as conn:
        # Daily cycle with a model-specific level; the forecast is the cycle without the noise.
        conn.execute(text(
            "INSERT INTO invocations (model_id, minute, count) "
            "SELECT m.id, t, round(greatest(0, s.level * (1 + 0.8 * sin(2 * pi() * extract(epoch FROM t) / 86400)) "
            "+ 6 * sin(extract(epoch FROM t) / 7.0))) "
            "FROM serving_models m JOIN (VALUES ('llama-7b', 60), ('mistral-7b', 25), ('phi-3', 8)) s(id, level) "
            "ON s.id = m.id, generate_series(CAST(:a AS timestamptz), CAST(:b AS timestamptz) - interval '1 minute', "
            "interval '1 minute') t"), params)
        conn.execute(text("DELETE FROM invocations WHERE count = 0"))
        conn.execute(text(
            "INSERT INTO coverage (model_id, source, step_seconds, ranges) SELECT id, 'browser-test', 60, "
            "tstzmultirange(tstzrange(:a, :b, '[)')) FROM serving_models"), params)
        # One run per model and minute: horizons 1 .. max(HORIZONS) as arrays (element k is k minutes ahead).
        conn.execute(text(
            "INSERT INTO forecasts (model_id, issued_at, first_target, point, p_any, quantile_levels, quantiles) "
            "SELECT m.id, r.t + interval '5 seconds', r.t, array_agg(f.point ORDER BY k), "
            "array_agg(CAST(1.0 AS real) ORDER BY k), CAST('{0.1,0.5,0.9}' AS real[]), "
            "ARRAY[array_agg(0.8 * f.point ORDER BY k), array_agg(f.point ORDER BY k), "
            "array_agg(1.25 * f.point ORDER BY k)] "
            "FROM serving_models m JOIN (VALUES ('llama-7b', 60), ('mistral-7b', 25), ('phi-3', 8)) s(id, level) "
            "ON s.id = m.id, generate_series(CAST(:a AS timestamptz) - interval '1 hour', CAST(:b AS timestamptz), "
            "interval '1 minute') r(t), generate_series(0, :max_h - 1) k, "
            "LATERAL (SELECT CAST(s.level * (1 + 0.8 * sin(2 * pi() * extract(epoch FROM r.t + k * interval "
            "'1 minute') / 86400)) + 0.05 * k AS real) AS point) f GROUP BY m.id, r.t"), params)
        conn.execute(text(
            "INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, source) "
            "SELECT m.id, 'gpu-node-' || k, CAST(:b AS timestamptz) - k * interval '97 minutes', 38 + 3 * k, 'test' "
            "FROM serving_models m, generate_series(1, 12) k"), params)
        action_ids = {}
        for model_id in MODELS:
            action_ids[model_id] = conn.execute(text(
                "INSERT INTO actions (kind, model_id, node_id, target, not_before, deadline, reason, "
                "expected_benefit, status, status_reason) "
                "SELECT (ARRAY['prepull', 'preload', 'scale', 'release'])[1 + k % 4], :m, 'gpu-node-' || k, "
                "'registry.local/vllm:0.6', CAST(:b AS timestamptz) - k * interval '55 minutes', "
                "CAST(:b AS timestamptz) - k * interval '55 minutes' + interval '8 minutes', 'forecast_spike', 40, "
                "(ARRAY['succeeded', 'succeeded', 'failed', 'pending'])[1 + k % 4], "
                "CASE WHEN k % 4 = 2 THEN 'timeout' END "
                "FROM generate_series(1, 8) k RETURNING id"), {**params, "m": model_id}).scalars().all()
        replay = start_replay(conn, source="demo", window_start=END - timedelta(hours=6), window_end=END,
                              policies=("prewarm", "reactive"), summary={"cluster": {"nodes": 4, "gpus_per_node": 8}})
        write_replay_outcomes(conn, replay_id=replay, scored_until=END,
                              summary={"cluster": {"nodes": 4, "gpus_per_node": 8},
                                       "totals": {"prewarm": {"gpu_seconds": 5000.0},
                                                  "reactive": {"gpu_seconds": 4000.0}}},
                              outcomes={policy: [{"model_id": m, **figures} for m, figures in rows.items()]
                                        for policy, rows in REPLAY.items()})
        # Budget mode's controller after each of the last BUDGET_PLANS plans (the plan job stores it so).
        state = BudgetState()
        for k in range(BUDGET_PLANS):
            state = update_budget(state, BUDGET, spent_gpu_s=60.0 + 30.0 * (k % 3), reference_idle_gpu_s=80.0
                                  ).with_curve(np.linspace(0.0, 200.0, 25))
            conn.execute(text("INSERT INTO plans (planned_at, summary) VALUES (:t, CAST(:s AS jsonb))"),
                         {"t": END - timedelta(minutes=BUDGET_PLANS - k), "s": json.dumps({"budget": state.as_dict()})})
        conn.execute(text("ANALYZE"))
    return action_ids


@pytest.fixture
def served(engine, settings):
    """The app on a free loopback port under uvicorn, in a thread, with seeded data and a read token."""
    action_ids = seed(engine)
    token = create_token(engine, name="dashboard", scopes=["read"])
    clock = {"now": NOW}
    app = create_app(settings.model_copy(update={"planner_waste_budget_pct": BUDGET.pct}), engine,
                     clock=lambda: clock["now"])
    with serving(app) as base:
        yield {"base": base, "token": token, "action_ids": action_ids, "engine": engine, "clock": clock}


SERIES_POINTS_JS = """() => {
    const u = window.prewarm.charts.forecast;
    return u.series.map((s, i) => [i === 0 ? "x" : s.label, u.data[i].filter(v => v != null).length]);
}"""


def test_dashboard_shows_forecast_actual_and_actions(served, tmp_path):
    sync_playwright = _browser_or_skip()
    base, token = served["base"], served["token"]
    errors: list[str] = []
    foreign: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("requestfailed", lambda req: errors.append(f"failed {req.url}"))
            page.on("request", lambda req: foreign.append(req.url) if not req.url.startswith(base) else None)
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)

            # The token arrives in the fragment, is kept in localStorage and leaves the address bar.
            page.goto(f"{base}/dashboard/#token={token}")
            page.wait_for_selector("body[data-fleet-loaded]", timeout=15_000)
            assert page.evaluate("localStorage.getItem('prewarm.readToken')") == token
            assert "token" not in page.url
            rows = page.locator("#fleet-table tbody tr")
            assert rows.count() == len(MODELS)
            ranked = rows.evaluate_all("rs => rs.map(r => r.dataset.model)")
            assert sorted(ranked) == sorted(MODELS)
            # The horizons offered are exactly those stored (1 .. 60), the 60-minute one scores minutes.
            offered = page.eval_on_selector_all("#fleet-horizon option", "os => os.map(o => Number(o.value))")
            assert offered == [1, 5, 10, 15, 30, 60]
            page.select_option("#fleet-horizon", "60")
            page.wait_for_function("window.prewarm.fleet && window.prewarm.fleet.horizon_min === 60")
            assert all(r["error"]["scored_minutes"] == 60 for r in page.evaluate("window.prewarm.fleet.data"))
            page.select_option("#fleet-horizon", "5")
            page.wait_for_function("window.prewarm.fleet && window.prewarm.fleet.horizon_min === 5")
            assert_fits_its_card(page)
            assert_one_time_format(page)
            # The stored replay: totals above the table, prewarm vs reactive per model in it.
            summary = page.inner_text("#replay-summary")
            assert "cold-start requests 61 with prewarm vs 245 with a reactive autoscaler" in summary
            assert "+184 avoided" in summary and "+5,450 s saved" in summary
            assert "GPU-seconds held 5,000 vs 4,000" in summary  # what the avoided cold starts cost
            llama = page.locator("#fleet-table tbody tr[data-model='llama-7b']")
            assert llama.locator("td.replay-cold").inner_text() == "12 / 150"
            # p(any) stored as 1 everywhere: its Brier score is the share of scored minutes without an invocation
            # (the API tests hold exact figures with minutes on both sides)
            phi = next(r for r in page.evaluate("window.prewarm.fleet.data") if r["model_id"] == "phi-3")["error"]
            assert phi["p_any_mean"] == 1.0 and phi["p_any_minutes"] == phi["scored_minutes"] > 0
            assert phi["brier_any"] == pytest.approx(1 - phi["invoked_share"])
            phi_cell = page.locator("#fleet-table tbody tr[data-model='phi-3'] td.p-any")
            assert phi_cell.inner_text() == f"{phi['brier_any']:.3f}"
            assert "mean p(any) 100.0% against" in phi_cell.get_attribute("title")
            assert llama.locator("td.replay-avoided").inner_text() == "+138"
            assert llama.locator("td.replay-wait").inner_text() == "+3,900"
            mistral = page.locator("#fleet-table tbody tr[data-model='mistral-7b']")
            assert mistral.locator("td.replay-avoided").inner_text() == "\u22125"  # prewarm had 5 more
            assert "loss" in mistral.locator("td.replay-avoided").get_attribute("class")
            # Budget mode: the controller's status and a point per stored update, spent against allowed.
            page.wait_for_selector(f"body[data-budget-loaded='{BUDGET_PLANS}']")
            assert page.locator("#budget-panel").is_visible()
            budget = page.inner_text("#budget-summary")
            assert "Status settling" in budget and "% of its allowance spent" in budget
            assert "100 % of a 10-minute keep-alive's idle GPU-seconds" in page.inner_text("#budget-config")
            spent, allowed = page.evaluate("[1, 2].map(i => window.prewarm.charts.budget.data[i])")
            assert spent[:3] == [60.0, 90.0, 120.0] and set(allowed) == {80.0}
            page.fill("#fleet-search", "mistral")
            page.wait_for_function("document.querySelectorAll('#fleet-table tbody tr').length === 1")
            page.fill("#fleet-search", "")
            page.wait_for_function(f"document.querySelectorAll('#fleet-table tbody tr').length === {len(MODELS)}")

            # Pick a model: forecast chart with actual, forecast and its band.
            page.click("#fleet-table tbody tr[data-model='llama-7b'] td.model a")
            page.wait_for_selector("body[data-model-loaded='llama-7b']", timeout=15_000)
            points = dict(page.evaluate(SERIES_POINTS_JS))
            assert points["x"] == 1440  # a day of minutes, ending 5 minutes (the horizon) past now's minute
            assert points["actual"] == 1440 - 5 and points["forecast (h=5 min)"] == 1440
            assert points["q0.9"] == points["q0.1"] == points["forecast (h=5 min)"]
            # the seeded runs store p_any 1 everywhere: the error line says how it scored
            assert "mean p(any) 100.0% against" in page.inner_text("#model-error")

            # Another horizon: the chart is redrawn from the forecasts made 15 minutes ahead.
            page.select_option("#model-horizon", "15")
            page.wait_for_function("location.hash.includes('h=15')")
            page.wait_for_selector("body[data-model-loaded='llama-7b']", timeout=15_000)
            points = dict(page.evaluate(SERIES_POINTS_JS))
            assert points["forecast (h=15 min)"] == 1440 and points["actual"] == 1440 - 15

            # Cold starts: observed points, no stored prediction, and the page says so.
            observed = page.evaluate("window.prewarm.charts.coldstarts.data[1].filter(v => v != null).length")
            assert observed == 12  # one every 97 minutes over the last 19.4 hours
            assert "no cold-start predictions are stored" in page.inner_text("#coldstart-note")

            # The model's replay: prewarm against the reactive autoscaler on the same requests.
            assert page.locator("#model-replay").is_visible()
            cells = page.locator("#model-replay-table tbody tr").evaluate_all(
                "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
            assert cells[1] == ["cold-start requests (no ready replica)", "12", "150", "+138"]
            assert cells[3] == ["request wait, total (s)", "300", "4,200", "+3,900"]

            # The actions timeline draws every stored action of this model in the range.
            drawn = page.eval_on_selector_all("#timeline rect[data-action-id]",
                                              "rs => rs.map(r => Number(r.dataset.actionId))")
            assert sorted(drawn) == sorted(served["action_ids"]["llama-7b"])
            assert page.locator("#actions-table tbody tr").count() == 8
            assert page.locator("#timeline rect.status-failed").count() == 2
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            shutil.copy(tmp_path / "dashboard.png", "/tmp/dashboard.png")

            # A week of minutes per chart: 10,080 points each, drawn by uPlot.
            started = time.perf_counter()
            page.select_option("#model-range", "10080")
            page.wait_for_function("location.hash.includes('range=10080')")
            page.wait_for_selector("body[data-model-loaded='llama-7b']", timeout=20_000)
            week_s = time.perf_counter() - started
            points = dict(page.evaluate(SERIES_POINTS_JS))
            assert points["x"] == 10_080 and points["actual"] == 10_080 - 15
            assert points["forecast (h=15 min)"] == 10_080
            print(f"week view (10,080 minutes x 5 series) fetched and drawn in {week_s:.2f} s")
            assert_one_time_format(page)
            axis = page.evaluate("(() => { const u = window.prewarm.charts.forecast; "
                                 "return u.axes[0].values(u, [u.data[0][0]]); })()")
            assert len(axis) == 1 and __import__("re").fullmatch(TIME_FORMAT, axis[0]), axis

            # A fleet of 1,350 models: one page of rows drawn, search over all of them.
            with served["engine"].begin() as conn:
                conn.execute(text("INSERT INTO serving_models (id) SELECT 'fleet-' || lpad(g::text, 4, '0') "
                                  "FROM generate_series(1, 1347) g"))
            started = time.perf_counter()
            page.click("#back")
            page.click("#fleet-refresh")
            page.wait_for_selector("body[data-fleet-loaded='1350']", timeout=20_000)
            fleet_s = time.perf_counter() - started
            assert page.locator("#fleet-table tbody tr").count() == 50
            assert page.inner_text("#fleet-page") == "page 1 of 27"
            started = time.perf_counter()
            page.fill("#fleet-search", "fleet-013")
            page.wait_for_function("document.querySelectorAll('#fleet-table tbody tr').length === 10")
            search_s = time.perf_counter() - started
            page.screenshot(path=str(tmp_path / "fleet.png"))
            shutil.copy(tmp_path / "fleet.png", "/tmp/dashboard_fleet.png")
            print(f"fleet of 1,350 models fetched and drawn in {fleet_s:.2f} s; search answered in {search_s:.2f} s")
        finally:
            browser.close()
    assert errors == []
    assert foreign == []  # nothing fetched from anywhere but the app itself


def assert_fits_its_card(page) -> None:
    """The fleet table lies inside its card (bounding boxes), and the card inside the viewport."""
    table = page.locator("#fleet-table").bounding_box()
    card = page.locator("#fleet-view").bounding_box()
    width = page.viewport_size["width"]
    assert table["x"] >= card["x"] and table["x"] + table["width"] <= card["x"] + card["width"] + 0.5, (table, card)
    assert card["x"] + card["width"] <= width, (card, width)
    assert page.evaluate("(() => { const c = document.getElementById('fleet-view'); "
                         "return c.scrollWidth <= c.clientWidth; })()")  # nothing hidden behind a scroll bar


def assert_one_time_format(page) -> None:
    """Every clock time written on the page is part of one "YYYY-MM-DD HH:MM UTC"."""
    import re

    text = page.evaluate("document.body.innerText") + "\n" + "\n".join(
        page.eval_on_selector_all("#timeline text.axis, #timeline title", "ts => ts.map(t => t.textContent)"))
    times = re.findall(r"\S*\d{1,2}:\d{2}\S*(?: UTC)?", text)
    assert times, text
    full = re.compile(TIME_FORMAT)
    stray = [t for t in re.finditer(r"\d{1,2}:\d{2}", text)
             if not any(m.start() <= t.start() and t.end() <= m.end() for m in full.finditer(text))]
    assert stray == [], [text[max(0, t.start() - 20):t.end() + 10] for t in stray]


def test_windows_follow_the_data_and_the_date_picker_moves_them(served):
    """Served a month after the data ends (the demo's 2019 trace served today), the page shows the data;
    the date picker moves every window to the end chosen."""
    sync_playwright = _browser_or_skip()
    served["clock"]["now"] = NOW + timedelta(days=30)
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.goto(f"{served['base']}/dashboard/#token={served['token']}")
            page.wait_for_selector("body[data-fleet-loaded]", timeout=15_000)
            fleet = page.evaluate("window.prewarm.fleet")
            assert (fleet["end"], fleet["end_source"]) == ("2026-11-29T12:00:00Z", "newest_data")
            assert all(r["error"]["scored_minutes"] == 60 for r in fleet["data"])  # not an empty dashboard
            assert "latest data: 2026-11-29 12:00 UTC" in page.inner_text("header")
            assert "ending at the newest data" in page.inner_text("#fleet-summary")
            page.wait_for_selector(f"body[data-budget-loaded='{BUDGET_PLANS}']")

            # Pick a window end a day earlier, with the browser's picker: the fleet is scored over the hour before
            # it, and the field shows the end in the page's format.
            page.fill("#window-end-picker", "2026-11-28T12:00")
            page.dispatch_event("#window-end-picker", "change")
            assert page.input_value("#window-end") == "2026-11-28 12:00"
            page.wait_for_function("window.prewarm.fleet.end === '2026-11-28T12:00:00Z'")
            assert "2026-11-28 11:00 UTC to 2026-11-28 12:00 UTC" in page.inner_text("#fleet-summary")
            assert page.evaluate("window.prewarm.fleet.end_source") == "request"
            # the waste budget ends there too: every stored controller state is later
            page.wait_for_selector("body[data-budget-loaded='0']")
            assert "No controller update is stored yet." in page.inner_text("#budget-summary")

            # The model page keeps the picked end: its day ends there.
            page.click("#fleet-table tbody tr[data-model='phi-3'] td.model a")
            page.wait_for_selector("body[data-model-loaded='phi-3']", timeout=15_000)
            assert "end=2026-11-28T12%3A00" in page.url
            last = page.evaluate("(() => { const t = window.prewarm.charts.forecast.data[0]; return t[t.length - 1]; })()")
            assert last == int((NOW.replace(second=0) - timedelta(days=1, minutes=1)).timestamp())
            assert_one_time_format(page)

            # A date typed by hand in the same format works too; an absurd one is refused with the API's reason.
            page.click("#back")
            page.wait_for_selector("#fleet-view:not([hidden])")
            page.fill("#window-end", "2026-11-27 06:30")
            page.dispatch_event("#window-end", "change")
            page.wait_for_function("window.prewarm.fleet.end === '2026-11-27T06:30:00Z'")
            page.fill("#window-end", "2300-01-01 00:00")
            page.dispatch_event("#window-end", "change")
            page.wait_for_function("document.getElementById('status').textContent.includes('422')")
            assert "between 1970 and 2200" in page.inner_text("#status")

            # "Latest" goes back to the newest data.
            page.click("#window-end-clear")
            page.wait_for_function("window.prewarm.fleet.end === '2026-11-29T12:00:00Z'")
        finally:
            browser.close()
    assert [e for e in errors if "end=2300-01-01" not in e] == []  # the 2300 refusal is the point
    assert any(e.startswith("422 ") and "end=2300-01-01" in e for e in errors)


# --- a small fleet: paging while the clock moves, a model whose reads fail ---------------------------------------

PAGED = [f"p{i:03d}" for i in range(100)]
CHARTED = ("llama-7b", "meta-llama/Llama-3-8B")  # the second an id with '/', as Hugging Face's are


@pytest.fixture
def small_fleet(engine, settings):
    """100 models with a cold start each (p000's at 11:00:10, the others' at 11:30) and two with six hours of
    counts, forecasts, actions and a replay; served at 12:00:30 on a clock the test moves."""
    start = END - timedelta(hours=6)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in (*PAGED, *CHARTED)])
    ensure_partitions(engine, start - timedelta(days=1), END + timedelta(days=1))
    ensure_forecast_partitions(engine, [(start - timedelta(hours=1)).date(), END.date(),
                                        END.date() + timedelta(days=1)])
    params = {"a": start, "b": END, "ids": list(CHARTED), "paged": PAGED}
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO invocations (model_id, minute, count) "
            "SELECT m, t, 20 + (extract(epoch FROM t)::bigint / 60) % 7 FROM unnest(CAST(:ids AS text[])) m, "
            "generate_series(CAST(:a AS timestamptz), CAST(:b AS timestamptz) - interval '1 minute', "
            "interval '1 minute') t"), params)
        conn.execute(text(
            "INSERT INTO coverage (model_id, source, step_seconds, ranges) SELECT id, 'browser-test', 60, "
            "tstzmultirange(tstzrange(:a, :b, '[)')) FROM serving_models"), params)
        conn.execute(text(
            "INSERT INTO forecasts (model_id, issued_at, first_target, point, p_any, quantile_levels, quantiles) "
            "SELECT m, r.t + interval '5 seconds', r.t, array_agg(CAST(20 + k AS real) ORDER BY k), "
            "array_agg(CAST(0.9 AS real) ORDER BY k), CAST('{0.1,0.5,0.9}' AS real[]), "
            "ARRAY[array_agg(CAST(15 + k AS real) ORDER BY k), array_agg(CAST(20 + k AS real) ORDER BY k), "
            "array_agg(CAST(25 + k AS real) ORDER BY k)] "
            "FROM unnest(CAST(:ids AS text[])) m, generate_series(CAST(:a AS timestamptz) - interval '1 hour', "
            "CAST(:b AS timestamptz), interval '1 minute') r(t), generate_series(0, 9) k GROUP BY m, r.t"), params)
        conn.execute(text(
            "INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, source) "
            "SELECT m, 'n1', CASE WHEN m = 'p000' THEN CAST(:b AS timestamptz) - interval '59 minutes 50 seconds' "
            "ELSE CAST(:b AS timestamptz) - interval '30 minutes' END, 30, 'test' "
            "FROM unnest(CAST(:paged AS text[])) m"),
            params)
        # the charted models' cold starts lie before the fleet's hour: they rank last by cold starts
        conn.execute(text(
            "INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, source) "
            "SELECT m, 'n2', CAST(:b AS timestamptz) - k * interval '97 minutes', 40, 'test' "
            "FROM unnest(CAST(:ids AS text[])) m, generate_series(1, 3) k"), params)
        conn.execute(text(
            "INSERT INTO actions (kind, model_id, node_id, target, not_before, deadline, reason, expected_benefit, "
            "status) SELECT (ARRAY['prepull', 'preload', 'scale'])[k], m, 'n1', 'img:1', "
            "CAST(:b AS timestamptz) - k * interval '50 minutes', CAST(:b AS timestamptz) - k * interval '50 minutes' "
            "+ interval '8 minutes', 'forecast_spike', 40, 'succeeded' FROM unnest(CAST(:ids AS text[])) m, "
            "generate_series(1, 3) k"), params)
        replay = start_replay(conn, source="demo", window_start=start, window_end=END, policies=("prewarm", "reactive"))
        write_replay_outcomes(conn, replay_id=replay, scored_until=END, summary={}, outcomes={
            policy: [{"model_id": m, "requests": 1000, "cold_requests": cold, "replica_starts": 3, "wait_total_s": 60.0,
                      "wait_max_s": 9.0} for m in CHARTED] for policy, cold in (("prewarm", 4), ("reactive", 40))})
        conn.execute(text("ANALYZE"))
    token = create_token(engine, name="dashboard", scopes=["read"])
    clock = {"now": NOW}
    with serving(create_app(settings, engine, clock=lambda: clock["now"])) as base:
        yield {"base": base, "token": token, "engine": engine, "clock": clock}


def _fleet_rows(page) -> list[str]:
    return page.locator("#fleet-table tbody tr").evaluate_all("rs => rs.map(r => r.dataset.model)")


def test_fleet_pages_keep_their_window_while_the_clock_moves(small_fleet):
    """Without a picked end every page used to end its window at its own now: a minute between pages and p000's
    cold start left the window, p000 fell to the last page and p050 was never shown. Later pages now ask for the
    first page's window; Refresh takes a new one."""
    sync_playwright = _browser_or_skip()
    base, clock = small_fleet["base"], small_fleet["clock"]
    errors: list[str] = []
    fleet_requests: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.on("request", lambda r: fleet_requests.append(r.url) if "/v1/fleet?" in r.url else None)
            page.goto(f"{base}/dashboard/#token={small_fleet['token']}")
            page.wait_for_selector("body[data-fleet-loaded]", timeout=15_000)
            page.select_option("#fleet-sort", "cold_starts")
            page.wait_for_function("window.prewarm.fleet.sort === 'cold_starts' && !window.prewarm.loading")
            first = page.evaluate("window.prewarm.fleet")
            assert "end=" not in fleet_requests[-1] and first["end"] == "2026-11-29T12:00:00Z"
            assert _fleet_rows(page) == PAGED[:50]

            clock["now"] = NOW + timedelta(minutes=1)  # the operator reads the first page for a minute
            page.click("#fleet-next")
            page.wait_for_function("window.prewarm.fleet.offset === 50 && !window.prewarm.loading")
            assert _fleet_rows(page) == PAGED[50:]  # p050 .. p099: nothing skipped, nothing twice
            asked = dict(parse_qsl(urlsplit(fleet_requests[-1]).query))
            assert (asked.get("end"), asked.get("error_end"), asked["offset"]) == (
                first["end"], first["error_end"], "50")
            assert page.evaluate("window.prewarm.fleet.end_source") == "now"  # as the window was set
            page.click("#fleet-next")
            page.wait_for_function("window.prewarm.fleet.offset === 100 && !window.prewarm.loading")
            assert _fleet_rows(page) == list(CHARTED)
            page.click("#fleet-prev")
            page.click("#fleet-prev")
            page.wait_for_function("window.prewarm.fleet.offset === 0 && !window.prewarm.loading")
            assert _fleet_rows(page) == PAGED[:50] and "end=" in fleet_requests[-1]

            # Refresh: a new window, ending at the new now; p000's cold start has left it
            page.click("#fleet-refresh")
            page.wait_for_function("window.prewarm.fleet.end === '2026-11-29T12:01:00Z' && !window.prewarm.loading")
            assert "end=" not in fleet_requests[-1]
            assert _fleet_rows(page) == PAGED[1:51]
            # and a filter change sets a new one too
            clock["now"] = NOW + timedelta(minutes=2)
            page.select_option("#fleet-window", "360")
            page.wait_for_function("window.prewarm.fleet.window_min === 360 && !window.prewarm.loading")
            assert "end=" not in fleet_requests[-1]
            assert page.evaluate("window.prewarm.fleet.end") == "2026-11-29T12:02:00Z"
        finally:
            browser.close()
    assert errors == []


MODEL_VIEW_JS = """() => ({
    title: document.getElementById('model-title').textContent,
    error_line: document.getElementById('model-error').textContent,
    forecast_points: window.prewarm.charts.forecast
        ? window.prewarm.charts.forecast.data[1].filter(v => v != null).length : 0,
    coldstart_points: window.prewarm.charts.coldstarts
        ? window.prewarm.charts.coldstarts.data[1].filter(v => v != null).length : 0,
    chart_text: document.getElementById('chart-forecast').innerText,
    band: document.getElementById('band-label').textContent,
    coldstart_note: document.getElementById('coldstart-note').textContent,
    replay_shown: !document.getElementById('model-replay').hidden,
    replay_rows: document.querySelectorAll('#model-replay-table tbody tr').length,
    timeline_bars: document.querySelectorAll('#timeline rect[data-action-id]').length,
    action_rows: document.querySelectorAll('#actions-table tbody tr').length,
    actions: document.getElementById('actions-summary').textContent,
})"""


def test_a_model_whose_reads_fail_shows_nothing_of_the_model_before(small_fleet):
    """Opening a model whose reads fail used to keep the previous model's charts, error line, replay and actions
    under the new title; the view is now emptied first and says "no data" with the error."""
    sync_playwright = _browser_or_skip()
    base = small_fleet["base"]
    errors: list[str] = []
    model_requests: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.on("request", lambda r: model_requests.append(r.url) if "/v1/models/" in r.url else None)
            page.goto(f"{base}/dashboard/#token={small_fleet['token']}")
            page.wait_for_selector("body[data-fleet-loaded]", timeout=15_000)

            def open_model(model_id: str) -> None:
                page.evaluate("id => { location.hash = new URLSearchParams({model: id, h: 5, range: 360}); }",
                              model_id)

            # A model with data, its id with a '/': the page asks for it encoded, and draws it all
            open_model(CHARTED[1])
            page.wait_for_selector(f"body[data-model-loaded='{CHARTED[1]}']", timeout=15_000)
            assert any("/v1/models/meta-llama%2FLlama-3-8B/series?" in u for u in model_requests)
            drawn = page.evaluate(MODEL_VIEW_JS)
            assert drawn["title"] == CHARTED[1] and drawn["forecast_points"] > 300 and drawn["coldstart_points"] == 3
            assert drawn["replay_shown"] and drawn["replay_rows"] == 5 and drawn["action_rows"] == 3
            assert drawn["timeline_bars"] == 3 and "scored minutes" in drawn["error_line"]

            # A model that is not registered: every read is a 404; nothing of the model before is left
            open_model("gone-model")
            page.wait_for_function("document.getElementById('status').textContent.includes('404')", timeout=15_000)
            failed = page.evaluate(MODEL_VIEW_JS)
            assert failed == {"title": "gone-model",
                              "error_line": "no data: 404: model 'gone-model' is not registered",
                              "forecast_points": 0, "coldstart_points": 0,
                              "chart_text": "no data: 404: model 'gone-model' is not registered", "band": "",
                              "coldstart_note": "", "replay_shown": False, "replay_rows": 0, "timeline_bars": 0,
                              "action_rows": 0, "actions": ""}, failed
            assert page.get_attribute("body", "data-model-failed") == "gone-model"
            assert page.get_attribute("body", "data-model-loaded") is None

            # and a model with data afterwards is drawn whole again
            open_model(CHARTED[0])
            page.wait_for_selector(f"body[data-model-loaded='{CHARTED[0]}']", timeout=15_000)
            again = page.evaluate(MODEL_VIEW_JS)
            assert again["forecast_points"] > 300 and again["replay_shown"] and "no data" not in again["chart_text"]
            assert page.get_attribute("body", "data-model-failed") is None
        finally:
            browser.close()
    assert errors and all(e.startswith("404 ") and "gone-model" in e for e in errors), errors
