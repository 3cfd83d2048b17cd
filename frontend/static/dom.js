// Small DOM and formatting helpers shared by the pages.

/** el("td", {class: "num"}, "12") — attributes starting with "on" become listeners. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function clear(node, ...children) {
  node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined));
  return node;
}

export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => [...root.querySelectorAll(sel)];

export function statusBadge(status) {
  return el("span", { class: `badge status-${status}` }, status);
}

/**
 * A form's count (a batch size, a number of workers) as the API should see it: a number when it
 * is one, else the text as typed, so that the API's 422 names the field and says why (a
 * decimal stays a number: the API answers that it must be an integer).
 */
export function parseCount(raw) {
  const text = String(raw ?? "").trim();
  return /^-?(\d+|\d*\.\d+)$/.test(text) ? Number(text) : text;
}

export function fmtMs(ms, digits = 1) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "—";
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${ms.toFixed(digits)} ms`;
}

export function fmtNum(x, digits = 0) {
  if (x === null || x === undefined || Number.isNaN(x)) return "—";
  return x.toLocaleString("en", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

export function fmtAgo(iso, now = Date.now()) {
  if (!iso) return "—";
  const s = Math.max(0, (now - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

export function fmtTime(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  return d.toLocaleString("en-GB", { dateStyle: "medium", timeStyle: "medium" });
}

export const role = () => document.body.dataset.role;
export const canOperate = () => ["operator", "admin"].includes(role());

/** Show an error message in a page-level banner. */
export function banner(message, kind = "error") {
  let node = $("#banner");
  if (!node) {
    node = el("div", { id: "banner", role: "alert" });
    $("#main").prepend(node);
  }
  node.className = `banner banner-${kind}`;
  node.textContent = message;
  node.hidden = !message;
}
