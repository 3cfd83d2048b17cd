// The cluster page: every host and its devices, their state and which job uses them.

import { api } from "./api.js";
import { $, banner, clear, el, fmtAgo, fmtNum, fmtTime, statusBadge } from "./dom.js";

const REFRESH_MS = 5000;

async function refresh() {
  try {
    const [hosts, jobs] = await Promise.all([api.hosts(), api.jobs({ limit: 1000 })]);
    const byId = new Map(jobs.items.map((j) => [j.id, j]));
    render(hosts, byId);
    banner("");
  } catch (err) {
    if (err.status !== undefined) banner(`Could not load the cluster: ${err.detail}`);
    else throw err;
  }
}

function usedBy(device, jobs) {
  if (device.job_id === null || device.job_id === undefined) return el("span", { class: "muted" }, "—");
  const job = jobs.get(device.job_id);
  const worker = job?.workers.find((w) => w.device_id === device.id);
  return el("span", {},
    el("a", { href: `/jobs/${device.job_id}` }, `#${device.job_id} ${job ? job.name : ""}`),
    worker ? el("span", { class: "muted" }, ` · rank ${worker.rank} (${worker.state})`) : null);
}

function render(hosts, jobs) {
  const devices = hosts.flatMap((h) => h.devices);
  const busy = devices.filter((d) => d.status === "busy").length;
  $("#cluster-summary").textContent =
    `${hosts.length} host${hosts.length === 1 ? "" : "s"} · ${devices.length} devices · ${busy} busy · ${devices.filter((d) => d.status === "free").length} free`;
  if (!hosts.length) {
    clear($("#hosts"), el("p", { class: "muted" }, "No host has registered yet. Start one with `evenflow agent --server …`."));
    return;
  }
  clear($("#hosts"), hosts.map((h) => el("article", { class: `host host-${h.status}`, "data-host": h.name },
    el("header", { class: "row-between" },
      el("h2", {}, h.name, " ", statusBadge(h.status)),
      el("span", { class: "muted small", title: fmtTime(h.last_heartbeat) },
        `${h.address} · protocol ${h.protocol_version} · last heartbeat ${fmtAgo(h.last_heartbeat)}`)),
    el("table", { class: "data" },
      el("thead", {}, el("tr", {}, ["device", "model", "memory", "status", "used by"].map((t) => el("th", {}, t)))),
      el("tbody", {}, h.devices.map((d) => el("tr", { "data-device": d.id },
        el("td", { class: "mono" }, `${d.kind}:${d.index}`),
        el("td", {}, d.model),
        el("td", { class: "num" }, `${fmtNum(d.memory_mb / 1024, 1)} GiB`),
        el("td", {}, statusBadge(d.status)),
        el("td", {}, usedBy(d, jobs)))))))));
}

refresh();
setInterval(refresh, REFRESH_MS);
