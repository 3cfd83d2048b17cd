// The job page's text: the head with its facts, the current plan with the fitted models, the
// plan history and the straggler events. Each function renders one part from a JobState.

import { api } from "./api.js";
import { rankColour, rankName } from "./charts.js";
import { $, clear, el, fmtAgo, fmtMs, fmtNum, fmtTime, statusBadge } from "./dom.js";

const LIVE_TEXT = { connecting: "connecting…", live: "live", reconnecting: "reconnecting…", offline: "offline", ended: "finished" };

/** Show the live stream's state in the head's badge. */
export function setLive(mode) {
  const node = $("#live-state");
  if (!node) return;
  node.dataset.state = mode;
  node.textContent = LIVE_TEXT[mode];
}

let failureShown = false;

// A failed job: the reason, the failed ranks' root-cause tracebacks and every rank's log tail.
async function renderFailure(jobId) {
  if (failureShown) return;
  failureShown = true;
  const [job, ranks] = await Promise.all([api.job(jobId), api.logs(jobId).catch(() => [])]);
  $("#failure").hidden = false;
  $("#failure-reason").textContent = job.error || "failed";
  $("#failure-traceback").textContent = (job.workers || [])
    .filter((w) => w.state === "failed" && w.error)
    .map((w) => `rank ${w.rank}:\n${w.error}`)
    .join("\n\n");
  clear(
    $("#failure-logs"),
    ranks.map((r) =>
      el("details", { "data-rank": r.rank, open: r.state === "failed" },
        el("summary", {}, `rank ${r.rank} · ${r.state}${r.exit_code === null || r.exit_code === undefined ? "" : ` · exit ${r.exit_code}`}`),
        el("pre", { class: "log" }, r.log_tail || "(no log uploaded)"))),
  );
}

export function renderHead(state, liveMode) {
  const job = state.job;
  document.title = `${job.name} (job ${job.id}) · Evenflow`;
  $("#job-name").textContent = `${job.name}`;
  clear(
    $("#job-badges"),
    el("span", { class: "muted" }, `#${job.id}`),
    statusBadge(job.status),
    job.emulated ? el("span", { class: "badge emulated", title: "Timings are emulated, not measured on real GPUs" }, "emulated") : null,
    job.frozen ? el("span", { class: "badge frozen", title: "Automatic rebalancing is frozen by an operator" }, "rebalancing frozen") : null,
    el("span", { id: "live-state", class: "live", "data-state": liveMode }, LIVE_TEXT[liveMode]),
  );
  $("#emulated-note").hidden = !job.emulated;
  const waiting = job.status === "pending" && job.pending_reason;
  $("#pending-note").hidden = !waiting;
  $("#pending-note").textContent = waiting ? `Waiting for devices: ${job.pending_reason}.` : "";
  if (job.status === "failed") renderFailure(job.id);
  const spec = job.spec;
  const facts = [
    ["workers", fmtNum(state.world)],
    ["global batch", fmtNum(spec.global_batch)],
    ["engine", `${spec.engine ?? "ddp"} · gradients ${spec.gradient_sync ?? "auto"}`],
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
  renderSpeed(state);
}

export function renderSpeed(state) {
  const speed = state.speed();
  const node = $("#job-speed");
  if (node && speed !== null) node.textContent = `${fmtNum(speed)} samples/s`;
  const it = $("#job-iteration");
  if (it && state.newest >= 0) it.textContent = fmtNum(state.newest);
}

export function renderIdleSummary(state) {
  const share = state.idleShare();
  $("#idle-summary").textContent = share === null ? "" : `Now ${share.toFixed(0)}% of worker time is idle.`;
}

function modelFor(state, rank) {
  // A rank with no iteration reported yet has a row with no numbers: show it as unknown.
  const m = state.models?.find((x) => x.rank === rank) ?? null;
  return m && m.per_sample_ms !== null && m.per_sample_ms !== undefined ? m : null;
}

function modelCells(m, b) {
  const pred = m ? Math.max(m.floor_ms, m.intercept_ms + m.per_sample_ms * b) : null;
  return [
    el("td", { class: "num" }, m ? m.per_sample_ms.toFixed(3) : "—"),
    el("td", { class: "num" }, m ? fmtMs(m.intercept_ms) : "—"),
    el("td", { class: "num" }, m ? fmtMs(m.floor_ms) : "—"),
    el("td", { class: "num", title: m && !m.identifiable ? "not identifiable yet: needs two distinct batch sizes" : "" },
      m ? `${m.r2 === null || m.r2 === undefined ? "—" : m.r2.toFixed(2)}${m.identifiable ? "" : " *"}` : "—"),
    el("td", { class: "num" }, fmtMs(pred)),
  ];
}

function memoryCells(state, rank, b) {
  // The rank's memory cap (most samples per pass; a larger share accumulates over passes), the
  // predicted peak of its largest pass against its device's memory, and the fitted line.
  const m = state.models?.find((x) => x.rank === rank) ?? null;
  const unknown = (v) => v === null || v === undefined; // undefined: a server without memory fields
  if (!m || (unknown(m.memory_cap) && unknown(m.memory_base_mb))) {
    return [el("td", { class: "muted" }, "—"), el("td", { class: "muted" }, "—"), el("td", { class: "muted small", title: m?.memory_reason ?? "" }, "not measured")];
  }
  const passes = m.memory_cap ? Math.ceil(b / m.memory_cap) : 1;
  const capText = unknown(m.memory_cap) ? "—" : `${fmtNum(m.memory_cap)}${passes > 1 ? ` (${passes} passes)` : ""}`;
  const memText = unknown(m.predicted_memory_mb) ? "—"
    : `${fmtNum(Math.round(m.predicted_memory_mb))}${m.device_memory_mb ? ` / ${fmtNum(m.device_memory_mb)}` : ""} MB`;
  const fitText = unknown(m.memory_base_mb) || unknown(m.memory_per_sample_mb) ? "—"
    : `${fmtNum(Math.round(m.memory_base_mb))} + ${m.memory_per_sample_mb.toPrecision(3)}·b${m.memory_identifiable ? "" : " *"}`;
  const title = `${m.memory_reason ?? ""}${m.oom_batch ? `; a pass of ${m.oom_batch} ran out of memory` : ""}`;
  return [
    el("td", { class: "num", "data-memory-cap": rank }, capText),
    el("td", { class: "num" }, memText),
    el("td", { class: "num small", title }, fitText),
  ];
}

function deviceText(state, rank) {
  const w = state.job.workers.find((x) => x.rank === rank);
  const dev = w?.device_id ? state.hosts.get(w.device_id) : null;
  return dev ? `${dev.host.name} · ${dev.device.kind}:${dev.device.index} ${dev.device.model}` : "—";
}

export function renderPlan(state) {
  const plan = state.currentPlan();
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
  const rows = plan.batch_sizes.map((b, rank) => el("tr", {},
    el("td", {}, el("span", { class: "swatch", style: `background:${rankColour(rank, state.world)}` }), rankName(rank)),
    el("td", { class: "muted small" }, deviceText(state, rank)),
    el("td", { class: "num", "data-rank": rank }, fmtNum(b)),
    el("td", { class: "bar-cell" }, el("span", { class: "bar", style: `width:${(100 * b) / maxB}%` })),
    hasModels ? modelCells(modelFor(state, rank), b) : null,
    hasModels ? memoryCells(state, rank, b) : null,
  ));
  const total = plan.batch_sizes.reduce((a, b) => a + b, 0);
  clear(
    table,
    el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows),
    el("tfoot", {}, el("tr", {}, el("td", { colspan: 2 }, "total"), el("td", { class: "num" }, fmtNum(total)),
      el("td", { class: "muted small", colspan: head.length - 3 }, plan.predicted_ms ? `predicted iteration ${fmtMs(plan.predicted_ms)}` : ""))),
  );
  const note = $("#models-note");
  note.hidden = hasModels && !state.modelsError;
  note.classList.toggle("note-error", Boolean(state.modelsError));
  note.textContent = state.modelsError
    ? `Fitted performance models could not be loaded: ${state.modelsError}`
    : "No worker has a fitted performance model yet.";
}

const compactSizes = (sizes) =>
  sizes.length <= 8 ? sizes.join(" · ") : `${Math.min(...sizes)}–${Math.max(...sizes)} over ${sizes.length} workers`;

export function renderHistory(state) {
  const plans = [...state.plans.values()].sort((a, b) => b.version - a.version);
  const tookEffect = (p) => {
    const at = state.effects.get(p.version);
    if (at !== undefined) return el("td", { class: "num" }, `iteration ${fmtNum(at)}`);
    return el("td", { class: "muted" }, p.version === state.job.plan_version ? "pending" : "never");
  };
  clear(
    $("#plan-history"),
    el("thead", {}, el("tr", {}, ["v", "source", "reason", "batch sizes", "predicted", "took effect"].map((h) => el("th", {}, h)))),
    el("tbody", {}, plans.map((p) => el("tr", { "data-version": p.version },
      el("td", { class: "num" }, `v${p.version}`),
      el("td", {}, el("span", { class: `badge source-${p.source}` }, p.source)),
      el("td", { class: "reason" }, p.reason, el("div", { class: "muted small" }, `${p.created_by ?? "system"} · ${fmtTime(p.created_at)}`)),
      el("td", { class: "mono small", title: p.batch_sizes.join(" · ") }, compactSizes(p.batch_sizes)),
      el("td", { class: "num" }, fmtMs(p.predicted_ms)),
      tookEffect(p),
    ))),
  );
}

export function renderEvents(state) {
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
      el("td", {}, e.rank === null ? "job" : rankName(e.rank)),
      el("td", {}, e.kind),
      el("td", { class: "num" }, e.severity.toFixed(2)),
      el("td", {}, e.action),
    ))),
  );
}
