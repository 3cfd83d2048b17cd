// The manual override panel of the job page: every override is previewed (POST with
// preview: true) next to the current plan, then applied with the same body. Validation is
// the API's: its 422 names a field, and the message is shown beside that input.

import { api } from "./api.js";
import { $, $$, canOperate, clear, el, fmtMs, fmtNum, parseCount } from "./dom.js";
import { rankName } from "./charts.js";

const KINDS = {
  set_batches: {
    label: "Set batch sizes by hand",
    help: "Give every worker its local batch; they must add up to the global batch and respect the per-worker cap.",
  },
  pin: {
    label: "Pin one worker's batch",
    help: "Fix one worker's local batch; the planner solves the others around it.",
  },
  exclude: {
    label: "Exclude a worker from compute",
    help: "The worker gets 0 samples (it stays in the all-reduce); the others take its share.",
  },
  readmit: {
    label: "Readmit a worker",
    help: "Give an excluded or pinned worker samples again, or bring back into the all-reduce one the straggler ladder took out.",
  },
  freeze: {
    label: "Freeze automatic rebalancing",
    help: "The current plan stays in force until someone unfreezes or sets a plan by hand.",
  },
  unfreeze: { label: "Unfreeze automatic rebalancing", help: "The rebalancer may issue plans again." },
  rebalance_now: {
    label: "Rebalance now",
    help: "Refit every worker's model and issue the best plan now, without waiting for the cadence.",
  },
};
const NEEDS_RANK = new Set(["pin", "exclude", "readmit"]);

export class OverridePanel {
  constructor(root, ctx) {
    this.root = root;
    this.ctx = ctx;
    this.previewed = null; // JSON of the body last previewed successfully
    this.applied = null; // OverrideOut of the last override applied here
    this.pristine = true; // batch inputs still show the current plan
    this.build();
  }

  build() {
    const kindSelect = el("select", { name: "kind", id: "override-kind" },
      Object.entries(KINDS).map(([k, v]) => el("option", { value: k }, v.label)));
    this.form = el("form", { id: "override-form", novalidate: true, autocomplete: "off" },
      el("div", { class: "field", "data-field": "kind" },
        el("label", { for: "override-kind" }, "Action"), kindSelect, el("span", { class: "field-error" })),
      el("p", { class: "muted small", id: "override-help" }),
      el("div", { class: "field", "data-field": "batch_sizes", "data-for": "set_batches" },
        el("label", {}, "Local batch per worker ", el("span", { id: "batch-sum", class: "sum" })),
        el("div", { class: "batch-grid", id: "batch-grid" }),
        el("span", { class: "field-error" }),
        el("button", { type: "button", class: "link small", id: "batch-reset" }, "reset to the current plan")),
      el("div", { class: "row" },
        el("div", { class: "field", "data-field": "rank", "data-for": "pin exclude readmit" },
          el("label", { for: "override-rank" }, "Worker"),
          el("select", { name: "rank", id: "override-rank" }), el("span", { class: "field-error" })),
        el("div", { class: "field", "data-field": "batch_size", "data-for": "pin" },
          el("label", { for: "override-batch" }, "Pinned batch"),
          el("input", { name: "batch_size", id: "override-batch", inputmode: "numeric" }),
          el("span", { class: "field-error" }))),
      el("div", { class: "field", "data-field": "reason" },
        el("label", { for: "override-reason" }, "Reason ", el("span", { class: "muted small" }, "(required, goes to the audit log)")),
        el("input", { name: "reason", id: "override-reason", maxlength: 1000, placeholder: "e.g. rank 2 shares its node with a backup job" }),
        el("span", { class: "field-error" })),
      el("div", { class: "actions" },
        el("button", { type: "button", id: "override-preview", class: "secondary" }, "Preview"),
        el("button", { type: "button", id: "override-apply", class: "primary", disabled: true }, "Apply")),
    );
    this.status = el("p", { id: "override-status", class: "status", "data-state": "idle" });
    this.previewArea = el("div", { id: "override-preview-area" });
    clear(this.root, this.form, this.status, this.previewArea);

    kindSelect.addEventListener("change", () => this.showKind());
    this.form.addEventListener("input", (e) => {
      if (e.target.closest("#batch-grid")) this.pristine = false;
      this.invalidate();
    });
    this.form.addEventListener("change", () => this.invalidate());
    $("#override-preview", this.form).addEventListener("click", () => this.submit(true));
    $("#override-apply", this.form).addEventListener("click", () => this.submit(false));
    $("#batch-reset", this.form).addEventListener("click", () => {
      this.pristine = true;
      this.fillBatches();
      this.invalidate();
    });
    this.form.addEventListener("submit", (e) => e.preventDefault());
    this.showKind();
  }

  get kind() {
    return this.form.elements.kind.value;
  }

  showKind() {
    $("#override-help", this.form).textContent = KINDS[this.kind].help;
    for (const node of $$("[data-for]", this.form)) {
      node.hidden = !node.dataset.for.split(" ").includes(this.kind);
    }
    this.invalidate();
  }

  /** Called by the page when the job or its plan changes. */
  update() {
    const job = this.ctx.job();
    const world = this.ctx.world();
    if (!job) return;
    const rankSelect = this.form.elements.rank;
    if (rankSelect.options.length !== world) {
      clear(rankSelect, Array.from({ length: world }, (_, r) => el("option", { value: r }, rankName(r))));
    }
    const grid = $("#batch-grid", this.form);
    if (grid.children.length !== world) {
      clear(grid, Array.from({ length: world }, (_, r) =>
        el("label", { class: "batch-input" }, el("span", {}, `${r}`),
          el("input", { name: `batch_sizes.${r}`, inputmode: "numeric", "aria-label": `batch of ${rankName(r)}` }))));
      this.pristine = true;
    }
    if (this.pristine) this.fillBatches();
    this.updateSum();
    const terminal = ["succeeded", "failed", "cancelled"].includes(job.status);
    const reason = !canOperate()
      ? `Overrides need the operator role; you are signed in as ${document.body.dataset.role}.`
      : terminal ? `The job has ${job.status}; overrides apply to live jobs.` : null;
    for (const node of this.form.elements) node.disabled = Boolean(reason) || (node.id === "override-apply" && !this.canApply());
    if (reason) this.setStatus("disabled", reason);
    else if (this.status.dataset.state === "disabled") this.setStatus("idle", "");
  }

  fillBatches() {
    const plan = this.ctx.currentPlan();
    if (!plan) return;
    $$("#batch-grid input", this.form).forEach((input, r) => {
      input.value = plan.batch_sizes[r] ?? "";
    });
    this.updateSum();
  }

  updateSum() {
    const job = this.ctx.job();
    if (!job) return;
    const inputs = $$("#batch-grid input", this.form);
    const sum = inputs.reduce((s, i) => {
      const n = parseCount(i.value);
      return s + (Number.isInteger(n) ? n : 0);
    }, 0);
    const node = $("#batch-sum", this.form);
    node.textContent = `sum ${fmtNum(sum)} of ${fmtNum(job.spec.global_batch)}`;
    node.classList.toggle("bad", sum !== job.spec.global_batch);
  }

  body(preview) {
    const body = { kind: this.kind, reason: this.form.elements.reason.value.trim(), preview };
    if (this.kind === "set_batches") body.batch_sizes = $$("#batch-grid input", this.form).map((i) => parseCount(i.value));
    if (NEEDS_RANK.has(this.kind)) body.rank = Number(this.form.elements.rank.value);
    if (this.kind === "pin") body.batch_size = parseCount(this.form.elements.batch_size.value);
    return body;
  }

  canApply() {
    return this.previewed !== null && this.previewed === JSON.stringify(this.body(true));
  }

  invalidate() {
    this.updateSum();
    if (this.previewed !== null && !this.canApply()) {
      this.previewed = null;
      clear(this.previewArea);
      if (["previewed", "error"].includes(this.status.dataset.state)) this.setStatus("idle", "");
    }
    $("#override-apply", this.form).disabled = !this.canApply();
  }

  setStatus(state, text) {
    this.status.dataset.state = state;
    this.status.textContent = text;
  }

  clearErrors() {
    for (const node of $$(".field-error", this.form)) node.textContent = "";
    for (const node of $$(".invalid", this.form)) node.classList.remove("invalid");
  }

  showError(err) {
    const field = err.field || "";
    const wrappers = $$("[data-field]", this.form).filter((w) => !w.hidden);
    const match = wrappers
      .filter((w) => field === w.dataset.field || field.startsWith(`${w.dataset.field}.`))
      .sort((a, b) => b.dataset.field.length - a.dataset.field.length)[0];
    if (match) {
      $(".field-error", match).textContent = err.detail;
      match.classList.add("invalid");
      const idx = field.match(/^batch_sizes\.(\d+)/);
      if (idx) $(`input[name="batch_sizes.${idx[1]}"]`, this.form)?.classList.add("invalid");
    }
    this.setStatus("error", match ? "Not accepted: see the highlighted field." : `Not accepted: ${err.detail}`);
  }

  async submit(preview) {
    this.clearErrors();
    const body = this.body(preview);
    this.setStatus(preview ? "previewing" : "applying", preview ? "Computing the preview…" : "Applying…");
    $("#override-apply", this.form).disabled = true;
    try {
      const out = await api.override(this.ctx.jobId, body);
      if (preview) {
        this.previewed = JSON.stringify(this.body(true));
        this.renderPreview(out);
        this.setStatus("previewed", "Preview ready: check it against the current plan, then apply.");
      } else {
        this.applied = out;
        this.previewed = null;
        this.pristine = true;
        clear(this.previewArea);
        this.ctx.onApplied(out);
        this.setStatus("applied", out.plan
          ? `Plan v${out.plan.version} issued. Workers switch at their next iteration boundary; waiting for their telemetry…`
          : `${KINDS[out.kind].label}: done.`);
        this.form.elements.reason.value = "";
        // The stream may have delivered the new plan's first iteration before this answer.
        const seen = out.plan ? this.ctx.effectOf(out.plan.version) : undefined;
        if (seen !== undefined) this.tookEffect(out.plan.version, seen);
      }
    } catch (err) {
      if (err.status === undefined) throw err;
      this.showError(err);
    }
    $("#override-apply", this.form).disabled = !this.canApply();
  }

  renderPreview(out) {
    const current = this.ctx.currentPlan();
    if (!out.plan) {
      clear(this.previewArea, el("p", { class: "note" },
        `No plan change: ${KINDS[out.kind].label.toLowerCase()}. Plan v${current?.version ?? "—"} stays in force.`));
      return;
    }
    const rows = out.plan.batch_sizes.map((b, r) => {
      const was = current?.batch_sizes[r] ?? null;
      const delta = was === null ? null : b - was;
      return el("tr", { "data-rank": r },
        el("td", {}, rankName(r)),
        el("td", { class: "num" }, fmtNum(was)),
        el("td", { class: "num strong" }, fmtNum(b)),
        el("td", { class: `num delta ${delta > 0 ? "up" : delta < 0 ? "down" : ""}` }, delta ? (delta > 0 ? `+${delta}` : `${delta}`) : "·"));
    });
    clear(this.previewArea,
      el("h3", {}, `Preview: plan v${out.plan.version} against v${current?.version ?? "—"}`),
      el("div", { class: "table-wrap" }, el("table", { class: "data compact", id: "override-preview-table" },
        el("thead", {}, el("tr", {}, ["worker", "current", "preview", "change"].map((h) => el("th", {}, h)))),
        el("tbody", {}, rows))),
      el("p", { class: "muted small" },
        `Predicted iteration: ${fmtMs(out.current_predicted_ms)} now → ${fmtMs(out.plan.predicted_ms)} with this plan.`));
  }

  /** The page saw the first telemetry of plan `version` at `iteration`. */
  tookEffect(version, iteration) {
    if (this.applied?.plan?.version !== version) return;
    const issued = Date.parse(this.applied.plan.created_at);
    const after = Number.isNaN(issued) ? "" : ` (${((Date.now() - issued) / 1000).toFixed(1)} s after it was issued)`;
    this.setStatus("effective", `Plan v${version} took effect at iteration ${fmtNum(iteration)}${after}.`);
    this.status.dataset.iteration = iteration;
  }
}
