// The job page: loads the job and its downsampled history into a JobState (job-state.js),
// draws it and follows the live stream (job-live.js), and renders its tables (job-tables.js).

import { api } from "./api.js";
import { $, banner, fmtNum } from "./dom.js";
import { LiveCharts } from "./job-live.js";
import { JobState } from "./job-state.js";
import { renderEvents, renderHead, renderHistory, renderIdleSummary, renderPlan, renderSpeed, setLive } from "./job-tables.js";
import { mountMetrics } from "./metrics.js";
import { OverridePanel } from "./overrides.js";

const jobId = Number($("#main").dataset.jobId);
const divs = {
  time: $("#chart-iteration-time"),
  batch: $("#chart-batch-size"),
  idle: $("#chart-idle"),
  heat: $("#chart-heatmap"),
};
const heatSelect = $("#heatmap-metric");
let state = null;
let live = null;

/** The fitted models, or the server's reason they could not be loaded. */
async function loadModels() {
  try {
    state.models = await api.models(jobId);
    state.modelsError = null;
  } catch (err) {
    if (err.status === undefined) throw err;
    state.modelsError = err.detail;
  }
}

async function load() {
  const job = await api.job(jobId);
  state = new JobState(job);
  live = new LiveCharts(state, divs, () => heatSelect.value);
  renderHead(state, "connecting");

  const [plans, events, series, hosts, [recent]] = await Promise.all([
    api.plans(jobId),
    api.events(jobId),
    api.series(jobId, state.budget),
    api.hosts(),
    api.throughput([jobId]),
    loadModels(),
  ]);
  state.recentSpeed = recent?.samples_per_s ?? null;
  state.setPlans(plans);
  state.setHosts(hosts);
  await live.drawHistory(state.loadHistory(series, events, performance.now()));
  $("#global-batch").textContent = `${fmtNum(state.job.spec.global_batch)} samples`;
  renderPlan(state);
  renderHistory(state);
  renderEvents(state);
  renderSpeed(state);
  renderIdleSummary(state);
  panel.update();

  const maxVersion = Math.max(0, ...state.plans.keys());
  const maxEvent = Math.max(0, ...events.map((e) => e.id));
  live.open(jobId, { after: series.last_id, plan_version: maxVersion, event_after: maxEvent }, {
    plan: onPlan,
    event: () => renderEvents(state),
    job: onJob,
    effect(version, iteration) {
      renderHistory(state);
      panel.tookEffect(version, iteration);
    },
  });
}

function onPlan(plan) {
  state.addPlan(plan);
  renderPlan(state);
  renderHistory(state);
  renderHead(state, $("#live-state")?.dataset.state ?? "live");
  panel.update();
  // A new plan comes from new fits: show the models it was made from.
  loadModels().then(() => renderPlan(state));
}

function onJob(update) {
  Object.assign(state.job, update);
  renderHead(state, $("#live-state")?.dataset.state ?? "live");
  panel.update();
}

const panel = new OverridePanel($("#override-panel"), {
  jobId,
  job: () => state?.job ?? null,
  world: () => state?.world ?? 0,
  currentPlan: () => state?.currentPlan(),
  /** The first iteration seen running plan `version`, if the stream delivered one already. */
  effectOf: (version) => state?.effects.get(version),
  onApplied(out) {
    if (out.plan) {
      state.highlight = out.plan.version;
      onPlan(out.plan);
    }
    if (out.kind === "freeze" || out.kind === "unfreeze") onJob({ frozen: out.kind === "freeze" });
  },
});

heatSelect.addEventListener("change", () => live?.drawHeatmap());

load().catch((err) => {
  if (err.status === undefined) console.error(err); // a bug here, not an answer from the API
  setLive("offline");
  // The server's own words (ErrorOut.detail), e.g. "job 7 not found"; never a guess.
  banner(`Could not load the job: ${err.detail ?? err.message}`);
});

const metrics = mountMetrics({ jobId, job: () => state?.job ?? null });
window.evenflow = { get state() { return state; }, divs, metrics };
