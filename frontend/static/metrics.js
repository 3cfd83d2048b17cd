// Training curves on the job page: the job's global loss (the runtime reports it from the
// plan's leader rank, exact over the global batch) and what user code logs with
// ctx.log(name, value), from GET /jobs/{id}/metrics (downsampled per metric and rank).
// The figures are pure functions of that response; mountMetrics draws them and refreshes
// them while the job runs.

import { api } from "./api.js";
import { baseLayout, rankColour, rankName } from "./charts.js";
import { $, clear, el, fmtNum } from "./dom.js";

export const LOSS = "loss";
// Refreshes are 2 s apart, or 5 times what the last one took (a long history costs the server
// a scan per read), at most 10 s.
const REFRESH_MS = 2000;
const MAX_REFRESH_MS = 10000;
const POINTS = 1000;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const LINE = "#111827";
const plotConfig = () => ({ responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"] });

/** The loss as one trace, whichever rank led when (a plan that excludes rank 0 moves it). */
export function lossPoints(metrics) {
  const pts = [];
  for (const s of metrics.series) {
    if (s.name === LOSS) s.iteration.forEach((it, i) => pts.push([it, s.value[i]]));
  }
  pts.sort((a, b) => a[0] - b[0]);
  return { x: pts.map((p) => p[0]), y: pts.map((p) => p[1]) };
}

/** The newest loss reported: {iteration, value}, or null. */
export function latestLoss(metrics) {
  let best = null;
  for (const s of metrics.series) {
    if (s.name === LOSS && (!best || s.last_iteration > best.iteration)) {
      best = { iteration: s.last_iteration, value: s.last_value };
    }
  }
  return best;
}

/** Axis buttons: a loss curve often reads better on a log scale. */
function scaleButtons() {
  return [{
    type: "buttons",
    direction: "right",
    x: 1,
    xanchor: "right",
    y: 1.02,
    yanchor: "bottom",
    showactive: true,
    pad: { r: 0, t: 0 },
    font: { size: 11 },
    buttons: [
      { label: "linear", method: "relayout", args: [{ "yaxis.type": "linear" }] },
      { label: "log", method: "relayout", args: [{ "yaxis.type": "log" }] },
    ],
  }];
}

/** The global mean loss per iteration (each point the mean of its bucket). */
export function lossFigure(metrics) {
  const { x, y } = lossPoints(metrics);
  const bucket = metrics.bucket > 1 ? ` (mean of ${metrics.bucket} iterations per point)` : "";
  const trace = {
    type: "scatter",
    mode: x.length > 60 ? "lines" : "lines+markers",
    name: "global loss",
    x,
    y,
    line: { color: LINE, width: 2 },
    marker: { size: 4, color: LINE },
    hovertemplate: `iteration %{x}: loss %{y:.5g}${bucket}<extra></extra>`,
  };
  const layout = baseLayout("loss (mean over the global batch)", 1);
  layout.showlegend = false;
  layout.hovermode = "closest";
  layout.yaxis.rangemode = "normal";
  layout.updatemenus = scaleButtons();
  return { data: [trace], layout };
}

/** One figure per user metric, a trace per rank that reported it. */
export function metricFigures(metrics, world) {
  const byName = new Map();
  for (const s of metrics.series) {
    if (s.name === LOSS) continue;
    if (!byName.has(s.name)) byName.set(s.name, []);
    byName.get(s.name).push(s);
  }
  return [...byName].map(([name, series]) => {
    const data = series.map((s) => ({
      type: "scatter",
      mode: s.iteration.length > 60 ? "lines" : "lines+markers",
      name: rankName(s.rank),
      x: s.iteration,
      y: s.value,
      line: { color: rankColour(s.rank, Math.max(world, s.rank + 1)), width: 1.6 },
      marker: { size: 4 },
      hovertemplate: `${rankName(s.rank)}: %{y:.5g}<extra></extra>`,
    }));
    const layout = baseLayout("", series.length); // the caption above names it
    layout.yaxis.rangemode = "normal";
    layout.yaxis.title = null;
    layout.xaxis.title = { text: "iteration", standoff: 4 };
    layout.showlegend = series.length > 1;
    layout.margin = { l: 48, r: 12, t: series.length > 1 ? 28 : 12, b: 40 };
    return { name, data, layout };
  });
}

/**
 * Draw the job's training curves into the page's `data-chart="loss"` and `data-chart="metrics"`
 * containers, then refresh them every REFRESH_MS while the job is not finished (and once
 * after). `job()` returns the page's JobOut (or null while loading).
 */
export function mountMetrics({ jobId, job, root = document }) {
  const lossDiv = $('[data-chart="loss"]', root);
  const grid = $('[data-chart="metrics"]', root);
  const latest = $("#loss-latest", root);
  if (!lossDiv || !grid) return null;
  const divs = new Map(); // metric name -> its chart div
  let stopped = false;
  let timer = null;

  async function refresh() {
    const metrics = await api.metrics(jobId, POINTS);
    const loss = lossFigure(metrics);
    const has = loss.data[0].x.length > 0;
    lossDiv.dataset.points = String(loss.data[0].x.length);
    lossDiv.classList.toggle("empty", !has);
    if (has) await Plotly.react(lossDiv, loss.data, loss.layout, plotConfig());
    else lossDiv.dataset.empty = "No loss reported yet: the runtime reports it from the first iteration.";
    const last = latestLoss(metrics);
    if (latest) latest.textContent = last ? `Latest ${last.value.toPrecision(5)} at iteration ${fmtNum(last.iteration)}.` : "";
    const world = job()?.workers?.length || 1;
    const figures = metricFigures(metrics, world);
    if (!figures.length) {
      divs.clear();
      clear(grid, el("p", { class: "muted small metrics-empty" },
        "No metrics logged. In your training loop, ", el("code", {}, "ctx.log(\"accuracy\", acc)"),
        " reports one for this rank at the current iteration."));
      return;
    }
    if (figures.some((f) => !divs.has(f.name)) || divs.size !== figures.length) {
      divs.clear();
      clear(grid, figures.map((f) => {
        const div = el("div", { class: "chart chart-small", "data-metric": f.name });
        divs.set(f.name, div);
        return el("figure", { class: "metric" }, el("figcaption", {}, f.name), div);
      }));
    }
    await Promise.all(figures.map((f) => Plotly.react(divs.get(f.name), f.data, f.layout, plotConfig())));
  }

  async function tick() {
    timer = null;
    const finished = TERMINAL.has(job()?.status);
    const started = performance.now();
    try {
      await refresh();
    } catch (err) {
      console.warn("metrics refresh failed", err);
    }
    const wait = Math.min(MAX_REFRESH_MS, Math.max(REFRESH_MS, 5 * (performance.now() - started)));
    if (!finished && !stopped) timer = setTimeout(tick, wait);
    window.dispatchEvent(new CustomEvent("evenflow:metrics", { detail: { finished } }));
  }

  tick();
  return {
    refresh: tick,
    stop() {
      stopped = true;
      if (timer) clearTimeout(timer);
    },
  };
}
