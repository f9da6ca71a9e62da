// The tailserve dashboard: polls /dashboard/series for the points it has not seen and draws
// them as inline SVG. No libraries: the page must work on a stack with no way out.
"use strict";

const SERIES_URL = "/dashboard/series";
const KEEP = 600; // points kept (the server keeps about ten minutes of them)
const COLORS = ["#1f6feb", "#d1242f", "#1a7f37", "#9a6700", "#8250df", "#cf222e", "#0550ae", "#6e7781"];
const SVG = "http://www.w3.org/2000/svg";

const state = { latest: 0, points: [], interval: 1, cards: new Map() };

function $(selector, root = document) {
  return root.querySelector(selector);
}

function el(name, attrs = {}, parent = null) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (parent) parent.appendChild(node);
  return node;
}

function formatSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 0.001) return `${(s * 1e6).toFixed(0)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(s < 0.01 ? 2 : 1)} ms`;
  return `${s.toFixed(2)} s`;
}

function formatNumber(v) {
  if (v === null || v === undefined) return "–";
  if (Math.abs(v) >= 100) return v.toFixed(0);
  if (Math.abs(v) >= 10) return v.toFixed(1);
  return v.toFixed(2);
}

function formatRatio(v) {
  return v === null || v === undefined ? "–" : `${(v * 100).toFixed(0)}%`;
}

// A line chart: `series` is [{name, values: [[t, v|null], ...], dashed}], t in Unix seconds.
function drawChart(figure, series, format, fixedMax = null) {
  const W = 360, H = 140, left = 48, right = 8, top = 8, bottom = 18;
  for (const old of figure.querySelectorAll("svg, .legend, .empty")) old.remove();
  const drawn = series.filter((s) => s.values.some(([, v]) => v !== null && v !== undefined));
  figure.dataset.points = "0";
  if (drawn.length === 0) {
    const empty = document.createElement("div");
    empty.className = "empty";
    empty.textContent = "nothing in this window";
    figure.appendChild(empty);
    return;
  }
  const times = state.points.map((p) => p.at);
  const t1 = times[times.length - 1];
  const t0 = Math.min(times[0], t1 - 60);
  let max = fixedMax;
  if (max === null) {
    max = 0;
    for (const s of drawn) for (const [, v] of s.values) if (v !== null && v > max) max = v;
    max = max > 0 ? max * 1.1 : 1;
  }
  const x = (t) => left + ((t - t0) / Math.max(t1 - t0, 1)) * (W - left - right);
  const y = (v) => top + (1 - Math.min(v, max) / max) * (H - top - bottom);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  el("line", { class: "axis", x1: left, x2: W - right, y1: H - bottom, y2: H - bottom }, svg);
  el("line", { class: "axis", x1: left, x2: left, y1: top, y2: H - bottom }, svg);
  for (const fraction of [0, 0.5, 1]) {
    const label = el("text", { x: left - 4, y: y(max * fraction) + 3, "text-anchor": "end" }, svg);
    label.textContent = format(max * fraction);
  }
  const span = t1 - t0;
  for (const fraction of [0, 0.5]) {
    const label = el("text", { x: x(t0 + span * fraction), y: H - 4 }, svg);
    label.textContent = `-${Math.round(span * (1 - fraction))} s`;
  }
  el("text", { x: W - right, y: H - 4, "text-anchor": "end" }, svg).textContent = "now";
  let count = 0;
  const legend = document.createElement("div");
  legend.className = "legend";
  drawn.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    // A gap (no value) breaks the line rather than joining across it.
    let run = [];
    const flush = () => {
      if (run.length > 0) {
        const line = el("polyline", { points: run.join(" "), stroke: color }, svg);
        line.dataset.series = s.name;
        if (s.dashed) line.setAttribute("class", "slo");
        count += run.length;
      }
      run = [];
    };
    for (const [t, v] of s.values) {
      if (v === null || v === undefined) flush();
      else run.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
    }
    flush();
    const key = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = color;
    key.append(swatch, s.name);
    legend.appendChild(key);
  });
  figure.dataset.points = String(count);
  figure.append(svg, legend);
}

// [[t, value]] of one model's field over the points kept.
function track(model, pick) {
  return state.points.map((p) => {
    const m = p.models[model];
    return [p.at, m ? pick(m) : null];
  });
}

// One series a key of a per-model mapping (reason, tier, outcome, variant) seen in the window.
function keyed(model, field) {
  const keys = new Set();
  for (const p of state.points) {
    const m = p.models[model];
    if (m) for (const key of Object.keys(m[field])) keys.add(key);
  }
  return [...keys].sort().map((key) => ({
    name: key,
    values: track(model, (m) => (key in m[field] ? m[field][key] : 0)),
  }));
}

function card(model) {
  let node = state.cards.get(model);
  if (!node) {
    node = $("#model-template").content.firstElementChild.cloneNode(true);
    node.dataset.testid = `model-${model}`;
    $(".name", node).textContent = model;
    for (const figure of node.querySelectorAll("figure[data-chart]")) {
      figure.dataset.testid = `chart-${figure.dataset.chart}-${model}`;
    }
    $("#models").appendChild(node);
    state.cards.set(model, node);
  }
  return node;
}

function drawModel(model) {
  const node = card(model);
  const chart = (name) => $(`figure[data-chart="${name}"]`, node);
  const last = state.points[state.points.length - 1].models[model];
  const slo = track(model, (m) => m.slo_s);
  drawChart(
    chart("latency"),
    [
      { name: "p50", values: track(model, (m) => m.p50_s) },
      { name: "p99", values: track(model, (m) => m.p99_s) },
      { name: "SLO", values: slo, dashed: true, color: "#6e7781" },
    ],
    formatSeconds,
  );
  drawChart(
    chart("throughput"),
    [
      { name: "answered", values: track(model, (m) => m.requests_per_s) },
      { name: "5xx", values: track(model, (m) => m.errors_per_s) },
    ],
    formatNumber,
  );
  drawChart(chart("refusals"), keyed(model, "refusals_per_s"), formatNumber);
  drawChart(chart("cache"), keyed(model, "cache_hit_ratio"), formatRatio, 1);
  drawChart(chart("batch"), [{ name: "rows", values: track(model, (m) => m.batch_rows_mean) }], formatNumber);
  drawChart(
    chart("efficiency"),
    [{ name: "efficiency", values: track(model, (m) => m.batch_efficiency) }],
    formatRatio,
    1,
  );
  drawChart(chart("queue"), [{ name: "p99", values: track(model, (m) => m.queue_p99_s) }], formatSeconds);
  drawChart(chart("hedges"), keyed(model, "hedges_per_s"), formatNumber);
  drawChart(chart("variants"), keyed(model, "variants_per_s"), formatNumber);
  drawChart(chart("jobs"), keyed(model, "jobs_finished_per_s"), formatNumber);
  const now = $(".now", node);
  if (last) {
    now.innerHTML = "";
    const parts = [
      ["rps", `${formatNumber(last.requests_per_s)} req/s`],
      ["p99", `p99 ${formatSeconds(last.p99_s)}`],
      ["slo", `SLO ${formatSeconds(last.slo_s)}`],
    ];
    for (const [id, text] of parts) {
      const span = document.createElement("span");
      span.dataset.testid = `${id}-${model}`;
      span.dataset.value = String(id === "rps" ? last.requests_per_s : id === "p99" ? last.p99_s : last.slo_s);
      span.textContent = `${text}  `;
      now.appendChild(span);
    }
  }
}

function fillList(list, values, prefix, format = (v) => String(Math.round(v))) {
  list.innerHTML = "";
  const keys = Object.keys(values).sort();
  if (keys.length === 0) {
    const none = document.createElement("dt");
    none.textContent = "none yet";
    list.appendChild(none);
  }
  for (const key of keys) {
    const term = document.createElement("dt");
    term.textContent = key;
    const value = document.createElement("dd");
    value.dataset.testid = `${prefix}-${key}`;
    value.textContent = format(values[key]);
    list.append(term, value);
  }
}

function drawWorkers(workers) {
  const body = $("[data-testid=workers] tbody");
  body.innerHTML = "";
  for (const w of workers) {
    const row = document.createElement("tr");
    row.dataset.testid = `worker-${w.name}`;
    const cells = [w.name, w.state, w.ready ? "yes" : "no", w.restarts, formatSeconds(w.cold_start_s), w.pid ?? "–"];
    cells.forEach((text, i) => {
      const cell = document.createElement("td");
      cell.textContent = String(text);
      if (i === 1) cell.className = `state-${w.state}`;
      row.appendChild(cell);
    });
    body.appendChild(row);
  }
  const states = new Set();
  for (const p of state.points) for (const s of Object.keys(p.workers)) states.add(s);
  const series = [...states].sort().map((s) => ({
    name: s,
    values: state.points.map((p) => [p.at, p.workers[s] || 0]),
  }));
  let most = 1;
  for (const s of series) for (const [, v] of s.values) most = Math.max(most, v);
  drawChart($("[data-testid=chart-workers]"), series, (v) => v.toFixed(1).replace(".0", ""), most);
}

function draw(document_) {
  const last = state.points[state.points.length - 1];
  drawWorkers(document_.workers);
  if (!last) return;
  $("[data-testid=sample-seq]").textContent = String(last.seq);
  $("[data-testid=sample-time]").textContent = new Date(last.at * 1000).toLocaleTimeString();
  const t = last.totals;
  fillList($("[data-testid=totals-requests]"), t.requests, "total-requests");
  fillList($("[data-testid=totals-cache-hits]"), t.cache_hits, "total-cache-hits");
  fillList($("[data-testid=totals-cache-lookups]"), t.cache_lookups, "total-cache-lookups");
  fillList($("[data-testid=totals-refusals]"), t.refusals, "total-refusals");
  fillList($("[data-testid=totals-jobs]"), { running: t.jobs_running, ...t.jobs_finished }, "total-jobs");
  const models = new Set();
  for (const p of state.points) for (const m of Object.keys(p.models)) models.add(m);
  // The busiest first.
  const order = [...models].sort((a, b) => (t.requests[b] || 0) - (t.requests[a] || 0) || a.localeCompare(b));
  for (const model of order) {
    drawModel(model);
    $("#models").appendChild(state.cards.get(model));
  }
}

async function poll() {
  const status = $("[data-testid=status]");
  try {
    const reply = await fetch(`${SERIES_URL}?since=${state.latest}`, { cache: "no-store" });
    if (!reply.ok) throw new Error(`the stack answered ${reply.status}`);
    const document_ = await reply.json();
    if (document_.latest < state.latest) state.points = []; // the supervisor restarted
    state.points.push(...document_.points);
    state.points = state.points.slice(-KEEP);
    state.latest = document_.latest;
    state.interval = document_.interval_s;
    $("[data-testid=interval]").textContent = String(state.interval);
    draw(document_);
    status.textContent = "live";
    status.className = "status live";
  } catch (error) {
    status.textContent = `no answer from the stack (${error.message}); trying again`;
    status.className = "status down";
  }
  setTimeout(poll, state.interval * 1000);
}

poll();
