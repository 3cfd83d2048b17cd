// The audit log page: who did what to which resource, and why; newest first.

import { api } from "./api.js";
import { $, banner, clear, el, fmtTime } from "./dom.js";

const PAGE = 50;
let offset = 0;
let target = new URLSearchParams(location.search).get("target") || "";
$("#audit-target").value = target;

function targetLink(t) {
  const m = /^job:(\d+)$/.exec(t);
  return m ? el("a", { href: `/jobs/${m[1]}` }, t) : t;
}

function detail(d) {
  const parts = Object.entries(d || {}).map(([k, v]) =>
    el("span", { class: "kv" }, el("span", { class: "k" }, k), " ", typeof v === "object" ? JSON.stringify(v) : String(v)));
  return parts.length ? parts : el("span", { class: "muted" }, "—");
}

async function load() {
  try {
    const { items: rows, total } = await api.audit({ target: target || undefined, limit: PAGE, offset });
    clear($("#audit-table"),
      el("thead", {}, el("tr", {}, ["when", "who", "action", "target", "detail"].map((h) => el("th", {}, h)))),
      el("tbody", {}, rows.length ? rows.map((a) => el("tr", { "data-action": a.action },
        el("td", { class: "small nowrap" }, fmtTime(a.at)),
        el("td", {}, a.actor),
        el("td", { class: "mono small" }, a.action),
        el("td", {}, targetLink(a.target)),
        el("td", { class: "detail small" }, detail(a.detail)))) : el("tr", {}, el("td", { class: "muted", colspan: 5 }, "Nothing recorded."))));
    $("#audit-newer").disabled = offset === 0;
    $("#audit-older").disabled = offset + rows.length >= total;
    $("#audit-count").textContent = rows.length ? `${offset + 1}–${offset + rows.length} of ${total}` : "";
    banner("");
  } catch (err) {
    if (err.status !== undefined) banner(`Could not load the audit log: ${err.detail}`);
    else throw err;
  }
}

$("#audit-filter").addEventListener("submit", (e) => {
  e.preventDefault();
  target = $("#audit-target").value.trim();
  offset = 0;
  history.replaceState(null, "", target ? `?target=${encodeURIComponent(target)}` : location.pathname);
  load();
});
$("#audit-older").addEventListener("click", () => { offset += PAGE; load(); });
$("#audit-newer").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); load(); });
load();
