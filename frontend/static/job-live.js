// The job page's drawing: the history once with Plotly.react, then the live stream's points,
// queued by JobState and drawn at most every MIN_FLUSH_MS inside an animation frame with
// Plotly.extendTraces, so the page never redraws per point.

import { api } from "./api.js";
import * as charts from "./charts.js";
import { eventText } from "./job-state.js";
import { renderIdleSummary, renderSpeed, setLive } from "./job-tables.js";

// Redraws are spaced by at least MIN_FLUSH_MS and by 2.5 times what the last ones cost, so
// drawing never takes more than ~40% of the main thread however many workers the job has.
const MIN_FLUSH_MS = 100;
const MAX_FLUSH_MS = 600;
const SLOW_EVERY_MS = 1000; // the idle bars average 20 iterations, the heatmap has ~240 columns: once a second is plenty
const COMPACT_EVERY = 20; // flushes between compactions of the line charts

const plotConfig = () => ({ responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"] });
const figureArgs = (fig) => [fig.data, fig.layout, plotConfig()];

export class LiveCharts {
  /** divs: {time, batch, idle, heat}; heatMetric() says which metric the heatmap shows. */
  constructor(state, divs, heatMetric) {
    this.state = state;
    this.divs = divs;
    this.heatMetric = heatMetric;
    this.source = null;
    this.scheduled = false;
    this.lastFlush = 0;
    this.flushCost = 0; // moving average of a redraw's duration (ms)
    this.lastSlow = 0;
    this.slowDirty = false;
    this.markersDirty = false;
    this.markerSpan = 0; // the iteration span the plan labels were laid out for
    this.flushes = 0;
    this.recheck = null;
  }

  /** Iterations from the first drawn to the newest. */
  span() {
    const s = this.state;
    const first = Math.min(...s.heat.busy.map((l) => (l.x.length ? l.x[0] : Infinity)));
    return Number.isFinite(first) && s.newest > first ? s.newest - first : 0;
  }

  /** Plan markers laid out for `div`'s width (labels are staggered where they would overlap). */
  markers(div) {
    const s = this.state;
    const span = this.span();
    this.markerSpan = span;
    const width = div.clientWidth || 800;
    return charts.planMarkers(s.effectList(), s.plans, { highlight: s.highlight, span, widthPx: width });
  }

  /** Draw the loaded history (the result of JobState.loadHistory). */
  async drawHistory(history) {
    const s = this.state;
    const world = s.world;
    const timeFig = charts.iterationTimeFigure({
      world, ...history, events: { x: [], y: [], text: [] }, markers: this.markers(this.divs.time),
    });
    timeFig.data[charts.iterationTraces(world).predicted].showlegend = history.predicted.x.length > 0;
    await Promise.all([
      Plotly.react(this.divs.time, ...figureArgs(timeFig)),
      Plotly.react(this.divs.batch, ...figureArgs(charts.batchSizeFigure({ world, batch: history.batch, markers: this.markers(this.divs.batch) }))),
      Plotly.react(this.divs.idle, ...figureArgs(charts.idleFigure(s.idleData()))),
      this.drawHeatmap(),
    ]);
    // Events go on the measured line once it is drawn.
    const ev = { x: [], y: [], text: [] };
    for (const e of s.events) {
      ev.x.push(e.start_iteration);
      ev.y.push(this.eventY(e.start_iteration));
      ev.text.push(eventText(e));
    }
    if (ev.x.length) {
      Plotly.extendTraces(this.divs.time, { x: [ev.x], y: [ev.y], text: [ev.text] }, [charts.iterationTraces(world).events]);
    }
  }

  drawHeatmap() {
    const metric = this.heatMetric();
    const fig = charts.heatmapFigure({ ...this.state.heatmap(metric), metric, world: this.state.world });
    return Plotly.react(this.divs.heat, ...figureArgs(fig));
  }

  /**
   * Where an event's marker sits: the measured iteration time at `iteration`, from what waits for
   * the slower ranks' reports, what is queued, or what is drawn (the newest point at or before it).
   */
  eventY(iteration) {
    const s = this.state;
    const waiting = s.pending.get(iteration);
    if (waiting) return waiting.max;
    const before = (m) => {
      for (let i = m.x.length - 1; i >= 0; i -= 1) if (m.x[i] <= iteration) return m.y[i];
      return null;
    };
    const drawn = this.divs.time.data?.[charts.iterationTraces(s.world).measured];
    return before(s.queue.measured) ?? (drawn ? before(drawn) : null) ?? 0;
  }

  /** Follow the job's stream; `on` gets {plan, event, job, effect} callbacks for the tables. */
  open(jobId, cursor, on) {
    const s = this.state;
    this.source = api.stream(jobId, cursor, {
      telemetry: (msg) => {
        for (const [version, it] of s.ingest(msg, performance.now())) {
          this.markersDirty = true;
          on.effect(version, it);
        }
        this.slowDirty = true;
        this.schedule();
      },
      plan: on.plan,
      event: (e) => {
        s.addEvent(e, this.eventY(e.start_iteration));
        on.event(e);
        this.schedule();
      },
      job: on.job,
      end: () => {
        this.source.close();
        setLive("ended");
      },
    });
    this.source.onopen = () => setLive("live");
    this.source.onerror = () => setLive(this.source.readyState === EventSource.CLOSED ? "offline" : "reconnecting");
  }

  schedule() {
    if (this.scheduled) return;
    this.scheduled = true;
    const gap = Math.min(MAX_FLUSH_MS, Math.max(MIN_FLUSH_MS, 2.5 * this.flushCost));
    const wait = Math.max(0, gap - (performance.now() - this.lastFlush));
    const go = () => requestAnimationFrame(() => this.flush());
    if (wait > 0) setTimeout(go, wait);
    else go();
  }

  flush() {
    this.scheduled = false;
    const started = performance.now();
    this.lastFlush = started;
    const s = this.state;
    const waiting = s.settle(started);
    const q = s.takeQueue();
    const traces = charts.iterationTraces(s.world);
    extend(this.divs.time, q.busy, [[traces.measured, q.measured], [traces.predicted, q.predicted]]);
    if (q.predicted.x.length && !this.divs.time.data[traces.predicted].showlegend) {
      Plotly.restyle(this.divs.time, { showlegend: true }, [traces.predicted]);
    }
    if (q.events.x.length) {
      Plotly.extendTraces(this.divs.time, { x: [q.events.x], y: [q.events.y], text: [q.events.text] }, [traces.events]);
    }
    extend(this.divs.batch, q.batch);
    this.relayoutMarkers();
    this.drawSlow(started);
    this.flushes += 1;
    if (this.flushes % COMPACT_EVERY === 0) this.compact();
    renderSpeed(s);
    this.flushCost = 0.7 * this.flushCost + 0.3 * (performance.now() - started);
    // Iterations some rank has not reported yet are drawn once they are stale, even if the stream goes quiet.
    clearTimeout(this.recheck);
    if (waiting) this.recheck = setTimeout(() => this.schedule(), MAX_FLUSH_MS * 2);
    window.dispatchEvent(new CustomEvent("evenflow:drawn", { detail: { iteration: s.newest } }));
  }

  /** Plan markers on a new effect, and their labels again once the chart's span doubled. */
  relayoutMarkers() {
    const grown = this.markerSpan > 0 && this.span() > 2 * this.markerSpan;
    if (!this.markersDirty && !grown) return;
    this.markersDirty = false;
    Plotly.relayout(this.divs.time, this.markers(this.divs.time));
    Plotly.relayout(this.divs.batch, this.markers(this.divs.batch));
  }

  /** The idle bars and the heatmap, at most once a second. */
  drawSlow(now) {
    if (!this.slowDirty) return;
    if (now - this.lastSlow < SLOW_EVERY_MS) {
      this.schedule(); // draw them once their second is up, even if the stream goes quiet
      return;
    }
    this.slowDirty = false;
    this.lastSlow = now;
    Plotly.react(this.divs.idle, ...figureArgs(charts.idleFigure(this.state.idleData())));
    this.drawHeatmap();
    renderIdleSummary(this.state);
  }

  /** Keep each trace within its point budget by halving the resolution of old points. */
  compact() {
    for (const div of [this.divs.time, this.divs.batch]) {
      let changed = false;
      const data = div.data.map((trace, i) => {
        if (i >= this.state.world) return trace;
        const c = charts.compacted(trace.x, trace.y, this.state.budget);
        if (!c) return trace;
        changed = true;
        return { ...trace, x: c.x, y: c.y };
      });
      if (changed) Plotly.react(div, data, div.layout, plotConfig());
    }
  }
}

function extend(div, lanes, extra = []) {
  const idx = [];
  const xs = [];
  const ys = [];
  const add = (i, lane) => {
    if (!lane.x.length) return;
    idx.push(i);
    xs.push(lane.x);
    ys.push(lane.y);
  };
  lanes.forEach((lane, i) => add(i, lane));
  for (const [i, lane] of extra) add(i, lane);
  if (idx.length) Plotly.extendTraces(div, { x: xs, y: ys }, idx);
}
