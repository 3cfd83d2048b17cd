// The compare page: two or more jobs side by side (`/compare?jobs=3,4`), e.g. the demo's
// equal and minmax runs. Each job's downsampled series (the same the job page loads) becomes
// throughput, iteration time and idle per bucket (compare-state.js); redrawn while any runs.

import { api } from "./api.js";
import { comparisonFigure, rankColour } from "./charts.js";
import { $, banner, clear, el, fmtMs, fmtNum, statusBadge } from "./dom.js";
import { compareSeries, parseJobIds, speedups } from "./compare-state.js";

const POINTS = 400;
const REFRESH_MS = 5000;
const LIVE = ["pending", "starting", "running"];
const plotConfig = { responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
const CHARTS = [
  ["#chart-compare-throughput", "throughput", "samples / s", "%{y:,.0f} samples/s"],
  ["#chart-compare-iteration-time", "iterationMs", "time per iteration (ms)", "%{y:.1f} ms"],
  ["#chart-compare-idle", "idlePct", "idle (% of worker time)", "%{y:.0f}% idle"],
];

const parsed = parseJobIds(location.search);
$("#compare-jobs").value = new URLSearchParams(location.search).get("jobs") ?? "";
let timer = null;

async function load(ids) {
  const jobs = await Promise.all(ids.map((id) => api.job(id)));
  const [all, speeds] = await Promise.all([
    Promise.all(ids.map((id) => api.series(id, POINTS))),
    api.throughput(ids),
  ]);
  const rows = jobs.map((job, i) => ({ job, ...compareSeries(job, all[i]) }));
  const recent = new Map(speeds.map((t) => [t.job_id, t]));
  renderTable(rows, recent);
  await Promise.all(CHARTS.map(([sel, key, yTitle, hover]) => {
    const fig = comparisonFigure({ jobs: rows.map((r) => ({ label: r.label, series: r[key] })), yTitle, hover });
    return Plotly.react($(sel), fig.data, fig.layout, plotConfig);
  }));
  banner("");
  return jobs.some((j) => LIVE.includes(j.status));
}

function renderTable(rows, recent) {
  const head = ["job", "policy", "status", "workers", "global batch", "iterations", "mean iteration",
    "throughput", "idle", "speed now", "vs first"];
  const ratio = speedups(rows);
  clear($("#compare-table"),
    el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((r, i) => {
      const j = r.job;
      const s = r.summary;
      const now = recent.get(j.id)?.samples_per_s;
      return el("tr", { "data-job-id": j.id },
        el("td", {}, el("span", { class: "swatch", style: `background:${rankColour(i, rows.length)}` }),
          el("a", { href: `/jobs/${j.id}` }, `#${j.id} ${j.name}`)),
        el("td", {}, j.spec.policy?.name ?? "minmax"),
        el("td", {}, statusBadge(j.status)),
        el("td", { class: "num" }, fmtNum(j.workers.length || j.spec.workers)),
        el("td", { class: "num" }, fmtNum(j.spec.global_batch)),
        el("td", { class: "num" }, fmtNum(s.iterations)),
        el("td", { class: "num" }, fmtMs(s.meanMs)),
        el("td", { class: "num", "data-col": "throughput" }, s.samplesPerS === null ? "—" : `${fmtNum(s.samplesPerS)} samples/s`),
        el("td", { class: "num", "data-col": "idle" }, s.idlePct === null ? "—" : `${s.idlePct.toFixed(0)}%`),
        el("td", { class: "num", title: "over rank 0's last 20 iterations, from the workers' clocks" }, now ? `${fmtNum(now)} samples/s` : "—"),
        el("td", { class: "num strong", "data-col": "speedup" }, ratio[i] === null ? "—" : `${ratio[i].toFixed(2)}×`));
    })));
}

async function refresh(ids) {
  clearTimeout(timer);
  try {
    if (await load(ids)) timer = setTimeout(() => refresh(ids), REFRESH_MS);
  } catch (err) {
    if (err.status === undefined) throw err;
    banner(`Could not compare: ${err.detail}`);
  }
}

$("#compare-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const jobs = $("#compare-jobs").value.replace(/\s+/g, "");
  location.assign(`/compare?jobs=${encodeURIComponent(jobs).replace(/%2C/g, ",")}`);
});

if (parsed.error) banner(parsed.error);
else refresh(parsed.ids);
