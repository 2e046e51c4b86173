/* prewarm dashboard: fleet ranking and per-model forecast vs actual, cold starts and actions.
 *
 * Plain ES2020, no build step; charts by the vendored uPlot. Reads only the read-scope API
 * (/v1/fleet, /v1/replays/latest, /v1/budget, /v1/models/{id}/series|coldstarts|actions) with a bearer token kept in
 * localStorage (or handed in once as #token=... in the URL, which is then removed from it).
 * The view lives in the URL fragment: #model=ID&h=5&range=1440[&end=...], or nothing for the fleet.
 * The horizons offered are those the store holds (/v1/dashboard/context); the fleet is ranked, searched and
 * paged by the server (/v1/fleet?sort&search&limit&offset), so 100,000 models cost one page per request.
 * Every time on the page is written one way: "YYYY-MM-DD HH:MM UTC" (fmt.time).
 */
(function () {
  "use strict";

  const TOKEN_KEY = "prewarm.readToken";
  const FALLBACK_HORIZONS = [5]; // until /v1/dashboard/context answers
  const PAGE_SIZE = 50;
  const BUDGET_POINTS = 1440; // controller updates shown, up to the window end: a day at one plan a minute
  const REFRESH_MS = 60000;
  const KINDS = ["prepull", "preload", "scale", "release"];
  const SVG_NS = "http://www.w3.org/2000/svg";

  const $ = (id) => document.getElementById(id);
  const state = {
    fleet: null,        // last /v1/fleet body
    replay: null,       // last /v1/replays/latest body (prewarm vs reactive on a simulated cluster)
    budget: null,       // last /v1/budget body (budget mode: spend against allowance, plan by plan)
    context: null,      // last /v1/dashboard/context body: stored horizons, where the windows end
    horizons: FALLBACK_HORIZONS,
    page: 0,
    fleetAnchor: null,  // {end, error_end, end_source} of the page that set the window: later pages keep it
    model: null,        // {id, horizon, range, end, shown: drawn once}
    charts: {},         // name -> uPlot
    loading: 0,
  };
  // For tests and for poking at from the console.
  window.prewarm = state;

  // --- token and API ---------------------------------------------------------------

  function token() {
    return localStorage.getItem(TOKEN_KEY) || "";
  }

  function takeTokenFromFragment() {
    const params = new URLSearchParams(location.hash.slice(1));
    if (!params.has("token")) return;
    localStorage.setItem(TOKEN_KEY, params.get("token"));
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
  }

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function api(path) {
    if (!token()) throw new ApiError(401, "enter a read token");
    const response = await fetch(path, { headers: { Authorization: "Bearer " + token() } });
    if (!response.ok) {
      let detail = response.statusText;
      try {
        const body = await response.json();
        detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
      } catch (_) { /* not JSON */ }
      throw new ApiError(response.status, detail);
    }
    return response.json();
  }

  function setStatus(text, isError) {
    const el = $("status");
    el.textContent = text;
    el.classList.toggle("error", !!isError);
  }

  function errorText(err) {
    return (err.status ? err.status + ": " : "") + err.message;
  }

  function reportError(err) {
    if (!token()) {
      setStatus("enter a read token to start", true);
      $("token-input").focus();
    } else if (err.status === 401 || err.status === 403) {
      setStatus("token refused (" + err.status + "): " + err.message, true);
      $("token-input").focus();
    } else if (err.status === 503) {
      setStatus("database unavailable; retrying on the next refresh", true);
    } else {
      setStatus(errorText(err), true);
    }
  }

  async function busy(work) {
    state.loading += 1;
    setStatus("loading...");
    try {
      await work();
      setStatus("updated " + fmt.time(new Date().toISOString()));
    } catch (err) {
      reportError(err);
    } finally {
      state.loading -= 1;
    }
  }

  // --- formatting ------------------------------------------------------------------

  const fmt = {
    pct: (v) => (v == null ? "\u2013" : (100 * v).toFixed(1) + "%"),
    num: (v, digits = 2) => (v == null ? "\u2013" : Number(v).toFixed(digits)),
    int: (v) => (v == null ? "\u2013" : Math.round(v).toLocaleString("en-US")),
    // The one time format of the page: "2019-07-15 18:00 UTC" (ISO-like, minutes, the zone stated).
    time: (value) => {
      if (value == null || value === "") return "\u2013";
      const d = typeof value === "number" ? new Date(value * 1000) : new Date(value);
      return isNaN(d) ? "\u2013" : d.toISOString().slice(0, 16).replace("T", " ") + " UTC";
    },
  };

  // uPlot's x axis and legend in the same format.
  const timeAxis = { space: 150, values: (u, splits) => splits.map((v) => fmt.time(v)) };
  const timeSeries = { value: (u, v) => fmt.time(v) };

  // The window end: a text field in the page's format ("2019-07-15 18:00", UTC), filled by hand or from the
  // browser's date picker (a hidden datetime-local input, which would show the locale's own format) -> an API
  // `end`, or "" for the default (the latest). A malformed entry is sent as typed: the API's 422 says why.
  function pickedEnd() {
    const v = $("window-end").value.trim();
    if (!v) return "";
    const m = /^(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2})$/.exec(v);
    return m ? `${m[1]}T${m[2]}:00Z` : v;
  }

  function cell(row, text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    row.appendChild(td);
    return td;
  }

  function fillSelect(select, values, selected, label) {
    select.replaceChildren();
    for (const v of values) {
      const option = document.createElement("option");
      option.value = String(v);
      option.textContent = label(v);
      option.selected = v === selected;
      select.appendChild(option);
    }
  }

  // --- routing ---------------------------------------------------------------------

  function route() {
    const params = new URLSearchParams(location.hash.slice(1));
    const id = params.get("model");
    if (id) {
      const horizon = Number(params.get("h")) || 5;
      const range = Number(params.get("range")) || 1440;
      if (params.has("end")) $("window-end").value = params.get("end").slice(0, 16).replace("T", " ");
      showModel({ id, horizon, range, end: pickedEnd() });
    } else {
      showFleet();
    }
  }

  function go(params) {
    location.hash = new URLSearchParams(params).toString();
  }

  // --- fleet view ------------------------------------------------------------------

  function fleetParams() {
    return {
      horizon: Number($("fleet-horizon").value) || 5,
      window_min: Number($("fleet-window").value),
      sort: $("fleet-sort").value,
      search: $("fleet-search").value.trim(),
      end: pickedEnd(),
    };
  }

  async function loadContext() {
    const body = await api("/v1/dashboard/context");
    state.context = body;
    state.horizons = body.horizons_min;
    const current = Number($("fleet-horizon").value) || 5;
    const keep = body.horizons_min.includes(current) ? current
      : body.horizons_min.includes(5) ? 5 : body.horizons_min[0];
    fillSelect($("fleet-horizon"), body.horizons_min, keep, (h) => h + " min");
    $("window-end-picker").max = body.now.slice(0, 16);
    $("window-end-default").textContent = $("window-end").value ? "" :
      (body.end_source === "newest_data" ? "latest data: " : "now: ") + fmt.time(body.default_end);
  }

  // Without a picked end each /v1/fleet request would end its window at its own "now": a page read a minute
  // after the one before it ranked over another window, and models were skipped or shown twice. So the first
  // page's window (its end and its error figures' hours) is kept as the anchor that every later page asks for,
  // until Refresh, a filter change, another end, or the minutely refresh of the first page sets a new one.
  async function loadFleet() {
    await busy(async () => {
      if (!state.context) await loadContext();
      const p = fleetParams();
      const anchor = p.end ? null : state.fleetAnchor;
      const query = new URLSearchParams({ horizon: p.horizon, window_min: p.window_min, sort: p.sort,
                                          limit: PAGE_SIZE, offset: state.page * PAGE_SIZE });
      if (p.search) query.set("search", p.search);
      if (p.end) {
        query.set("end", p.end);
      } else if (anchor) {
        query.set("end", anchor.end);
        query.set("error_end", anchor.error_end);
      }
      const [body, replay] = await Promise.all([api("/v1/fleet?" + query), api("/v1/replays/latest?limit=0")]);
      if (!p.end && !anchor) {
        state.fleetAnchor = { end: body.end, error_end: body.error_end, end_source: body.end_source };
      }
      if (anchor) body.end_source = anchor.end_source; // "now" or "newest_data", as when the window was set
      if (body.data.length === 0 && body.count > 0 && state.page > 0) { // past the end after a search
        state.page = Math.max(0, Math.ceil(body.count / PAGE_SIZE) - 1);
        return loadFleet();
      }
      // the budget ends where the fleet's window ends when one is picked (the fleet has checked the end)
      const budgetQuery = new URLSearchParams({ limit: BUDGET_POINTS });
      if (p.end) budgetQuery.set("until", body.end);
      const budget = await api("/v1/budget?" + budgetQuery);
      state.fleet = body;
      state.replay = replay;
      state.budget = budget;
      renderFleet();
      renderBudget();
      document.body.dataset.fleetLoaded = String(body.count);
    });
  }

  function signed(v, digits = 0) {
    if (v == null) return "\u2013";
    const text = Math.abs(v).toLocaleString("en-US", { maximumFractionDigits: digits });
    return v > 0 ? "+" + text : v < 0 ? "\u2212" + text : "0";
  }

  function gainClass(v) {
    return v > 0 ? "num gain" : v < 0 ? "num loss" : "num";
  }

  function renderReplaySummary() {
    const el = $("replay-summary");
    const info = state.replay && state.replay.replay;
    el.hidden = !info;
    if (!info) return;
    const p = info.totals[info.subject], r = info.totals[info.baseline];
    const cluster = (info.summary || {}).cluster || {};
    const gpu = (info.summary || {}).totals || {}; // fleet totals the simulators measured, GPU-seconds among them
    const size = cluster.nodes ? ` (${cluster.nodes} nodes \u00d7 ${cluster.gpus_per_node} GPUs)` : "";
    el.textContent =
      `Replay ${fmt.time(info.window_start)} to ${fmt.time(info.window_end)} on a simulated cluster${size}, ` +
      `measured until ${fmt.time(info.scored_until)}: cold-start requests ${fmt.int(p.cold_requests)} with ` +
      `prewarm vs ${fmt.int(r.cold_requests)} with a reactive autoscaler on the same ${fmt.int(r.requests)} ` +
      `requests (${signed(r.cold_requests - p.cold_requests)} avoided); request wait ` +
      `${fmt.int(p.wait_total_s)} s vs ${fmt.int(r.wait_total_s)} s (${signed(r.wait_total_s - p.wait_total_s)} s saved); ` +
      `replica cold starts ${fmt.int(p.replica_starts)} vs ${fmt.int(r.replica_starts)}` +
      (gpu[info.subject] && gpu[info.baseline]
        ? `; GPU-seconds held ${fmt.int(gpu[info.subject].gpu_seconds)} vs ${fmt.int(gpu[info.baseline].gpu_seconds)}.`
        : ".");
  }

  function renderFleet() {
    if (!state.fleet) return;
    const f = state.fleet;
    const pages = Math.max(1, Math.ceil(f.count / PAGE_SIZE));
    const tbody = $("fleet-table").tBodies[0];
    const fragment = document.createDocumentFragment();
    for (const r of f.data) {
      const tr = document.createElement("tr");
      tr.dataset.model = r.model_id;
      cell(tr, String(r.rank), "num");
      const link = document.createElement("a");
      link.href = "#" + new URLSearchParams(modelLink(r.model_id)).toString();
      link.textContent = r.model_id;
      link.title = r.model_id;
      cell(tr, "", "model").appendChild(link);
      cell(tr, fmt.pct(r.error.wmape), "num");
      cell(tr, fmt.num(r.error.mae), "num");
      cell(tr, fmt.num(r.error.brier_any, 3), "num p-any").title = r.error.p_any_minutes
        ? `mean p(any) ${fmt.pct(r.error.p_any_mean)} against ${fmt.pct(r.error.invoked_share)} of ` +
          `${r.error.p_any_minutes} minutes invoked`
        : "no scored minute's forecast stored p(any)";
      cell(tr, fmt.int(r.error.scored_minutes), "num");
      cell(tr, fmt.int(r.actual_total), "num");
      cell(tr, fmt.int(r.cold_starts), "num");
      cell(tr, `${r.actions_succeeded} / ${r.actions_total}`, "num");
      cell(tr, fmt.int(r.expected_wait_avoided_s), "num");
      const replay = r.replay;
      cell(tr, replay ? `${fmt.int(replay.prewarm.cold_requests)} / ${fmt.int(replay.reactive.cold_requests)}`
        : "\u2013", "num replay-cold");
      cell(tr, replay ? signed(replay.cold_requests_avoided) : "\u2013",
        (replay ? gainClass(replay.cold_requests_avoided) : "num") + " replay-avoided");
      cell(tr, replay ? signed(replay.wait_saved_s) : "\u2013",
        (replay ? gainClass(replay.wait_saved_s) : "num") + " replay-wait");
      cell(tr, fmt.time(r.last_forecast_at));
      fragment.appendChild(tr);
    }
    tbody.replaceChildren(fragment);
    renderReplaySummary();
    $("fleet-page").textContent = `page ${state.page + 1} of ${pages}`;
    $("fleet-prev").disabled = state.page === 0;
    $("fleet-next").disabled = state.page >= pages - 1;
    $("fleet-summary").textContent =
      `${f.count} models${f.data.length ? `, ranks ${f.data[0].rank}\u2013${f.data[f.data.length - 1].rank}` : ""}; ` +
      `horizon ${f.horizon_min} min; ${fmt.time(f.start)} to ${fmt.time(f.end)}` +
      (f.end_source === "newest_data" ? " (nothing recent stored: ending at the newest data)" : "");
  }

  // Budget mode (PREWARM_PLANNER_WASTE_BUDGET_*): what the controller measured after each plan, per minute of
  // the interval measured, and the cold-cost factor it set. Hidden when no budget is set and none was stored.
  function renderBudget() {
    const b = state.budget;
    const panel = $("budget-panel");
    panel.hidden = !b || (!b.enabled && b.points.length === 0);
    if (panel.hidden) return;
    const c = b.configured;
    const limits = c ? [
      c.pct != null ? `${fmt.num(c.pct, 0)} % of a ${c.reference_min}-minute keep-alive's idle GPU-seconds` : null,
      c.gpu_seconds_per_hour != null ? `${fmt.int(c.gpu_seconds_per_hour)} idle GPU-seconds an hour` : null,
    ].filter(Boolean) : [];
    $("budget-config").textContent = c
      ? `(budget: ${limits.join(", or less: ")}; pacing window ${fmt.int(c.window_min)} min)`
      : "(no budget is set now: states stored while one was)";
    $("budget-summary").textContent = b.status == null ? "No controller update is stored yet." :
      `Status ${b.status.replace(/_/g, " ")} at ${fmt.time(b.as_of)}` +
      (b.over_minutes > 0 ? ` (${fmt.int(b.over_minutes)} min over budget)` : "") +
      `; cold cost \u00d7 ${fmt.num(b.factor, 3)}; pacing window: ` +
      (b.window_allowed_gpu_s > 0 ? `${fmt.pct(b.window_spent_gpu_s / b.window_allowed_gpu_s)} of its allowance spent`
        : "nothing allowed yet") +
      `; in all ${fmt.int(b.spent_total_gpu_s)} idle GPU-seconds spent of ${fmt.int(b.allowed_total_gpu_s)} allowed` +
      `; the newest plan predicts ${fmt.num(b.predicted_next_minute_gpu_s, 1)} idle GPU-seconds for its next minute.`;
    const pts = b.points.filter((p) => p.interval_min > 0);
    const perMin = (key) => pts.map((p) => (p[key] == null ? null : p[key] / p.interval_min));
    const el = $("chart-budget");
    replaceChart("budget", {
      width: chartWidth(el),
      height: 240,
      tzDate: utcDate,
      scales: { x: { time: true }, factor: { distr: 3 } },
      axes: [timeAxis, { label: "idle GPU-s / min", size: 70 },
             { scale: "factor", side: 1, label: "cold-cost factor", size: 60, grid: { show: false } }],
      series: [
        timeSeries,
        { label: "spent", stroke: "#c0392b", width: 1.5 },
        { label: "allowed", stroke: "#1d2330", width: 1.5 },
        { label: "predicted", stroke: "#2662d9", width: 1, dash: [4, 3] },
        { label: "factor", scale: "factor", stroke: "#7d8da8", width: 1 },
      ],
    }, [pts.map((p) => Date.parse(p.planned_at) / 1000), perMin("spent_gpu_s"), perMin("allowed_gpu_s"),
        perMin("predicted_gpu_s"), pts.map((p) => p.factor)], el);
    document.body.dataset.budgetLoaded = String(pts.length);
  }

  function showFleet() {
    state.model = null;
    $("model-view").hidden = true;
    $("fleet-view").hidden = false;
    document.title = "prewarm: fleet";
    loadFleet();
  }

  // --- model view ------------------------------------------------------------------

  function chartWidth(el) {
    return Math.max(320, el.clientWidth || el.parentElement.clientWidth - 32);
  }

  function utcDate(ts) {
    return uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC");
  }

  function replaceChart(name, opts, data, el) {
    if (state.charts[name]) state.charts[name].destroy();
    el.replaceChildren();
    state.charts[name] = new uPlot(opts, data, el);
  }

  function renderForecast(series) {
    const el = $("chart-forecast");
    const band = series.band;
    const data = [series.t, series.actual, series.forecast];
    const lines = [
      timeSeries,
      { label: "actual", stroke: "#1d2330", width: 1.5 },
      { label: `forecast (h=${series.horizon_min} min)`, stroke: "#2662d9", width: 1.5 },
    ];
    const opts = {
      width: chartWidth(el),
      height: 300,
      tzDate: utcDate,
      cursor: { sync: { key: "prewarm-model" } },
      scales: { x: { time: true, min: series.t[0], max: series.t[series.t.length - 1] + 60 } },
      axes: [timeAxis, { label: "invocations / min", size: 60 }],
      series: lines,
    };
    if (band) {
      data.push(series.quantiles[band[1]], series.quantiles[band[0]]);
      lines.push(
        { label: `q${band[1]}`, stroke: "rgba(38, 98, 217, 0.35)", width: 1 },
        { label: `q${band[0]}`, stroke: "rgba(38, 98, 217, 0.35)", width: 1 },
      );
      opts.bands = [{ series: [3, 4], fill: "rgba(38, 98, 217, 0.15)" }];
      $("band-label").textContent = `with the q${band[0]}\u2013q${band[1]} band`;
    } else {
      $("band-label").textContent = "(no quantile band stored)";
    }
    replaceChart("forecast", opts, data, el);
  }

  function renderColdStarts(view, series) {
    const el = $("chart-coldstarts");
    const x0 = series.t[0], x1 = series.t[series.t.length - 1] + 60;
    const points = new Map(); // time -> [observed, predicted]
    const put = (iso, seconds, slot) => {
      const ts = Date.parse(iso) / 1000;
      const entry = points.get(ts) || [null, null];
      entry[slot] = entry[slot] == null ? seconds : Math.max(entry[slot], seconds);
      points.set(ts, entry);
    };
    for (const e of view.observed) put(e.started_at, e.total_seconds, 0);
    for (const p of view.predicted) {
      if (p.started_at != null && p.total_seconds != null) put(p.started_at, p.total_seconds, 1);
    }
    const xs = [x0, ...[...points.keys()].filter((t) => t > x0 && t < x1).sort((a, b) => a - b), x1];
    const observed = xs.map((t) => (points.get(t) || [null])[0]);
    const predicted = xs.map((t) => (points.get(t) || [null, null])[1]);
    const lead = xs.map((t, i) => (i === 0 || i === xs.length - 1 ? view.lead_time_s : null));
    const dots = (color) => ({ show: true, size: 7, fill: color, stroke: color });
    const opts = {
      width: chartWidth(el),
      height: 180,
      tzDate: utcDate,
      cursor: { sync: { key: "prewarm-model" } },
      scales: {
        x: { time: true, min: x0, max: x1 },
        y: { range: (u, lo, hi) => [0, Math.max(hi || 0, view.lead_time_s) * 1.15] },
      },
      axes: [timeAxis, { label: "seconds", size: 60 }],
      series: [
        timeSeries,
        { label: "observed", stroke: "#d6336c", paths: () => null, points: dots("#d6336c") },
        { label: "predicted", stroke: "#2662d9", paths: () => null, points: dots("#2662d9") },
        { label: `lead time used now (${view.lead_time_source})`, stroke: "#868e96", dash: [6, 4], spanGaps: true,
          points: { show: false } },
      ],
    };
    replaceChart("coldstarts", opts, [xs, observed, predicted, lead], el);
    $("coldstart-note").textContent = (view.note ? view.note + ". " : "") +
      `${view.observed.length} observed in this range; the recommendation endpoint's lead time is ` +
      `${fmt.num(view.lead_time_s, 1)} s (${view.lead_time_source}` +
      (view.lead_time_start_state ? `, starting from ${view.lead_time_start_state}` : "") + `)` +
      (view.observed_median_s != null ? `; observed median ${fmt.num(view.observed_median_s, 1)} s.` : ".");
  }

  function svg(name, attrs, parent) {
    const el = document.createElementNS(SVG_NS, name);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
    if (parent) parent.appendChild(el);
    return el;
  }

  function renderTimeline(body, series) {
    const box = $("timeline");
    // Share the forecast chart's plotting area, so a bar sits under the minutes it covers.
    const over = state.charts.forecast ? state.charts.forecast.over : null;
    const width = chartWidth(box), laneH = 22, top = 6;
    const left = over ? over.offsetLeft : 70;
    const right = over ? Math.max(0, width - over.offsetLeft - over.clientWidth) : 10;
    const height = top + KINDS.length * laneH + 20;
    const t0 = series.t[0], t1 = series.t[series.t.length - 1] + 60;
    const x = (ts) => left + ((ts - t0) / (t1 - t0)) * (width - left - right);
    const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, height, role: "img",
                              "aria-label": "actions timeline" });
    KINDS.forEach((kind, i) => {
      const y = top + i * laneH;
      svg("line", { x1: left, x2: width - right, y1: y + laneH, y2: y + laneH, class: "grid-line" }, root);
      svg("text", { x: left - 6, y: y + laneH / 2 + 4, class: "lane-label", "text-anchor": "end" }, root)
        .textContent = kind;
    });
    for (let i = 0; i <= 6; i++) {
      const ts = t0 + ((t1 - t0) * i) / 6;
      const anchor = i === 0 ? "start" : i === 6 ? "end" : "middle";
      const label = svg("text", { x: x(ts), y: height - 4, class: "axis", "text-anchor": anchor }, root);
      label.textContent = fmt.time(ts);
    }
    for (const a of body.data) {
      const lane = KINDS.indexOf(a.kind);
      const begin = Date.parse(a.not_before || a.updated_at) / 1000;
      const end = Date.parse(a.deadline || a.not_before || a.updated_at) / 1000;
      const x0 = Math.max(left, x(begin)), x1 = Math.min(width - right, x(end));
      const rect = svg("rect", {
        x: x0, y: top + Math.max(0, lane) * laneH + 3, width: Math.max(3, x1 - x0), height: laneH - 6, rx: 2,
        class: `action status-${a.status}`, "data-action-id": a.id,
      }, root);
      svg("title", {}, rect).textContent =
        `#${a.id} ${a.kind} ${a.status}${a.status_reason ? " (" + a.status_reason + ")" : ""}` +
        `${a.node_id ? " on " + a.node_id : ""}: ${a.reason || ""}, ` +
        `${fmt.time(a.not_before)} to ${fmt.time(a.deadline)}`;
    }
    box.replaceChildren(root);
    state.timeline = [body, series];

    const tbody = $("actions-table").tBodies[0];
    const fragment = document.createDocumentFragment();
    for (const a of body.data.slice(-200).reverse()) {
      const tr = document.createElement("tr");
      tr.dataset.actionId = a.id;
      cell(tr, String(a.id), "num");
      cell(tr, a.kind);
      cell(tr, a.node_id || "\u2013");
      cell(tr, a.target || "\u2013");
      cell(tr, a.reason || "\u2013");
      cell(tr, a.status + (a.status_reason ? ` (${a.status_reason})` : ""), "status-" + a.status);
      cell(tr, fmt.time(a.not_before));
      cell(tr, fmt.time(a.deadline));
      cell(tr, fmt.num(a.expected_benefit, 1), "num");
      fragment.appendChild(tr);
    }
    tbody.replaceChildren(fragment);
    const shown = body.data.length < body.count ? `, first ${body.data.length} drawn` : "";
    $("actions-summary").textContent = `${body.count} in this range${shown}; table shows the latest 200`;
  }

  function renderModelReplay(body) {
    const row = body.data[0];
    $("model-replay").hidden = !row;
    if (!row) return;
    const info = body.replay;
    $("model-replay-window").textContent =
      `${fmt.time(info.window_start)} to ${fmt.time(info.window_end)}, measured until ${fmt.time(info.scored_until)}`;
    const p = row.prewarm, r = row.reactive;
    const lines = [
      ["requests", p.requests, r.requests, null],
      ["cold-start requests (no ready replica)", p.cold_requests, r.cold_requests, row.cold_requests_avoided],
      ["replica cold starts", p.replica_starts, r.replica_starts, r.replica_starts - p.replica_starts],
      ["request wait, total (s)", p.wait_total_s, r.wait_total_s, row.wait_saved_s],
      ["longest wait (s)", p.wait_max_s, r.wait_max_s, r.wait_max_s - p.wait_max_s],
    ];
    const tbody = $("model-replay-table").tBodies[0];
    const fragment = document.createDocumentFragment();
    for (const [label, mine, theirs, better] of lines) {
      const tr = document.createElement("tr");
      cell(tr, label);
      cell(tr, fmt.int(mine), "num");
      cell(tr, fmt.int(theirs), "num");
      cell(tr, better == null ? "" : signed(better), better == null ? "num" : gainClass(better));
      fragment.appendChild(tr);
    }
    tbody.replaceChildren(fragment);
  }

  // What the model view shows, emptied: nothing of the model shown before stays under a new title.
  function clearModel() {
    for (const name of ["forecast", "coldstarts"]) {
      if (state.charts[name]) state.charts[name].destroy();
      delete state.charts[name];
    }
    $("chart-forecast").replaceChildren();
    $("chart-coldstarts").replaceChildren();
    for (const id of ["model-error", "band-label", "coldstart-note", "actions-summary", "model-replay-window"]) {
      $(id).textContent = "";
    }
    $("model-replay").hidden = true;
    $("model-replay-table").tBodies[0].replaceChildren();
    $("timeline").replaceChildren();
    $("actions-table").tBodies[0].replaceChildren();
    state.timeline = null;
    delete document.body.dataset.modelLoaded;
    delete document.body.dataset.modelFailed;
  }

  // A model view whose reads failed before anything of it was drawn: says so where the charts would be.
  function showNoData(m, err) {
    clearModel();
    const text = "no data: " + errorText(err);
    $("model-error").textContent = text;
    for (const id of ["chart-forecast", "chart-coldstarts"]) {
      const p = document.createElement("p");
      p.className = "note no-data";
      p.textContent = text;
      $(id).replaceChildren(p);
    }
    document.body.dataset.modelFailed = m.id;
  }

  async function loadModel() {
    const m = state.model;
    if (!m) return;
    await busy(async () => {
      try {
        await drawModel(m);
      } catch (err) {
        if (state.model !== m) return; // the user moved on meanwhile: not this view's error
        // a later refresh that fails keeps what was drawn (the status line says why); a first load shows nothing
        if (!m.shown) showNoData(m, err);
        throw err;
      }
    });
  }

  async function drawModel(m) {
    const id = encodeURIComponent(m.id);
    if (!state.context) {
      await loadContext();
      fillSelect($("model-horizon"), withHorizon(state.horizons, m.horizon), m.horizon, (h) => h + " min ahead");
    }
    const end = m.end ? `&end=${encodeURIComponent(m.end)}` : "";
    const series = await api(`/v1/models/${id}/series?horizon=${m.horizon}&span_min=${m.range}${end}`);
    const range = `start=${encodeURIComponent(series.start)}&end=${encodeURIComponent(series.end)}`;
    const [coldstarts, actions, replay] = await Promise.all([
      api(`/v1/models/${id}/coldstarts?${range}`),
      api(`/v1/models/${id}/actions?${range}`),
      api(`/v1/replays/latest?model_id=${id}`),
    ]);
    if (state.model !== m) return; // the user moved on meanwhile
    renderForecast(series);
    renderColdStarts(coldstarts, series);
    renderModelReplay(replay);
    await new Promise((resolve) => setTimeout(resolve, 0)); // uPlot lays itself out in a microtask
    if (state.model !== m) return;
    renderTimeline(actions, series);
    const e = series.error;
    $("model-error").textContent = e.scored_minutes
      ? `over ${e.scored_minutes} scored minutes: MAE ${fmt.num(e.mae)}, wMAPE ${fmt.pct(e.wmape)}, ` +
        `inside band ${fmt.pct(e.band_coverage)}` +
        (e.p_any_minutes
          ? `; p(any) Brier ${fmt.num(e.brier_any, 4)}, mean p(any) ${fmt.pct(e.p_any_mean)} against ` +
            `${fmt.pct(e.invoked_share)} of minutes invoked`
          : "")
      : "no minute with both a forecast at this horizon and a known count";
    m.shown = true;
    document.body.dataset.modelLoaded = m.id;
  }

  // A horizon from a link that the store does not offer stays selectable (its chart says what is stored).
  function withHorizon(horizons, h) {
    return horizons.includes(h) ? horizons : [...horizons, h].sort((a, b) => a - b);
  }

  function showModel(m) {
    state.model = m;
    clearModel();
    $("fleet-view").hidden = true;
    $("model-view").hidden = false;
    $("model-title").textContent = m.id;
    document.title = "prewarm: " + m.id;
    fillSelect($("model-horizon"), withHorizon(state.horizons, m.horizon), m.horizon, (h) => h + " min ahead");
    $("model-range").value = String(m.range);
    loadModel();
  }

  // --- wiring ----------------------------------------------------------------------

  function debounce(fn, ms) {
    let timer = null;
    return (...args) => {
      clearTimeout(timer);
      timer = setTimeout(() => fn(...args), ms);
    };
  }

  function modelLink(id) {
    const params = { model: id, h: state.fleet.horizon_min };
    if (pickedEnd()) params.end = pickedEnd();
    return params;
  }

  function modelParams() {
    const params = { model: state.model.id, h: $("model-horizon").value, range: $("model-range").value };
    if (pickedEnd()) params.end = pickedEnd();
    return params;
  }

  function init() {
    takeTokenFromFragment();
    $("token-input").value = token();
    fillSelect($("fleet-horizon"), FALLBACK_HORIZONS, 5, (h) => h + " min");

    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      localStorage.setItem(TOKEN_KEY, $("token-input").value.trim());
      state.fleet = null;
      state.context = null;
      state.fleetAnchor = null;
      route();
    });
    $("token-forget").addEventListener("click", () => {
      localStorage.removeItem(TOKEN_KEY);
      $("token-input").value = "";
      setStatus("token forgotten");
    });
    const firstPage = () => { state.page = 0; state.fleetAnchor = null; loadFleet(); };
    $("fleet-search").addEventListener("input", debounce(firstPage, 150));
    $("fleet-sort").addEventListener("change", firstPage);
    $("fleet-horizon").addEventListener("change", firstPage);
    $("fleet-window").addEventListener("change", firstPage);
    $("fleet-refresh").addEventListener("click", () => { state.context = null; state.fleetAnchor = null; loadFleet(); });
    $("fleet-prev").addEventListener("click", () => { state.page -= 1; loadFleet(); });
    $("fleet-next").addEventListener("click", () => { state.page += 1; loadFleet(); });
    $("window-end").addEventListener("change", () => {
      $("window-end-default").textContent = "";
      if (state.model) {
        go(modelParams());
      } else {
        firstPage();
      }
    });
    $("window-end-pick").addEventListener("click", () => {
      const picker = $("window-end-picker");
      picker.value = (pickedEnd() || (state.context ? state.context.default_end : "")).slice(0, 16);
      try { picker.showPicker(); } catch (_) { picker.focus(); }
    });
    $("window-end-picker").addEventListener("change", () => {
      $("window-end").value = $("window-end-picker").value.replace("T", " ");
      $("window-end").dispatchEvent(new Event("change"));
    });
    $("window-end-clear").addEventListener("click", () => {
      $("window-end").value = "";
      state.context = null;
      if (state.model) go(modelParams()); else firstPage();
    });
    $("fleet-table").addEventListener("click", (event) => {
      const tr = event.target.closest("tr[data-model]");
      if (tr && event.target.tagName !== "A") go(modelLink(tr.dataset.model));
    });
    $("model-horizon").addEventListener("change", () => go(modelParams()));
    $("model-range").addEventListener("change", () => go(modelParams()));
    window.addEventListener("hashchange", () => { takeTokenFromFragment(); route(); });
    window.addEventListener("resize", debounce(() => {
      for (const [name, chart] of Object.entries(state.charts)) {
        const el = $(name === "forecast" ? "chart-forecast" : "chart-coldstarts");
        chart.setSize({ width: chartWidth(el), height: chart.height });
      }
      if (state.model && state.timeline) renderTimeline(...state.timeline);
    }, 150));
    setInterval(() => {
      if (document.hidden || state.loading) return;
      if (state.model) {
        loadModel();
      } else {
        if (state.page === 0) state.fleetAnchor = null; // the first page follows now; later ones keep their window
        loadFleet();
      }
    }, REFRESH_MS);
    if (!token()) setStatus("enter a read token to start", true);
    route();
  }

  init();
})();
