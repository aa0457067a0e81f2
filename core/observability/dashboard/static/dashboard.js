// VoltRL dashboard: the charts (uPlot), the runs table's sparklines, and the parts of a page
// fetched when opened. Tables update through htmx attributes in the pages; the charts poll the
// run's JSON series while it runs.
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea"];

// uPlot lays ticks from the range's width: a width of zero (one step, a constant metric) or of
// rounding noise (a ratio of 1 and 1.0000000000000002) would never end, so pad it out.
function padded(lo, hi, nice) {
  if (lo == null || hi == null) return [0, 1];
  const size = Math.max(Math.abs(lo), Math.abs(hi));
  if (hi - lo <= size * 1e-6) {
    const pad = size * 0.1 || 1;
    return [lo - pad, hi + pad];
  }
  return nice ? uPlot.rangeNum(lo, hi, 0.1, true) : [lo, hi];
}

// A tick label with the digits its neighbours need to differ (1e-8, 6.0581, 0.001).
function tick(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
  return String(+v.toPrecision(6));
}

// The engine's mismatch with the trainer (mismatch/...) is never below 0: its charts start
// at 0, so a flat 0.040-0.042 does not fill the chart as if it swung.
function chartOptions(name, labels, width) {
  const fromZero = name.startsWith("mismatch/");
  const yRange = (u, lo, hi) => (fromZero ? [0, padded(0, hi, true)[1]] : padded(lo, hi, true));
  return {
    width: width, height: 180,
    legend: { show: true, live: true },
    scales: { x: { time: false, range: (u, lo, hi) => padded(lo, hi, false) }, y: { range: yRange } },
    axes: [
      { label: "step", size: 36, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000] },
      { size: 64, values: (u, splits) => splits.map(tick) },
    ],
    series: [{ label: "step" }].concat(labels.map((label, i) => ({
      label: label, stroke: COLORS[i % COLORS.length], width: 1.5,
      points: { show: true, size: 3 }, spanGaps: true,
    }))),
  };
}

// [[name, steps, values], ...] per run -> {name: [steps, values]} per run, and every name in
// the order the runs list them (the server puts rewards, loss and KL first).
function byName(perRun) {
  const names = [];
  const maps = perRun.map(series => {
    const m = new Map();
    for (const [name, xs, ys] of series) {
      if (!names.includes(name)) names.push(name);
      m.set(name, [xs, ys]);
    }
    return m;
  });
  return { names, maps };
}

// One metric of several runs -> uPlot's aligned data: one x axis, one column per run.
function aligned(columns) {
  const xs = Array.from(new Set(columns.flatMap(s => (s ? s[0] : [])))).sort((a, b) => a - b);
  const ys = columns.map(s => {
    if (!s) return xs.map(() => null);
    const at = new Map(s[0].map((x, i) => [x, s[1][i]]));
    return xs.map(x => (at.has(x) ? at.get(x) : null));
  });
  return [xs].concat(ys);
}

// The main metrics (rewards, loss, KL, entropy...: the server's list) get a chart each in
// view; the rest (counts, timings, settings) are folded under "more metrics".
function drawCharts(root, perRun, labels, first, notes) {
  const { names, maps } = byName(perRun);
  const columnsWide = Math.max(1, Math.floor(root.clientWidth / 400));
  const width = Math.max(340, Math.min(root.clientWidth, 1500) / columnsWide - 24);
  const plots = new Map();
  const wasOpen = root.querySelector("details.more-charts")?.open || false;
  root.innerHTML = "";
  // A LoRA adapter's update/<adapter>/<metric> is main when update/<metric> is (its
  // mismatch/<adapter>/<metric> when mismatch/<metric> is).
  const isMain = n => {
    const adapter = /^(update|mismatch)\/[^/]+\/(.+)$/.exec(n);
    return first.includes(n) || (adapter !== null &&
      (adapter[2] === "reward_mean" || first.includes(`${adapter[1]}/${adapter[2]}`)));
  };
  const main = names.filter(isMain);
  const rest = names.filter(n => !isMain(n));
  let more = null;
  if (rest.length) {
    more = document.createElement("details");
    more.className = "more-charts";
    more.open = wasOpen || !main.length;
    more.innerHTML = `<summary>${rest.length} more metrics</summary><div class="charts"></div>`;
  }
  for (const name of main.concat(rest)) {
    const box = document.createElement("div");
    box.className = "chart";
    box.dataset.metric = name;
    const title = document.createElement("h4");
    title.textContent = name;
    box.appendChild(title);
    if (notes[name]) {  // what it measures, in what unit
      const note = document.createElement("p");
      note.className = "chart-note";
      note.textContent = notes[name];
      box.appendChild(note);
    }
    (isMain(name) ? root : more.lastElementChild).appendChild(box);
    const data = aligned(maps.map(m => m.get(name)));
    plots.set(name, new uPlot(chartOptions(name, labels, width), data, box));
  }
  if (more) root.appendChild(more);
  return plots;
}

function startCharts() {
  const root = document.getElementById("charts");
  const script = document.getElementById("series");
  if (!root || !script) return;
  const payload = JSON.parse(script.textContent);
  const perRun = payload.compare || [payload.series];
  const first = payload.first || [];
  const notes = payload.notes || {};
  let plots = drawCharts(root, perRun, payload.labels, first, notes);
  if (root.dataset.live !== "true" || !root.dataset.src) return;
  const timer = setInterval(async () => {
    try {
      const answer = await (await fetch(root.dataset.src, { credentials: "same-origin" })).json();
      const { names, maps } = byName([answer.series]);
      if (names.length !== plots.size || names.some(n => !plots.has(n))) {
        plots.forEach(p => p.destroy());
        plots = drawCharts(root, [answer.series], payload.labels, first, notes);
      } else {
        for (const n of names) plots.get(n).setData(aligned([maps[0].get(n)]));
      }
      const status = document.getElementById("run-status");
      if (status) { status.textContent = answer.status; status.className = "status " + answer.status; }
      if (answer.status !== "running") clearInterval(timer);
      liveBadge(true);
    } catch (err) {
      liveBadge(false);
    }
  }, 3000);
}

function drawSparks(root) {
  for (const el of root.querySelectorAll(".spark[data-values]")) {
    const values = JSON.parse(el.dataset.values || "[]");
    if (values.length < 2) { el.textContent = values.length ? values[0].toFixed(2) : ""; continue; }
    const w = 120, h = 24, lo = Math.min(...values), hi = Math.max(...values), span = hi - lo || 1;
    const pts = values.map((v, i) => `${(i / (values.length - 1)) * w},${h - 2 - ((v - lo) / span) * (h - 4)}`);
    el.innerHTML = `<svg width="${w}" height="${h}" role="img" aria-label="reward by step">` +
      `<polyline fill="none" stroke="#2563eb" stroke-width="1.5" points="${pts.join(" ")}"/></svg>`;
  }
}

// A <details class="lazy" data-part="..."> (a call's tokens, the spans...) is fetched when it
// opens, from its part under the enclosing data-base: the page itself carries none of it.
// "toggle" does not bubble, hence the capture.
async function openLazy(details) {
  const base = details.closest("[data-base]");
  if (!details.open || !base || details.dataset.loaded) return;
  const slot = details.querySelector(":scope > .slot");
  details.dataset.loaded = "loading";
  slot.textContent = "loading…";
  try {
    const answer = await fetch(base.dataset.base + details.dataset.part, { credentials: "same-origin" });
    if (!answer.ok) throw new Error(`the dashboard answered ${answer.status}`);
    slot.innerHTML = await answer.text();  // rendered by the server, escaped there
    details.dataset.loaded = "yes";
  } catch (err) {
    slot.textContent = `could not load this: ${err.message}`;
    delete details.dataset.loaded;  // closing and opening it again tries again
  }
}
document.addEventListener("toggle", e => {
  if (e.target instanceof HTMLDetailsElement && e.target.classList.contains("lazy")) openLazy(e.target);
}, true);

document.addEventListener("DOMContentLoaded", () => {
  startCharts();
  drawSparks(document);
  document.querySelectorAll("details.lazy[open]").forEach(openLazy);
});
// A live region is swapped every few seconds: keep what the reader ticked or opened in it.
let kept = null;
document.addEventListener("htmx:beforeSwap", e => {
  const root = e.detail.target;
  kept = {
    checked: Array.from(root.querySelectorAll("input[type=checkbox]:checked"), i => `${i.name}=${i.value}`),
    open: Array.from(root.querySelectorAll("details[id]"), d => [d.id, d.open]),
    // a call's tokens and request never change: what was fetched is kept, not fetched again
    parts: Array.from(root.querySelectorAll("details.tokens[data-loaded=yes], details.request[data-loaded=yes]"),
      d => [d.id, d.querySelector(":scope > .slot").innerHTML]),
  };
});
document.addEventListener("htmx:afterSettle", () => {
  if (kept) {
    for (const [id, html] of kept.parts) {
      const el = document.getElementById(id);
      if (el) { el.querySelector(":scope > .slot").innerHTML = html; el.dataset.loaded = "yes"; }
    }
    for (const box of document.querySelectorAll("input[type=checkbox]")) {
      if (kept.checked.includes(`${box.name}=${box.value}`)) box.checked = true;
    }
    for (const [id, open] of kept.open) {
      const el = document.getElementById(id);
      if (el) el.open = open;
    }
    kept = null;
  }
  drawSparks(document);
  document.querySelectorAll("details.lazy[open]").forEach(openLazy);  // swapped in open
});

// The "live" badge says whether the page still hears from the dashboard.
function liveBadge(ok) {
  const badge = document.querySelector("nav .live");
  if (!badge) return;
  badge.textContent = ok ? "● live" : "● offline: the dashboard does not answer";
  badge.classList.toggle("offline", !ok);
}
document.addEventListener("htmx:sendError", () => liveBadge(false));
document.addEventListener("htmx:responseError", () => liveBadge(false));
document.addEventListener("htmx:afterRequest", e => { if (e.detail.successful) liveBadge(true); });
