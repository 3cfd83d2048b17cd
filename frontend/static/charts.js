// The job page's charts. Each is a function from plain data to a Plotly figure
// ({data, layout}); the page draws it with Plotly.react and appends live points with
// Plotly.extendTraces, using the trace indices exported here.

const TABLEAU = [
  "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
  "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#8a8a8a",
];
const SOURCE_COLOURS = { initial: "#94a3b8", automatic: "#2563eb", manual: "#9333ea" };
const FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", sans-serif';
export const MAX_LEGEND_RANKS = 12;

export const rankName = (rank) => `rank ${rank}`;

/** A colour per rank: Tableau 10 for small jobs, evenly spread hues for large ones. */
export function rankColour(rank, world) {
  if (world <= TABLEAU.length) return TABLEAU[rank % TABLEAU.length];
  const hue = Math.round((rank * 137.508) % 360);
  return `hsl(${hue}, 55%, ${rank % 2 ? 42 : 52}%)`;
}

/** Trace order of the iteration-time chart: one per rank, then the extras. */
export const iterationTraces = (world) => ({
  measured: world,
  predicted: world + 1,
  events: world + 2,
});

export function baseLayout(yTitle, world) {
  return {
    margin: { l: 64, r: 16, t: 28, b: 44 },
    font: { family: FONT, size: 12, color: "#1f2937" },
    paper_bgcolor: "#ffffff",
    plot_bgcolor: "#ffffff",
    hovermode: world > MAX_LEGEND_RANKS ? "closest" : "x unified",
    hoverlabel: { font: { family: FONT } },
    xaxis: {
      title: { text: "iteration", standoff: 8 },
      gridcolor: "#eef0f4",
      zeroline: false,
      showline: true,
      linecolor: "#cbd5e1",
    },
    yaxis: {
      title: { text: yTitle, standoff: 6 },
      gridcolor: "#eef0f4",
      zeroline: false,
      rangemode: "tozero",
      showline: true,
      linecolor: "#cbd5e1",
    },
    legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom", font: { size: 11 } },
    showlegend: true,
    uirevision: "keep",
  };
}

const LABEL_ROWS = [0.99, 0.92, 0.85]; // paper y of each row of plan labels
const LABEL_CHAR_PX = 6.6; // about one character of the 11 px label font
const PLOT_MARGIN_PX = 80; // the layout's left and right margins

/**
 * Rows for labels that start at `xs` (iterations) and are `widths` iterations wide: each
 * label, newest first, takes the first row where it overlaps no label placed before; a label
 * with no free row gets null (hidden: its line stays, and the plan history lists it).
 */
export function labelRows(xs, widths, rows = LABEL_ROWS.length) {
  const placed = Array.from({ length: rows }, () => []);
  const out = Array(xs.length).fill(null);
  for (let i = xs.length - 1; i >= 0; i -= 1) {
    const lo = xs[i];
    const hi = xs[i] + widths[i];
    const row = placed.findIndex((spans) => spans.every(([a, b]) => hi <= a || lo >= b));
    if (row < 0) continue;
    placed[row].push([lo, hi]);
    out[i] = row;
  }
  return out;
}

/**
 * Vertical markers where each plan version took effect (its first iteration in telemetry),
 * labelled with the version and where it came from. `highlight` is a version to emphasise
 * (an override applied from this page). Labels that would overlap at this zoom (`span`
 * iterations across `widthPx` pixels) are staggered over three rows, and hidden past that.
 */
export function planMarkers(effects, plansByVersion, { highlight = null, labels = 8, span = 0, widthPx = 800 } = {}) {
  const shapes = [];
  const candidates = [];
  const sorted = [...effects].sort((a, b) => a.version - b.version);
  const perPx = span > 0 ? span / Math.max(100, widthPx - PLOT_MARGIN_PX) : 0;
  sorted.forEach((effect, i) => {
    if (i === 0 && effect.version === 1) return; // the initial plan: nothing changed
    const plan = plansByVersion.get(effect.version);
    const source = plan?.source || "automatic";
    const strong = effect.version === highlight;
    const colour = SOURCE_COLOURS[source] || "#64748b";
    shapes.push({
      type: "line",
      name: `plan-v${effect.version}`,
      xref: "x",
      yref: "paper",
      x0: effect.iteration,
      x1: effect.iteration,
      y0: 0,
      y1: 1,
      line: { color: colour, width: strong ? 2.5 : 1.2, dash: strong ? "solid" : "dash" },
    });
    if (i >= sorted.length - labels) {
      const text = strong ? `v${effect.version} override took effect` : `v${effect.version} ${source}`;
      candidates.push({ effect, text, colour });
    }
  });
  candidates.sort((a, b) => a.effect.iteration - b.effect.iteration || a.effect.version - b.effect.version);
  const rows = labelRows(
    candidates.map((c) => c.effect.iteration),
    candidates.map((c) => (c.text.length * LABEL_CHAR_PX + 10) * perPx),
  );
  const annotations = [];
  candidates.forEach((c, i) => {
    if (rows[i] === null) return;
    annotations.push({
      name: `plan-v${c.effect.version}`,
      x: c.effect.iteration,
      xref: "x",
      y: LABEL_ROWS[rows[i]],
      yref: "paper",
      yanchor: "top",
      xanchor: "left",
      xshift: 3,
      showarrow: false,
      text: c.text,
      font: { size: 11, color: c.colour },
      bgcolor: "rgba(255,255,255,0.85)",
    });
  });
  return { shapes, annotations };
}

/**
 * Per-rank time to reach the all-reduce (data + compute), the measured iteration time (the
 * slowest rank, all-reduce included), the plan's predicted time, and straggler events.
 * data: {world, busy: [{x, y}] per rank, measured: {x, y}, predicted: {x, y},
 *        events: {x, y, text}, markers: {shapes, annotations}}
 */
export function iterationTimeFigure(data) {
  const { world } = data;
  const traces = data.busy.map((s, rank) => ({
    type: "scatter",
    mode: "lines",
    name: rankName(rank),
    x: s.x,
    y: s.y,
    line: { color: rankColour(rank, world), width: 1.4 },
    showlegend: world <= MAX_LEGEND_RANKS,
    hovertemplate: `${rankName(rank)}: %{y:.1f} ms<extra></extra>`,
  }));
  traces.push({
    type: "scatter",
    mode: "lines",
    name: "measured iteration",
    x: data.measured.x,
    y: data.measured.y,
    line: { color: "#111827", width: 2.4 },
    hovertemplate: "measured: %{y:.1f} ms<extra></extra>",
  });
  traces.push({
    type: "scatter",
    mode: "lines",
    name: "predicted by plan",
    x: data.predicted.x,
    y: data.predicted.y,
    line: { color: "#111827", width: 1.6, dash: "dot", shape: "hv" },
    hovertemplate: "predicted: %{y:.1f} ms<extra></extra>",
  });
  traces.push({
    type: "scatter",
    mode: "markers",
    name: "straggler event",
    x: data.events.x,
    y: data.events.y,
    text: data.events.text,
    marker: { symbol: "triangle-down", size: 12, color: "#dc2626", line: { color: "#7f1d1d", width: 1 } },
    hovertemplate: "%{text}<extra></extra>",
  });
  const layout = baseLayout("time per iteration (ms)", world);
  Object.assign(layout, data.markers);
  return { data: traces, layout };
}

/** Local batch size of every rank over time, as steps; plan changes marked. */
export function batchSizeFigure(data) {
  const { world } = data;
  const traces = data.batch.map((s, rank) => ({
    type: "scatter",
    mode: "lines",
    name: rankName(rank),
    x: s.x,
    y: s.y,
    line: { color: rankColour(rank, world), width: 1.8, shape: "hv" },
    showlegend: world <= MAX_LEGEND_RANKS,
    hovertemplate: `${rankName(rank)}: %{y} samples<extra></extra>`,
  }));
  const layout = baseLayout("local batch size (samples)", world);
  Object.assign(layout, data.markers);
  return { data: traces, layout };
}

/**
 * Compute against idle waiting per rank, stacked: idle is the time a rank waits in the
 * all-reduce for the slowest one. data: {world, ranks: [{rank, busy_ms, idle_ms}],
 * windowIterations, lastIteration}
 */
export function idleFigure(data) {
  // Many workers: plain rank numbers on a numeric axis, so the labels never collide.
  const many = data.ranks.length > 16;
  const xs = data.ranks.map((r) => (many ? r.rank : rankName(r.rank)));
  const share = data.ranks.map((r) => {
    const total = r.busy_ms + r.idle_ms;
    return total > 0 ? (100 * r.idle_ms) / total : 0;
  });
  const who = many ? "rank %{x}" : "%{x}";
  const traces = [
    {
      type: "bar",
      name: "compute (incl. data loading)",
      x: xs,
      y: data.ranks.map((r) => r.busy_ms),
      marker: { color: "#3b82f6" },
      hovertemplate: `${who}: compute %{y:.1f} ms<extra></extra>`,
    },
    {
      type: "bar",
      name: "idle: waiting at all-reduce",
      x: xs,
      y: data.ranks.map((r) => r.idle_ms),
      customdata: share,
      marker: { color: "#f59e0b" },
      hovertemplate: `${who}: idle %{y:.1f} ms (%{customdata:.0f}%)<extra></extra>`,
    },
  ];
  const layout = baseLayout(`ms per iteration (mean of last ${data.windowIterations})`, 0);
  layout.barmode = "stack";
  layout.bargap = many ? 0.08 : 0.35;
  layout.hovermode = "closest";
  layout.xaxis = many
    ? { ...layout.xaxis, title: { text: "worker (rank)", standoff: 8 }, type: "linear", gridcolor: "rgba(0,0,0,0)" }
    : { ...layout.xaxis, title: { text: "worker", standoff: 8 }, type: "category" };
  layout.meta = { lastIteration: data.lastIteration, windowIterations: data.windowIterations };
  return { data: traces, layout };
}

// From 0 ms (pale but not white: white is "no report") to the grid's largest value.
const HEAT_SCALES = {
  busy: [[0, "#fef9c3"], [0.4, "#fcd34d"], [0.7, "#f97316"], [1, "#991b1b"]],
  idle: [[0, "#eff6ff"], [0.5, "#60a5fa"], [1, "#1e3a8a"]],
};

/**
 * Per-rank heatmap over iterations: rank r is row r (rank 0 on top), each column a bucket of
 * iterations, the colour its mean `metric` ("busy": data + compute, "idle": waiting at the
 * all-reduce) in ms. A straggler is one hot row in "busy" and a pale row among dark ones in
 * "idle" (everyone else waits for it). data: {x, y, z, bucket, metric, world}
 */
export function heatmapFigure(data) {
  const busy = data.metric === "busy";
  const what = busy ? "compute" : "idle";
  const span = data.bucket > 1 ? ` (mean of ${data.bucket})` : "";
  const trace = {
    type: "heatmap",
    name: what,
    x: data.x,
    y: data.y,
    z: data.z,
    zmin: 0,
    zmax: data.z.reduce((m, row) => row.reduce((a, v) => (v === null ? a : Math.max(a, v)), m), 1e-9),
    colorscale: HEAT_SCALES[busy ? "busy" : "idle"],
    hoverongaps: false,
    xgap: 0,
    ygap: data.world <= 32 ? 1 : 0,
    colorbar: { title: { text: "ms", side: "right" }, thickness: 12, len: 0.9 },
    hovertemplate: `rank %{y}, iteration %{x}${span}: ${what} %{z:.1f} ms<extra></extra>`,
  };
  const layout = baseLayout(busy ? "compute per iteration" : "idle per iteration", 0);
  layout.hovermode = "closest";
  layout.showlegend = false;
  layout.margin = { ...layout.margin, r: 8 };
  layout.yaxis = {
    ...layout.yaxis,
    title: { text: "worker (rank)", standoff: 6 },
    autorange: "reversed",
    rangemode: undefined,
    showgrid: false,
    dtick: data.world <= 16 ? 1 : undefined,
  };
  layout.xaxis = { ...layout.xaxis, showgrid: false };
  layout.meta = { metric: data.metric, bucket: data.bucket };
  return { data: [trace], layout };
}

/**
 * One line per job over iterations, for the compare page. data: {jobs: [{label, series: {x, y}}],
 * yTitle, hover (a d3 format with its unit, e.g. "%{y:.0f} samples/s")}
 */
export function comparisonFigure(data) {
  const n = data.jobs.length;
  const traces = data.jobs.map((j, i) => ({
    type: "scatter",
    mode: "lines",
    name: j.label,
    x: j.series.x,
    y: j.series.y,
    line: { color: rankColour(i, n), width: 2 },
    hovertemplate: `${j.label}: ${data.hover}<extra></extra>`,
  }));
  const layout = baseLayout(data.yTitle, n);
  layout.hovermode = "x unified";
  return { data: traces, layout };
}

/**
 * Halve the resolution of the older half of a trace once it holds more than twice `budget`
 * points, so a long-running page keeps its whole history at a bounded cost per redraw.
 * Returns null when nothing needs doing.
 */
export function compacted(x, y, budget) {
  if (x.length <= 2 * budget) return null;
  const cut = x.length - budget;
  const nx = [];
  const ny = [];
  for (let i = 0; i + 1 < cut; i += 2) {
    nx.push(x[i]);
    ny.push(y[i] === null || y[i + 1] === null ? y[i] : (y[i] + y[i + 1]) / 2);
  }
  if (cut % 2) {
    nx.push(x[cut - 1]);
    ny.push(y[cut - 1]);
  }
  return { x: nx.concat(Array.from(x).slice(cut)), y: ny.concat(Array.from(y).slice(cut)) };
}
