// The job page: loads a downsampled history, then follows the job's live stream.
// Points are queued as they arrive and drawn at most every MIN_FLUSH_MS inside an
// animation frame with Plotly.extendTraces, so the page never redraws per point.

import { api } from "./api.js";
import * as charts from "./charts.js";
import { $, banner, clear, el, fmtAgo, fmtMs, fmtNum, fmtTime, statusBadge } from "./dom.js";
import { OverridePanel } from "./overrides.js";

// Redraws are spaced by at least MIN_FLUSH_MS and by 2.5 times what the last ones cost, so
// drawing never takes more than ~40% of the main thread however many workers the job has.
const MIN_FLUSH_MS = 100;
const MAX_FLUSH_MS = 600;
const IDLE_EVERY_MS = 1000; // the idle bars average 20 iterations: once a second is plenty
const WINDOW = 20; // iterations averaged by the idle chart
const POINT_BUDGET = 24000; // points across all rank traces of one chart

const jobId = Number($("#main").dataset.jobId);
const divs = {
  time: $("#chart-iteration-time"),
  batch: $("#chart-batch-size"),
  idle: $("#chart-idle"),
};

const state = {
  job: null,
  world: 0,
  budget: 500,
  plans: new Map(), // version -> PlanOut
  effects: new Map(), // version -> first iteration that ran it
  events: [],
  models: null,
  hosts: new Map(), // device id -> {host, device}
  lastIteration: [], // per rank: newest iteration drawn (drops repeats)
  window: [], // per rank: recent {it, busy, idle, batch}
  rank0: [], // recent [iteration, ts] of rank 0, for the speed
  pending: new Map(), // iteration -> {count, max, version}: the measured iteration time
  newest: -1,
  highlight: null, // plan version issued from this page
  queue: null,
  markersDirty: false,
  idleDirty: false,
  scheduled: false,
  lastFlush: 0,
  flushCost: 0, // moving average of a redraw's duration (ms)
  lastIdle: 0,
  flushes: 0,
};

function emptyQueue(world) {
  const lanes = () => Array.from({ length: world }, () => ({ x: [], y: [] }));
  return {
    busy: lanes(),
    batch: lanes(),
    measured: { x: [], y: [] },
    predicted: { x: [], y: [] },
    events: { x: [], y: [], text: [] },
  };
}

// ---------------------------------------------------------------- loading

async function load() {
  const job = await api.job(jobId);
  state.job = job;
  state.world = job.workers.length || job.spec.workers || (job.spec.devices || []).length;
  state.budget = Math.max(150, Math.min(2000, Math.floor(POINT_BUDGET / Math.max(1, state.world))));
  state.queue = emptyQueue(state.world);
  state.lastIteration = Array(state.world).fill(-1);
  state.window = Array.from({ length: state.world }, () => []);
  renderHead();

  const [plans, events, series, hosts, models] = await Promise.all([
    api.plans(jobId),
    api.events(jobId),
    api.series(jobId, state.budget),
    api.hosts(),
    api.models(jobId).catch(() => null),
  ]);
  for (const p of plans) state.plans.set(p.version, p);
  for (const e of series.plan_effects) state.effects.set(e.version, e.iteration);
  state.events = events.slice().reverse();
  state.models = models;
  for (const h of hosts) for (const d of h.devices) state.hosts.set(d.id, { host: h, device: d });

  await drawHistory(series);
  renderPlan();
  renderHistory();
  renderEvents();
  panel.update();

  const maxVersion = Math.max(0, ...state.plans.keys());
  const maxEvent = Math.max(0, ...events.map((e) => e.id));
  openStream({ after: series.last_id, plan_version: maxVersion, event_after: maxEvent });
}

function predictedAt(iteration) {
  let version = null;
  let best = -Infinity;
  for (const [v, it] of state.effects) if (it <= iteration && it > best) [version, best] = [v, it];
  const ms = version === null ? null : state.plans.get(version)?.predicted_ms;
  return ms ?? null;
}

function eventY(iteration) {
  const m = divs.time.data?.[charts.iterationTraces(state.world).measured];
  if (m && m.x.length) {
    let y = m.y[m.y.length - 1];
    for (let i = m.x.length - 1; i >= 0; i -= 1) {
      if (m.x[i] <= iteration) {
        y = m.y[i];
        break;
      }
    }
    return y;
  }
  return 0;
}

function eventText(e) {
  const who = e.rank === null ? "job" : charts.rankName(e.rank);
  if (e.kind === "oom") return `OOM: ${who}, a pass of ${e.detail?.batch ?? "?"} ran out of memory; ${e.action}`;
  return `${e.kind}: ${who}, severity ${e.severity.toFixed(2)}, action ${e.action}`;
}

async function drawHistory(series) {
  const world = state.world;
  const busy = Array.from({ length: world }, () => ({ x: [], y: [] }));
  const batch = Array.from({ length: world }, () => ({ x: [], y: [] }));
  for (const r of series.ranks) {
    if (r.rank >= world) continue;
    busy[r.rank] = { x: r.iteration, y: r.iteration.map((_, i) => r.data_ms[i] + r.compute_ms[i]) };
    batch[r.rank] = { x: r.iteration, y: r.batch_size };
    state.lastIteration[r.rank] = r.iteration.length ? r.iteration[r.iteration.length - 1] : -1;
  }
  state.newest = series.last_iteration ?? -1;
  const measured = { x: series.measured.iteration, y: series.measured.iteration_ms };
  const predicted = { x: [], y: [] };
  measured.x.forEach((it) => {
    const p = predictedAt(it);
    if (p !== null) {
      predicted.x.push(it);
      predicted.y.push(p);
    }
  });
  for (const w of series.window) {
    if (w.rank < world) {
      state.window[w.rank] = [
        { it: series.last_iteration, busy: w.data_ms + w.compute_ms, idle: w.sync_ms, batch: w.batch_size },
      ];
    }
  }
  const markers = charts.planMarkers(effectList(), state.plans, { highlight: state.highlight });
  const timeFig = charts.iterationTimeFigure({
    world,
    busy,
    measured,
    predicted,
    events: { x: [], y: [], text: [] },
    markers,
  });
  timeFig.data[charts.iterationTraces(world).predicted].showlegend = predicted.x.length > 0;
  await Promise.all([
    Plotly.react(divs.time, timeFig.data, timeFig.layout, plotConfig()),
    Plotly.react(divs.batch, ...figureArgs(charts.batchSizeFigure({ world, batch, markers }))),
    Plotly.react(divs.idle, ...figureArgs(charts.idleFigure(idleData()))),
  ]);
  // Events go on the measured line once it is drawn.
  const ev = { x: [], y: [], text: [] };
  for (const e of state.events) {
    ev.x.push(e.start_iteration);
    ev.y.push(eventY(e.start_iteration));
    ev.text.push(eventText(e));
  }
  if (ev.x.length) {
    const idx = charts.iterationTraces(world).events;
    Plotly.extendTraces(divs.time, { x: [ev.x], y: [ev.y], text: [ev.text] }, [idx]);
  }
  $("#global-batch").textContent = `${fmtNum(state.job.spec.global_batch)} samples`;
}

const plotConfig = () => ({ responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"] });
const figureArgs = (fig) => [fig.data, fig.layout, plotConfig()];
const effectList = () => [...state.effects].map(([version, iteration]) => ({ version, iteration }));

function idleData() {
  const ranks = state.window.map((w, rank) => {
    const n = w.length || 1;
    return {
      rank,
      busy_ms: w.reduce((s, p) => s + p.busy, 0) / n,
      idle_ms: w.reduce((s, p) => s + p.idle, 0) / n,
    };
  });
  return { world: state.world, ranks, windowIterations: WINDOW, lastIteration: state.newest };
}

// ---------------------------------------------------------------- live

let source = null;

function openStream(cursor) {
  source = api.stream(jobId, cursor, {
    telemetry: onTelemetry,
    plan: onPlan,
    event: onEvent,
    job: onJob,
    end: () => {
      source.close();
      setLive("ended");
    },
  });
  source.onopen = () => setLive("live");
  source.onerror = () => setLive(source.readyState === EventSource.CLOSED ? "offline" : "reconnecting");
}

function setLive(mode) {
  const node = $("#live-state");
  if (!node) return;
  node.dataset.state = mode;
  node.textContent = { live: "live", reconnecting: "reconnecting…", offline: "offline", ended: "finished" }[mode];
}

function onTelemetry(msg) {
  const col = Object.fromEntries(msg.columns.map((c, i) => [c, i]));
  const q = state.queue;
  for (const row of msg.rows) {
    const rank = row[col.rank];
    const it = row[col.iteration];
    if (rank >= state.world || it <= state.lastIteration[rank]) continue;
    state.lastIteration[rank] = it;
    const version = row[col.plan_version];
    const busy = row[col.data_ms] + row[col.compute_ms];
    const idle = row[col.sync_ms];
    q.busy[rank].x.push(it);
    q.busy[rank].y.push(busy);
    q.batch[rank].x.push(it);
    q.batch[rank].y.push(row[col.batch_size]);
    const w = state.window[rank];
    w.push({ it, busy, idle, batch: row[col.batch_size] });
    if (w.length > WINDOW) w.splice(0, w.length - WINDOW);
    if (rank === 0) {
      state.rank0.push([it, row[col.ts]]);
      if (state.rank0.length > WINDOW + 1) state.rank0.shift();
    }
    const agg = state.pending.get(it) || { count: 0, max: 0, version };
    agg.count += 1;
    agg.max = Math.max(agg.max, busy + idle);
    state.pending.set(it, agg);
    const seen = state.effects.get(version);
    if (seen === undefined || it < seen) {
      state.effects.set(version, it);
      state.markersDirty = true;
      onEffect(version, it);
    }
    state.newest = Math.max(state.newest, it);
  }
  // An iteration's measured time is complete once every rank reported it (or it is old).
  for (const [it, agg] of [...state.pending].sort((a, b) => a[0] - b[0])) {
    if (agg.count < state.world && it > state.newest - 3) break;
    state.pending.delete(it);
    q.measured.x.push(it);
    q.measured.y.push(agg.max);
    const p = predictedAt(it);
    if (p !== null) {
      q.predicted.x.push(it);
      q.predicted.y.push(p);
    }
  }
  state.idleDirty = true;
  schedule();
}

function onPlan(plan) {
  state.plans.set(plan.version, plan);
  state.job.plan_version = Math.max(state.job.plan_version || 0, plan.version);
  renderPlan();
  renderHistory();
  renderHead();
  panel.update();
  // A new plan comes from new fits: show the models it was made from.
  api.models(jobId).then((models) => { state.models = models; renderPlan(); }).catch(() => {});
}

function onEvent(e) {
  state.events.push(e);
  state.queue.events.x.push(e.start_iteration);
  state.queue.events.y.push(eventY(e.start_iteration));
  state.queue.events.text.push(eventText(e));
  renderEvents();
  schedule();
}

function onJob(update) {
  Object.assign(state.job, update);
  renderHead();
  panel.update();
}

function onEffect(version, iteration) {
  renderHistory();
  panel.tookEffect(version, iteration);
}

function schedule() {
  if (state.scheduled) return;
  state.scheduled = true;
  const gap = Math.min(MAX_FLUSH_MS, Math.max(MIN_FLUSH_MS, 2.5 * state.flushCost));
  const wait = Math.max(0, gap - (performance.now() - state.lastFlush));
  const go = () => requestAnimationFrame(flush);
  if (wait > 0) setTimeout(go, wait);
  else go();
}

function extend(div, lanes, extra = []) {
  const idx = [];
  const xs = [];
  const ys = [];
  lanes.forEach((lane, i) => {
    if (lane.x.length) {
      idx.push(i);
      xs.push(lane.x);
      ys.push(lane.y);
    }
  });
  for (const [i, lane] of extra) {
    if (lane.x.length) {
      idx.push(i);
      xs.push(lane.x);
      ys.push(lane.y);
    }
  }
  if (idx.length) Plotly.extendTraces(div, { x: xs, y: ys }, idx);
}

function flush() {
  state.scheduled = false;
  const started = performance.now();
  state.lastFlush = started;
  const q = state.queue;
  state.queue = emptyQueue(state.world);
  const traces = charts.iterationTraces(state.world);
  extend(divs.time, q.busy, [
    [traces.measured, q.measured],
    [traces.predicted, q.predicted],
  ]);
  if (q.predicted.x.length && !divs.time.data[traces.predicted].showlegend) {
    Plotly.restyle(divs.time, { showlegend: true }, [traces.predicted]);
  }
  if (q.events.x.length) {
    Plotly.extendTraces(divs.time, { x: [q.events.x], y: [q.events.y], text: [q.events.text] }, [traces.events]);
  }
  extend(divs.batch, q.batch);
  if (state.markersDirty) {
    state.markersDirty = false;
    const m = charts.planMarkers(effectList(), state.plans, { highlight: state.highlight });
    Plotly.relayout(divs.time, m);
    Plotly.relayout(divs.batch, m);
  }
  if (state.idleDirty && started - state.lastIdle >= IDLE_EVERY_MS) {
    state.idleDirty = false;
    state.lastIdle = started;
    Plotly.react(divs.idle, ...figureArgs(charts.idleFigure(idleData())));
    renderIdleSummary();
  } else if (state.idleDirty) {
    schedule(); // draw the bars once their second is up, even if the stream goes quiet
  }
  state.flushes += 1;
  if (state.flushes % 20 === 0) compact();
  renderSpeed();
  state.flushCost = 0.7 * state.flushCost + 0.3 * (performance.now() - started);
  window.dispatchEvent(new CustomEvent("evenflow:drawn", { detail: { iteration: state.newest } }));
}

/** Keep each trace within its point budget by halving the resolution of old points. */
function compact() {
  for (const div of [divs.time, divs.batch]) {
    let changed = false;
    const data = div.data.map((trace, i) => {
      if (i >= state.world) return trace;
      const c = charts.compacted(trace.x, trace.y, state.budget);
      if (!c) return trace;
      changed = true;
      return { ...trace, x: c.x, y: c.y };
    });
    if (changed) Plotly.react(div, data, div.layout, plotConfig());
  }
}

// ---------------------------------------------------------------- panels

function renderHead() {
  const job = state.job;
  document.title = `${job.name} (job ${job.id}) · Evenflow`;
  $("#job-name").textContent = `${job.name}`;
  clear(
    $("#job-badges"),
    el("span", { class: "muted" }, `#${job.id}`),
    statusBadge(job.status),
    job.emulated ? el("span", { class: "badge emulated", title: "Timings are emulated, not measured on real GPUs" }, "emulated") : null,
    job.frozen ? el("span", { class: "badge frozen", title: "Automatic rebalancing is frozen by an operator" }, "rebalancing frozen") : null,
    el("span", { id: "live-state", class: "live", "data-state": source ? "live" : "connecting" }, source ? "live" : "connecting…"),
  );
  $("#emulated-note").hidden = !job.emulated;
  const spec = job.spec;
  const facts = [
    ["workers", fmtNum(state.world)],
    ["global batch", fmtNum(spec.global_batch)],
    ["policy", `${spec.policy?.name ?? "minmax"} · every ${spec.policy?.rebalance_every ?? "—"} it`],
    ["plan", job.plan_version ? `v${job.plan_version}` : "—"],
    ["length", spec.iterations ? `${fmtNum(spec.iterations)} iterations` : `${spec.epochs} epochs`],
    ["owner", job.owner],
    ["submitted", fmtAgo(job.created_at)],
  ];
  clear(
    $("#job-facts"),
    facts.map(([k, v]) => el("div", {}, el("dt", {}, k), el("dd", {}, v))),
    el("div", {}, el("dt", {}, "speed"), el("dd", { id: "job-speed" }, "—")),
    el("div", {}, el("dt", {}, "iteration"), el("dd", { id: "job-iteration" }, "—")),
  );
  renderSpeed();
}

function renderSpeed() {
  const r = state.rank0;
  const speed = $("#job-speed");
  if (speed && r.length > 1) {
    const [it0, ts0] = r[0];
    const [it1, ts1] = r[r.length - 1];
    if (ts1 > ts0) speed.textContent = `${fmtNum((state.job.spec.global_batch * (it1 - it0)) / (ts1 - ts0))} samples/s`;
  }
  const it = $("#job-iteration");
  if (it && state.newest >= 0) it.textContent = fmtNum(state.newest);
}

function renderIdleSummary() {
  const d = idleData().ranks;
  const busy = d.reduce((s, r) => s + r.busy_ms, 0);
  const idle = d.reduce((s, r) => s + r.idle_ms, 0);
  $("#idle-summary").textContent = busy + idle > 0 ? `Now ${((100 * idle) / (busy + idle)).toFixed(0)}% of worker time is idle.` : "";
}

function modelFor(rank) {
  // A rank with no iteration reported yet has a row with no numbers: show it as unknown.
  const m = state.models?.find((x) => x.rank === rank) ?? null;
  return m && m.per_sample_ms !== null && m.per_sample_ms !== undefined ? m : null;
}

function memoryCells(rank, b) {
  // The rank's memory cap (most samples per pass; a larger share accumulates over passes), the
  // predicted peak of its largest pass against its device's memory, and the fitted line.
  const m = state.models?.find((x) => x.rank === rank) ?? null;
  // `== null` also covers a server that predates the memory fields (undefined).
  if (!m || (m.memory_cap == null && m.memory_base_mb == null)) {
    return [el("td", { class: "muted" }, "—"), el("td", { class: "muted" }, "—"), el("td", { class: "muted small", title: m?.memory_reason ?? "" }, "not measured")];
  }
  const passes = m.memory_cap ? Math.ceil(b / m.memory_cap) : 1;
  const capText = m.memory_cap == null ? "—" : `${fmtNum(m.memory_cap)}${passes > 1 ? ` (${passes} passes)` : ""}`;
  const memText = m.predicted_memory_mb == null ? "—"
    : `${fmtNum(Math.round(m.predicted_memory_mb))}${m.device_memory_mb ? ` / ${fmtNum(m.device_memory_mb)}` : ""} MB`;
  const fitText = m.memory_base_mb == null || m.memory_per_sample_mb == null ? "—"
    : `${fmtNum(Math.round(m.memory_base_mb))} + ${m.memory_per_sample_mb.toPrecision(3)}·b${m.memory_identifiable ? "" : " *"}`;
  const title = `${m.memory_reason ?? ""}${m.oom_batch ? `; a pass of ${m.oom_batch} ran out of memory` : ""}`;
  return [
    el("td", { class: "num", "data-memory-cap": rank }, capText),
    el("td", { class: "num" }, memText),
    el("td", { class: "num small", title }, fitText),
  ];
}

function renderPlan() {
  const plan = state.plans.get(state.job.plan_version);
  const table = $("#plan-table");
  if (!plan) {
    clear(table, el("tr", {}, el("td", { class: "muted" }, "No plan yet: the job is waiting for devices.")));
    return;
  }
  $("#plan-version").textContent = `v${plan.version} · ${plan.source}`;
  $("#plan-reason").textContent = `${plan.reason}${plan.created_by ? ` — ${plan.created_by}` : ""}, ${fmtTime(plan.created_at)}`;
  const hasModels = Array.isArray(state.models) && state.models.length > 0;
  const maxB = Math.max(1, ...plan.batch_sizes);
  const head = ["worker", "device", "batch", ""];
  if (hasModels) head.push("ms / sample", "intercept", "floor", "r²", "predicted", "memory cap", "memory", "memory fit");
  const rows = plan.batch_sizes.map((b, rank) => {
    const w = state.job.workers.find((x) => x.rank === rank);
    const dev = w?.device_id ? state.hosts.get(w.device_id) : null;
    const devText = dev ? `${dev.host.name} · ${dev.device.kind}:${dev.device.index} ${dev.device.model}` : "—";
    const cells = [
      el("td", {}, el("span", { class: "swatch", style: `background:${charts.rankColour(rank, state.world)}` }), charts.rankName(rank)),
      el("td", { class: "muted small" }, devText),
      el("td", { class: "num", "data-rank": rank }, fmtNum(b)),
      el("td", { class: "bar-cell" }, el("span", { class: "bar", style: `width:${(100 * b) / maxB}%` })),
    ];
    if (hasModels) {
      const m = modelFor(rank);
      const pred = m ? Math.max(m.floor_ms, m.intercept_ms + m.per_sample_ms * b) : null;
      cells.push(
        el("td", { class: "num" }, m ? m.per_sample_ms.toFixed(3) : "—"),
        el("td", { class: "num" }, m ? fmtMs(m.intercept_ms) : "—"),
        el("td", { class: "num" }, m ? fmtMs(m.floor_ms) : "—"),
        el("td", { class: "num", title: m && !m.identifiable ? "not identifiable yet: needs two distinct batch sizes" : "" },
          m ? `${m.r2 === null || m.r2 === undefined ? "—" : m.r2.toFixed(2)}${m.identifiable ? "" : " *"}` : "—"),
        el("td", { class: "num" }, fmtMs(pred)),
        ...memoryCells(rank, b),
      );
    }
    return el("tr", {}, cells);
  });
  clear(
    table,
    el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows),
    el("tfoot", {}, el("tr", {}, el("td", { colspan: 2 }, "total"), el("td", { class: "num" }, fmtNum(plan.batch_sizes.reduce((a, b) => a + b, 0))), el("td", { class: "muted small", colspan: head.length - 3 }, plan.predicted_ms ? `predicted iteration ${fmtMs(plan.predicted_ms)}` : ""))),
  );
  const note = $("#models-note");
  note.hidden = hasModels;
  note.textContent = state.models === null
    ? "Fitted performance models are not available from this server (GET /jobs/{id}/models answered 404)."
    : "No worker has a fitted performance model yet.";
}

function renderHistory() {
  const table = $("#plan-history");
  const plans = [...state.plans.values()].sort((a, b) => b.version - a.version);
  const compact = (sizes) =>
    sizes.length <= 8 ? sizes.join(" · ") : `${Math.min(...sizes)}–${Math.max(...sizes)} over ${sizes.length} workers`;
  clear(
    table,
    el("thead", {}, el("tr", {}, ["v", "source", "reason", "batch sizes", "predicted", "took effect"].map((h) => el("th", {}, h)))),
    el("tbody", {}, plans.map((p) => {
      const at = state.effects.get(p.version);
      return el("tr", { "data-version": p.version },
        el("td", { class: "num" }, `v${p.version}`),
        el("td", {}, el("span", { class: `badge source-${p.source}` }, p.source)),
        el("td", { class: "reason" }, p.reason, el("div", { class: "muted small" }, `${p.created_by ?? "system"} · ${fmtTime(p.created_at)}`)),
        el("td", { class: "mono small", title: p.batch_sizes.join(" · ") }, compact(p.batch_sizes)),
        el("td", { class: "num" }, fmtMs(p.predicted_ms)),
        el("td", { class: at === undefined ? "muted" : "num" }, at === undefined ? (p.version === state.job.plan_version ? "pending" : "never") : `iteration ${fmtNum(at)}`),
      );
    })),
  );
}

function renderEvents() {
  const table = $("#event-table");
  if (!state.events.length) {
    clear(table, el("tbody", {}, el("tr", {}, el("td", { class: "muted" }, "No straggler events."))));
    return;
  }
  const rows = [...state.events].reverse().slice(0, 200);
  clear(
    table,
    el("thead", {}, el("tr", {}, ["iteration", "worker", "kind", "severity", "action"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((e) => el("tr", {},
      el("td", { class: "num" }, e.end_iteration ? `${fmtNum(e.start_iteration)}–${fmtNum(e.end_iteration)}` : fmtNum(e.start_iteration)),
      el("td", {}, e.rank === null ? "job" : charts.rankName(e.rank)),
      el("td", {}, e.kind),
      el("td", { class: "num" }, e.severity.toFixed(2)),
      el("td", {}, e.action),
    ))),
  );
}

// ---------------------------------------------------------------- overrides

const panel = new OverridePanel($("#override-panel"), {
  jobId,
  job: () => state.job,
  world: () => state.world,
  currentPlan: () => state.plans.get(state.job?.plan_version),
  /** The first iteration seen running plan `version`, if the stream delivered one already. */
  effectOf: (version) => state.effects.get(version),
  onApplied(out) {
    if (out.plan) {
      state.highlight = out.plan.version;
      onPlan(out.plan);
    }
    if (out.kind === "freeze" || out.kind === "unfreeze") onJob({ frozen: out.kind === "freeze" });
  },
});

load().catch((err) => {
  console.error(err);
  banner(err.status === 404 ? `Job ${jobId} not found.` : `Could not load the job: ${err.detail || err.message}`);
});

window.evenflow = { state, divs };
