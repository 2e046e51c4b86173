"""The report as one self-contained HTML file: inline CSS, the vendored uPlot inlined, the numbers embedded as JSON.

Tables and headline figures are written here, in the page's HTML, each number with ``data-path`` (where it sits in
the embedded JSON) and ``data-value`` (the exact value), so the page reads without JavaScript and a test can hold
every shown number to the JSON. The plots are drawn by a small script from the same embedded JSON. Nothing is
fetched: no fonts, no CDN, no images.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import forecaster

UPLOT_DIR = Path(forecaster.__file__).resolve().parent.parent / "api" / "static" / "vendor" / "uplot"
COLOURS = {"prewarm": "#1f6feb", "reactive": "#d1242f", "keepalive": "#9a6700"}


def _colour(policy: str) -> str:
    return COLOURS["keepalive"] if policy.startswith("keepalive") else COLOURS.get(policy, "#57606a")


def fmt_count(v) -> str:
    return "-" if v is None else f"{round(v):,}"


def fmt_float(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def fmt_float2(v) -> str:
    return fmt_float(v, 2)


def fmt_bytes(v) -> str:
    return "-" if v is None else f"{v / 1e9:,.1f} GB"


def fmt_pct(v) -> str:
    return "-" if v is None else f"{v:.2f} %"


def _cell(numbers: dict, path: list, fmt=fmt_count, tag: str = "td", cls: str = "") -> str:
    value = numbers
    for key in path:
        value = value[key] if value is not None else None
    attr = html.escape(json.dumps(path), quote=True)
    raw = "" if value is None else repr(float(value))
    klass = f' class="{cls}"' if cls else ""
    return (f'<{tag}{klass} data-path="{attr}" data-value="{raw}" data-format="{fmt.__name__}">'
            f"{html.escape(fmt(value))}</{tag}>")


def _policy_table(numbers: dict) -> str:
    columns = (("requests", "requests", fmt_count), ("cold_requests", "cold-start requests", fmt_count),
               ("cold_pct_overall", "cold %", fmt_pct), ("cold_pct_p75", "p75 model cold %", fmt_pct),
               ("wait_p50_s", "wait p50 s", fmt_float2), ("wait_p99_s", "wait p99 s", fmt_float),
               ("gpu_seconds", "GPU-seconds", fmt_count), ("wasted_gpu_seconds", "idle GPU-seconds", fmt_count),
               ("bytes_registry", "image bytes", fmt_bytes), ("bytes_object_store", "weight bytes", fmt_bytes),
               ("replica_starts", "replica starts", fmt_count))
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label, _ in columns)
    rows = []
    for policy in numbers["policies"]:
        cells = "".join(_cell(numbers, ["policies", policy, key], f) for key, _, f in columns)
        rows.append(f'<tr><th class="policy"><span class="swatch" style="background:{_colour(policy)}"></span>'
                    f"{html.escape(policy)}</th>{cells}</tr>")
    return f'<table id="policy-table"><thead><tr><th>policy</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _cards(numbers: dict) -> str:
    keep = next(p for p in numbers["policies"] if p.startswith("keepalive"))
    cards = []
    for other in ("reactive", keep):
        cards.append(
            f'<div class="card"><div class="label">cold-start requests avoided vs {html.escape(other)}</div>'
            f'{_cell(numbers, ["comparison", other, "cold_requests_avoided"], tag="div", cls="big")}'
            f'<div class="sub">GPU-seconds spent beyond it: '
            f'{_cell(numbers, ["comparison", other, "gpu_seconds_extra"], tag="span")}; bytes: '
            f'{_cell(numbers, ["comparison", other, "bytes_extra"], fmt_bytes, tag="span")}</div></div>')
    cards.append(f'<div class="card"><div class="label">cold-start requests under prewarm</div>'
                 f'{_cell(numbers, ["policies", "prewarm", "cold_requests"], tag="div", cls="big")}'
                 f'<div class="sub">of {_cell(numbers, ["policies", "prewarm", "requests"], tag="span")} requests '
                 f'({_cell(numbers, ["policies", "prewarm", "cold_pct_overall"], fmt_pct, tag="span")})</div></div>')
    return f'<div class="cards">{"".join(cards)}</div>'


def _model_table(numbers: dict) -> str:
    keep = next(p for p in numbers["policies"] if p.startswith("keepalive"))
    policies = list(numbers["policies"])
    head = ("<th>model</th><th>requests</th>" + "".join(f"<th>cold {html.escape(p)}</th>" for p in policies)
            + f"<th>avoided vs reactive</th><th>avoided vs {html.escape(keep)}</th>"
            + "".join(f"<th>GPU-s {html.escape(p)}</th>" for p in policies)
            + "<th>bytes prewarm</th><th>forecast WAPE</th><th>in 80 % band</th>")
    rows = []
    for i, row in enumerate(numbers["models"]):
        link = (f'<td class="model"><a href="#" data-model="{html.escape(row["model_id"], quote=True)}">'
                f'{html.escape(row["model_id"])}</a></td>')
        cells = [link, _cell(numbers, ["models", i, "requests"])]
        cells += [_cell(numbers, ["models", i, "cold_requests", p]) for p in policies]
        cells += [_cell(numbers, ["models", i, "avoided_vs_reactive"]),
                  _cell(numbers, ["models", i, "avoided_vs_keepalive"])]
        cells += [_cell(numbers, ["models", i, "gpu_seconds", p]) for p in policies]
        total_bytes = row["bytes_registry"]["prewarm"] + row["bytes_object_store"]["prewarm"]
        cells.append(f'<td data-value="{total_bytes!r}" data-format="fmt_bytes">{fmt_bytes(total_bytes)}</td>')
        cells += [_cell(numbers, ["models", i, "forecast", "wape_pct"], fmt_pct),
                  _cell(numbers, ["models", i, "forecast", "coverage_80_pct"], fmt_pct)]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return (f'<table id="model-table"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>')


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1f2328;background:#f6f8fa}
header{background:#fff;border-bottom:1px solid #d0d7de;padding:16px 24px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px}
main{padding:0 24px 32px;max-width:1400px}
.meta{color:#57606a}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin-top:16px}
.card{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:12px 16px;min-width:260px}
.card .label{color:#57606a;font-size:12px}.card .big{font-size:26px;font-weight:600}.card .sub{font-size:12px}
section{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:12px 16px;margin-top:16px;overflow-x:auto}
table{border-collapse:collapse;font-variant-numeric:tabular-nums;font-size:13px}
th,td{padding:4px 8px;border-bottom:1px solid #eaeef2;text-align:right;white-space:nowrap}
th{background:#f6f8fa;font-weight:600}th.policy,td.model{text-align:left}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px}
.chart{margin:8px 0}.note{color:#57606a;font-size:12px}
#model-table{max-height:none}
"""

SCRIPT = r"""
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const s = data.series;
  const colours = JSON.parse(document.getElementById("report-colours").textContent);
  const policies = Object.keys(data.policies);
  const colour = (p) => (p.startsWith("keepalive") ? colours.keepalive : colours[p] || "#57606a");
  const xs = s.fleet.requests.map((_, i) => s.t0_s + i * s.bin_min * 60);
  const tz = (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC");
  const charts = {};
  function width(el) { return Math.max(480, (el.clientWidth || 1000) - 8); }
  function draw(id, series, columns, opts) {
    const el = document.getElementById(id);
    if (charts[id]) charts[id].destroy();
    el.replaceChildren();
    charts[id] = new uPlot(Object.assign({width: width(el), height: 240, tzDate: tz,
      series: [{label: "UTC"}].concat(series), axes: [{}, {size: 70}]}, opts || {}), [xs].concat(columns), el);
  }
  draw("chart-cold", policies.map((p) => ({label: p, stroke: colour(p), width: 1.5})),
       policies.map((p) => s.fleet.cold_requests[p]));
  draw("chart-gpu", policies.map((p) => ({label: p, stroke: colour(p), width: 1.5})),
       policies.map((p) => s.fleet.gpu_seconds[p]));
  draw("chart-fleet-forecast", [{label: "requests", stroke: "#1f2328", width: 1.5},
       {label: "forecast median (" + s.ahead_min + " min ahead)", stroke: colours.prewarm, width: 1.5}],
       [s.fleet.requests, s.fleet["forecast_q0.5"]]);
  const select = document.getElementById("model-select");
  function showModel(id) {
    const m = s.models[id];
    if (!m) return;
    select.value = id;
    draw("chart-model", [
      {label: "actual", stroke: "#1f2328", width: 1.5},
      {label: "forecast median", stroke: colours.prewarm, width: 1.5},
      {label: "q0.1", stroke: "#8cb4f5", width: 1, dash: [4, 3]},
      {label: "q0.9", stroke: "#8cb4f5", width: 1, dash: [4, 3]},
    ], [m.actual, m["q0.5"], m["q0.1"], m["q0.9"]],
      {bands: [{series: [4, 3], fill: "rgba(31,111,235,0.12)"}]});
    draw("chart-model-cold", policies.map((p) => ({label: "cold " + p, stroke: colour(p), width: 1.5})),
         policies.map((p) => m.cold_requests[p]), {height: 160});
  }
  select.addEventListener("change", () => showModel(select.value));
  document.querySelectorAll("a[data-model]").forEach((a) => a.addEventListener("click", (e) => {
    e.preventDefault();
    showModel(a.dataset.model);
    document.getElementById("model-section").scrollIntoView();
  }));
  if (data.models.length) showModel(data.models[0].model_id);
  document.body.dataset.rendered = "true";
})();
"""


def _json_script(element_id: str, payload) -> str:
    text = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def render(numbers: dict) -> str:
    """The whole page."""
    info = numbers["report"]
    uplot_js = (UPLOT_DIR / "uPlot.iife.min.js").read_text()
    uplot_css = (UPLOT_DIR / "uPlot.min.css").read_text()
    fc = info["forecaster"]
    err = fc["error"] or {}
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in info["notes"])
    options = "".join(f'<option value="{html.escape(m["model_id"], quote=True)}">{html.escape(m["model_id"])} '
                      f'({m["requests"]:,} requests)</option>' for m in numbers["models"])
    bin_min = numbers["series"]["bin_min"]
    per = "minute" if bin_min == 1 else f"{bin_min} minutes"
    keep = next(p for p in numbers["policies"] if p.startswith("keepalive"))
    stages = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in info["stage_seconds"].items())
    fit = (f"fitted at {html.escape(fc['first_fit_at'] or '')} ({fc['retrains']} fit(s))" if fc["first_fit_at"]
           else "never fitted (too little history)")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>prewarm report {html.escape(info['since'][:16])} .. {html.escape(info['until'][:16])}</title>
<style>{uplot_css}</style><style>{CSS}</style></head>
<body>
<header><h1>prewarm advisory report</h1>
<div class="meta">{info['models']} models, {html.escape(info['since'])} to {html.escape(info['until'])} UTC
({info['scored_minutes']:,} minutes scored; {info['history_minutes']:,} minutes of history before them);
{info['fleet']['nodes']} nodes x {info['fleet']['gpus_per_node']} GPUs (simulated). Generated
{html.escape(info['generated_at'])}.</div>
{_cards(numbers)}
</header>
<main>
<section id="policies"><h2>What each policy would have done on these requests</h2>
<p class="note">prewarm: {html.escape(info['policies']['prewarm'])} (the ensemble forecaster, the plan step and the
actuator's guardrails of the plan job); reactive: {html.escape(info['policies']['reactive'])}; {html.escape(keep)}:
{html.escape(info['policies'][keep])}. Same requests, same simulated cluster. A cold-start request arrived while its
model had no ready replica. GPU-seconds: GPUs held (placed to released); bytes: image pulls from registries and weight
fetches from object stores, pre-pulls and pre-loads included.</p>
{_policy_table(numbers)}</section>
<section><h2>Cold-start requests per {per}</h2><div class="chart" id="chart-cold"></div>
<h2>GPU-seconds held per {per}</h2><div class="chart" id="chart-gpu"></div></section>
<section id="forecast"><h2>Forecast vs actual</h2>
<p class="note">The forecast prewarm planned with, issued {fc['ahead_min']} minutes before each minute: the product's
ensemble, {fit}; {fc['minutes_from_ensemble']:,} scored minutes from the ensemble,
{fc['minutes_from_empirical']:,} from the causal empirical source it uses before its first fit. Every forecast saw
only minutes before its origin. Fleet: MAE
<span data-path='["report","forecaster","error","mae"]' data-value="{err.get('mae')!r}" data-format="fmt_float">{fmt_float(err.get('mae'), 3)}</span>
per model-minute, WAPE {fmt_pct(err.get('wape_pct'))}, {fmt_pct(err.get('coverage_80_pct'))} of model-minutes inside
the 80 % band.</p>
<div class="chart" id="chart-fleet-forecast"></div></section>
<section id="model-section"><h2>Per model</h2>
<label>model <select id="model-select">{options}</select></label>
<div class="chart" id="chart-model"></div><div class="chart" id="chart-model-cold"></div>
{_model_table(numbers)}</section>
<section><h2>Inputs and method</h2><ul class="note">{notes}</ul>
<p class="note">How it is computed: docs/report.md. Stage times: {html.escape(stages)}.</p></section>
</main>
{_json_script("report-data", numbers)}
{_json_script("report-colours", COLOURS)}
<script>{uplot_js}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def write_report(numbers: dict, path: Path) -> int:
    """Write the page; returns its size in bytes."""
    page = render(numbers)
    path.write_text(page, encoding="utf-8")
    return len(page.encode("utf-8"))
