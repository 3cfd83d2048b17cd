// The jobs page: the job list with each running job's speed, and the submit form.

import { api } from "./api.js";
import { $, $$, banner, canOperate, clear, el, fmtAgo, fmtNum, parseCount, statusBadge } from "./dom.js";

const REFRESH_MS = 5000;
const table = $("#jobs-table");
const form = $("#submit-form");
const filter = $("#status-filter");
const compareButton = $("#compare-selected");
const selected = new Set(); // job ids ticked for the compare page, kept across refreshes

async function refresh() {
  try {
    const { items, total } = await api.jobs({ status: filter.value || undefined });
    const live = items.filter((j) => ["running", "starting"].includes(j.status)).map((j) => j.id);
    const speeds = new Map((await api.throughput(live.slice(0, 100))).map((t) => [t.job_id, t]));
    render(items, total, speeds);
    banner("");
  } catch (err) {
    if (err.status !== undefined) banner(`Could not load jobs: ${err.detail}`);
    else throw err;
  }
}

function render(items, total, speeds) {
  const head = ["", "id", "name", "status", "workers", "global batch", "plan", "speed", "iteration", "owner", "submitted"];
  if (!items.length) {
    clear(table, el("tbody", {}, el("tr", {}, el("td", { class: "muted" }, "No jobs yet."))));
    return;
  }
  clear(
    table,
    el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
    el("tbody", {}, items.map((j) => {
      const t = speeds.get(j.id);
      return el("tr", { "data-job-id": j.id },
        el("td", {}, el("input", { type: "checkbox", class: "compare-pick", "aria-label": `compare job ${j.id}`,
          checked: selected.has(j.id), onchange: (e) => pick(j.id, e.target.checked) })),
        el("td", { class: "num" }, el("a", { href: `/jobs/${j.id}` }, `#${j.id}`)),
        el("td", {}, el("a", { href: `/jobs/${j.id}` }, j.name),
          j.emulated ? el("span", { class: "badge emulated", title: "emulated heterogeneity" }, "emulated") : null,
          j.frozen ? el("span", { class: "badge frozen" }, "frozen") : null),
        el("td", {}, statusBadge(j.status)),
        el("td", { class: "num" }, fmtNum(j.workers.length || j.spec.workers || (j.spec.devices || []).length)),
        el("td", { class: "num" }, fmtNum(j.spec.global_batch)),
        el("td", { class: "num" }, j.plan_version ? `v${j.plan_version}` : "—"),
        el("td", { class: "num speed" }, t?.samples_per_s ? `${fmtNum(t.samples_per_s)} samples/s` : "—"),
        el("td", { class: "num" }, t?.iteration !== null && t?.iteration !== undefined ? fmtNum(t.iteration) : "—"),
        el("td", {}, j.owner),
        el("td", { class: "muted small", title: j.created_at }, fmtAgo(j.created_at)));
    })),
    total > items.length ? el("tfoot", {}, el("tr", {}, el("td", { colspan: head.length, class: "muted small" }, `showing ${items.length} of ${total}`))) : null,
  );
}

function pick(id, on) {
  if (on) selected.add(id);
  else selected.delete(id);
  compareButton.disabled = selected.size < 2;
  compareButton.textContent = selected.size >= 2 ? `Compare ${selected.size} jobs` : "Compare selected";
}

compareButton.addEventListener("click", () => {
  location.assign(`/compare?jobs=${[...selected].sort((a, b) => a - b).join(",")}`);
});

// ---------------------------------------------------------------- submit form

function value(name) {
  return form.elements[name].value.trim();
}

function specFromForm() {
  const spec = { name: value("name"), workload: {}, policy: { name: value("policy.name") } };
  if (value("workload.builtin")) spec.workload.builtin = value("workload.builtin");
  else spec.workload.entrypoint = value("workload.entrypoint");
  for (const key of ["global_batch", "workers", "iterations", "epochs", "max_batch_per_worker", "priority"]) {
    if (value(key) !== "") spec[key] = parseCount(value(key));
  }
  if (value("policy.rebalance_every") !== "") spec.policy.rebalance_every = parseCount(value("policy.rebalance_every"));
  const emu = value("emulation");
  if (emu) {
    spec.emulation = emu.split(",").map((s) => {
      const t = s.trim();
      return { per_sample_ms: t !== "" && !Number.isNaN(Number(t)) ? Number(t) : t };
    });
  }
  return spec;
}

function clearErrors() {
  for (const n of $$(".field-error", form)) n.textContent = "";
  for (const n of $$(".invalid", form)) n.classList.remove("invalid");
  $("#submit-error").hidden = true;
}

/** Put each validation error beside the input whose field is the longest prefix of its path. */
function showErrors(err) {
  const problems = err.errors?.length
    ? err.errors.map((e) => ({ field: e.loc.filter((p, i) => !(i === 0 && p === "body")).join("."), msg: e.msg }))
    : [{ field: err.field || "", msg: err.detail }];
  const wrappers = $$("[data-field]", form);
  const general = [];
  for (const p of problems) {
    const match = wrappers
      .filter((w) => p.field === w.dataset.field || p.field.startsWith(`${w.dataset.field}.`))
      .sort((a, b) => b.dataset.field.length - a.dataset.field.length)[0];
    if (match) {
      match.hidden = false;
      match.classList.add("invalid");
      const slot = $(".field-error", match);
      slot.textContent = slot.textContent ? `${slot.textContent}; ${p.msg}` : p.msg;
    } else {
      general.push(p.field && p.field !== "body" ? `${p.field}: ${p.msg}` : p.msg);
    }
  }
  const box = $("#submit-error");
  box.textContent = general.length ? general.join(" · ") : "Not submitted: see the highlighted fields.";
  box.hidden = false;
}

form.elements["workload.builtin"].addEventListener("change", () => {
  const builtin = value("workload.builtin") !== "";
  $('[data-field="workload.entrypoint"]', form).hidden = builtin;
  $('[data-field="workload.context"]', form).hidden = builtin;
});

/** The chosen code archive uploaded (once per content: the server dedupes), its SHA-256. */
async function uploadedContext() {
  const file = form.elements["workload.context"].files?.[0];
  if (!file || value("workload.builtin") !== "") return null;
  try {
    return (await api.uploadContext(file)).sha256;
  } catch (err) {
    if (err.status !== undefined) err.field = "workload.context"; // shown beside the file input
    throw err;
  }
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  clearErrors();
  const result = $("#submit-result");
  result.textContent = "";
  const button = $("#submit-button");
  button.disabled = true;
  try {
    const spec = specFromForm();
    const context = await uploadedContext();
    if (context) spec.workload.context = context;
    const job = await api.submitJob(spec);
    result.replaceChildren("Submitted ", el("a", { href: `/jobs/${job.id}`, id: "submitted-link" }, `job #${job.id}`), ` (${job.status}).`);
    await refresh();
  } catch (err) {
    if (err.status === undefined) throw err;
    showErrors(err);
  } finally {
    button.disabled = false;
  }
});

if (!canOperate()) {
  for (const n of form.elements) n.disabled = true;
  $("#submit-card header p").textContent = `Submitting needs the operator role; you are signed in as ${document.body.dataset.role}.`;
}
filter.addEventListener("change", refresh);
refresh();
setInterval(refresh, REFRESH_MS);
