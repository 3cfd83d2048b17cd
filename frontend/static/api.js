// The one module that talks to the Evenflow API. Requests carry the session cookie
// (same origin); errors become ApiError with the server's detail, field and errors.

const BASE = "/api/v1";

export class ApiError extends Error {
  constructor(status, body) {
    super(body.detail);
    this.status = status;
    this.detail = body.detail;
    this.field = body?.field || null;
    this.errors = body?.errors || null;
  }
}

async function request(method, path, body) {
  const init = { method, credentials: "same-origin", headers: { Accept: "application/json" } };
  if (body instanceof Blob) {
    init.headers["Content-Type"] = "application/octet-stream";
    init.body = body; // a file's bytes as they are (a code archive)
  } else if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(BASE + path, init);
  if (response.status === 401) {
    // The session ended (token revoked, cookie expired): sign in again and come back here.
    window.location.assign(`/login?next=${encodeURIComponent(location.pathname + location.search)}`);
    throw new ApiError(401, errorBody(response, await response.text()));
  }
  const text = await response.text();
  if (!response.ok) throw new ApiError(response.status, errorBody(response, text));
  return text ? JSON.parse(text) : null;
}

/** The server's ErrorOut, or, from something in between (a proxy's HTML page, a plain-text
 * 502), what it said in one line: never a message made up here. */
function errorBody(response, text) {
  try {
    const body = JSON.parse(text);
    if (body && typeof body.detail === "string") return body;
  } catch {
    // not JSON: fall through to the text itself
  }
  const said = text.replace(/<[^>]*>/g, " ").replace(/\s+/g, " ").trim().slice(0, 200);
  return { detail: `HTTP ${response.status} ${response.statusText}${said ? `: ${said}` : ""}`.trim() };
}

const get = (path) => request("GET", path);
const post = (path, body) => request("POST", path, body);

/** Most items the server puts in one page of a list endpoint. */
const MAX_PAGE = 1000;

/** One page of a list endpoint: {items, total}. */
const page = (path, { limit = 100, offset = 0 } = {}) =>
  get(`${path}${path.includes("?") ? "&" : "?"}limit=${limit}&offset=${offset}`);

/** Every item of a list endpoint, read page by page. */
async function all(path) {
  const items = [];
  for (;;) {
    const { items: more, total } = await page(path, { limit: MAX_PAGE, offset: items.length });
    items.push(...more);
    if (!more.length || items.length >= total) return items;
  }
}

// List endpoints answer {items, total}: `jobs` and `audit` give the page, the others every item.
export const api = {
  hosts: () => all("/hosts"),
  jobs: ({ status, limit = 200, offset = 0 } = {}) =>
    page(`/jobs${status ? `?status=${encodeURIComponent(status)}` : ""}`, { limit, offset }),
  job: (id) => get(`/jobs/${id}`),
  submitJob: (spec) => post("/jobs", spec),
  uploadContext: (file) => post("/contexts", file),
  cancelJob: (id) => post(`/jobs/${id}/cancel`),
  plan: (id) => get(`/jobs/${id}/plan`),
  plans: (id) => all(`/jobs/${id}/plans`),
  events: (id) => all(`/jobs/${id}/events`),
  logs: (id) => all(`/jobs/${id}/logs`),
  overrides: (id) => all(`/jobs/${id}/overrides`),
  override: (id, body) => post(`/jobs/${id}/overrides`, body),
  series: (id, points) => get(`/jobs/${id}/series?points=${points}`),
  metrics: (id, points) => get(`/jobs/${id}/metrics?points=${points}`),
  throughput: (ids) => (ids.length ? get(`/dashboard/throughput?ids=${ids.join(",")}`) : []),
  audit: ({ target, limit = 100, offset = 0 } = {}) =>
    page(`/audit${target ? `?target=${encodeURIComponent(target)}` : ""}`, { limit, offset }),

  models: (id) => all(`/jobs/${id}/models`),

  /**
   * Open the job's live stream (server-sent events). `handlers` maps message kinds
   * (telemetry, plan, event, job, end) to functions of the parsed data. The browser
   * reconnects by itself and resumes from the last message id. Returns the EventSource.
   */
  stream(id, cursor, handlers) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(cursor)) if (v !== null && v !== undefined) q.set(k, v);
    const source = new EventSource(`${BASE}/jobs/${id}/stream?${q}`);
    for (const [kind, fn] of Object.entries(handlers)) {
      source.addEventListener(kind, (msg) => fn(JSON.parse(msg.data)));
    }
    return source;
  },
};
