// The job page's state, without a DOM or Plotly: what the history and the live stream say,
// and the points each chart still has to draw. job-live.js draws them; node's test runner
// exercises this module directly (tests/js/job-state.test.js).

import { compacted } from "./charts.js";

export const WINDOW = 20; // iterations averaged by the idle bars
export const POINT_BUDGET = 24000; // points across all rank traces of one chart
export const HEAT_COLUMNS = 240; // iteration columns of the per-rank heatmap
/** An iteration some rank has not reported yet is drawn anyway once it waited this long: the
 * workers' telemetry senders flush every ~2 s each, not in step with each other. */
export const STALE_MS = 5000;

const lanes = (world) => Array.from({ length: world }, () => ({ x: [], y: [] }));

/** The number of workers of a job: its placed workers, else what its spec asks for. */
export function worldOf(job) {
  return job.workers.length || job.spec.workers || (job.spec.devices || []).length;
}

/** Points per rank trace so that all ranks together stay within POINT_BUDGET. */
export function budgetFor(world) {
  return Math.max(150, Math.min(2000, Math.floor(POINT_BUDGET / Math.max(1, world))));
}

/** Points not drawn yet, per chart. */
export function emptyQueue(world) {
  return {
    busy: lanes(world),
    batch: lanes(world),
    measured: { x: [], y: [] },
    predicted: { x: [], y: [] },
    events: { x: [], y: [], text: [] },
  };
}

export function eventText(e) {
  const who = e.rank === null ? "job" : `rank ${e.rank}`;
  if (e.kind === "oom") return `OOM: ${who}, a pass of ${e.detail?.batch ?? "?"} ran out of memory; ${e.action}`;
  return `${e.kind}: ${who}, severity ${e.severity.toFixed(2)}, action ${e.action}`;
}

export class JobState {
  constructor(job) {
    this.job = job;
    this.world = worldOf(job);
    this.budget = budgetFor(this.world);
    this.plans = new Map(); // version -> PlanOut
    this.effects = new Map(); // version -> first iteration that ran it
    this.events = []; // oldest first
    this.models = null; // ModelOut[] once loaded
    this.modelsError = null; // the server's answer when the models could not be loaded
    this.hosts = new Map(); // device id -> {host, device}
    this.lastIteration = Array(this.world).fill(-1); // per rank: newest iteration drawn
    this.window = Array.from({ length: this.world }, () => []); // per rank: recent {it, busy, idle}
    this.rank0 = []; // recent [iteration, ts] of rank 0, for the speed
    this.pending = new Map(); // iteration -> {count, max, since}: its measured time so far
    this.measuredUpTo = -1; // newest iteration on the measured line (it only grows)
    this.newest = -1;
    this.recentSpeed = null; // samples/s the server measured when the page loaded
    this.highlight = null; // plan version issued from this page
    this.heat = { busy: lanes(this.world), idle: lanes(this.world) }; // per rank, for the heatmap
    this.queue = emptyQueue(this.world);
  }

  /** The queued points, leaving an empty queue. */
  takeQueue() {
    const q = this.queue;
    this.queue = emptyQueue(this.world);
    return q;
  }

  setPlans(plans) {
    for (const p of plans) this.plans.set(p.version, p);
  }

  setHosts(hosts) {
    for (const h of hosts) for (const d of h.devices) this.hosts.set(d.id, { host: h, device: d });
  }

  /** A plan from the stream or from an override applied on this page. */
  addPlan(plan) {
    this.plans.set(plan.version, plan);
    this.job.plan_version = Math.max(this.job.plan_version || 0, plan.version);
  }

  currentPlan() {
    return this.plans.get(this.job?.plan_version);
  }

  /** The plan's predicted iteration time in force at `iteration`, or null. */
  predictedAt(iteration) {
    let version = null;
    let best = -Infinity;
    for (const [v, it] of this.effects) if (it <= iteration && it > best) [version, best] = [v, it];
    return (version === null ? null : this.plans.get(version)?.predicted_ms) ?? null;
  }

  effectList() {
    return [...this.effects].map(([version, iteration]) => ({ version, iteration }));
  }

  /**
   * Take a downsampled history (SeriesOut) and return each chart's data. Iterations that some
   * rank had not reported yet are left off the measured line and wait in `pending` for the
   * stream, so the line never steps back to them (which drew a false diagonal on a page
   * opened as a job starts, when the ranks' reports are not yet in step).
   */
  loadHistory(series, events, now) {
    const world = this.world;
    const busy = lanes(world);
    const batch = lanes(world);
    for (const e of series.plan_effects) this.effects.set(e.version, e.iteration);
    for (const r of series.ranks) {
      if (r.rank >= world) continue;
      busy[r.rank] = { x: r.iteration, y: r.iteration.map((_, i) => r.data_ms[i] + r.compute_ms[i]) };
      batch[r.rank] = { x: r.iteration, y: r.batch_size };
      this.heat.busy[r.rank] = { x: [...r.iteration], y: [...busy[r.rank].y] };
      this.heat.idle[r.rank] = { x: [...r.iteration], y: [...r.sync_ms] };
      this.lastIteration[r.rank] = r.iteration.length ? r.iteration[r.iteration.length - 1] : -1;
    }
    this.newest = series.last_iteration ?? -1;
    const complete = series.bucket === 1 ? Math.min(...this.lastIteration) : Infinity;
    const measured = { x: [], y: [] };
    series.measured.iteration.forEach((it, i) => {
      if (it > complete) return;
      measured.x.push(it);
      measured.y.push(series.measured.iteration_ms[i]);
    });
    if (complete !== Infinity) this.seedPending(series, complete, now);
    this.measuredUpTo = measured.x.length ? measured.x[measured.x.length - 1] : -1;
    const predicted = { x: [], y: [] };
    for (const it of measured.x) {
      const p = this.predictedAt(it);
      if (p !== null) {
        predicted.x.push(it);
        predicted.y.push(p);
      }
    }
    for (const w of series.window) {
      if (w.rank < world) {
        this.window[w.rank] = [{ it: series.last_iteration, busy: w.data_ms + w.compute_ms, idle: w.sync_ms }];
      }
    }
    this.events = events.slice().reverse();
    return { busy, batch, measured, predicted };
  }

  /** The per-iteration rows (bucket 1) after `complete` start the live aggregation. */
  seedPending(series, complete, now) {
    for (const r of series.ranks) {
      if (r.rank >= this.world) continue;
      r.iteration.forEach((it, i) => {
        if (it <= complete) return;
        this.aggregate(it, r.data_ms[i] + r.compute_ms[i] + r.sync_ms[i], now);
      });
    }
  }

  aggregate(it, ms, now) {
    if (it <= this.measuredUpTo) return; // drawn already (without this rank): never drawn again
    const agg = this.pending.get(it) || { count: 0, max: 0, since: now };
    agg.count += 1;
    agg.max = Math.max(agg.max, ms);
    this.pending.set(it, agg);
  }

  /**
   * Rows of a `telemetry` stream message (`columns` name each row's values). Queues the new
   * points and returns the plan versions seen for the first time, as [version, iteration].
   */
  ingest(msg, now) {
    const col = Object.fromEntries(msg.columns.map((c, i) => [c, i]));
    const q = this.queue;
    const effects = [];
    for (const row of msg.rows) {
      const rank = row[col.rank];
      const it = row[col.iteration];
      if (rank >= this.world || it <= this.lastIteration[rank]) continue;
      this.lastIteration[rank] = it;
      const version = row[col.plan_version];
      const busy = row[col.data_ms] + row[col.compute_ms];
      const idle = row[col.sync_ms];
      q.busy[rank].x.push(it);
      q.busy[rank].y.push(busy);
      q.batch[rank].x.push(it);
      q.batch[rank].y.push(row[col.batch_size]);
      this.pushHeat(rank, it, busy, idle);
      const w = this.window[rank];
      w.push({ it, busy, idle });
      if (w.length > WINDOW) w.splice(0, w.length - WINDOW);
      if (rank === 0) {
        this.rank0.push([it, row[col.ts]]);
        if (this.rank0.length > WINDOW + 1) this.rank0.shift();
      }
      this.aggregate(it, busy + idle, now);
      const seen = this.effects.get(version);
      if (seen === undefined || it < seen) {
        this.effects.set(version, it);
        effects.push([version, it]);
      }
      this.newest = Math.max(this.newest, it);
    }
    this.settle(now);
    return effects;
  }

  /**
   * Move finished iterations from `pending` to the measured line, oldest first: one is finished
   * once every rank reported it, or once it waited STALE_MS (a rank may be gone). The line
   * only moves forward: an iteration at or before its newest point is dropped, never drawn
   * backwards. Returns whether iterations still wait.
   */
  settle(now) {
    const q = this.queue;
    for (const [it, agg] of [...this.pending].sort((a, b) => a[0] - b[0])) {
      if (agg.count < this.world && now - agg.since < STALE_MS) break;
      this.pending.delete(it);
      if (it <= this.measuredUpTo) continue;
      this.measuredUpTo = it;
      q.measured.x.push(it);
      q.measured.y.push(agg.max);
      const p = this.predictedAt(it);
      if (p !== null) {
        q.predicted.x.push(it);
        q.predicted.y.push(p);
      }
    }
    return this.pending.size > 0;
  }

  pushHeat(rank, it, busy, idle) {
    for (const [lane, v] of [[this.heat.busy[rank], busy], [this.heat.idle[rank], idle]]) {
      lane.x.push(it);
      lane.y.push(v);
      const c = compacted(lane.x, lane.y, this.budget);
      if (c) [lane.x, lane.y] = [c.x, c.y];
    }
  }

  /** A straggler event from the stream; queued as a marker at `y` on the measured line. */
  addEvent(e, y) {
    this.events.push(e);
    this.queue.events.x.push(e.start_iteration);
    this.queue.events.y.push(y);
    this.queue.events.text.push(eventText(e));
  }

  /** Each rank's mean compute and idle over its last WINDOW iterations. */
  idleData() {
    const ranks = this.window.map((w, rank) => {
      const n = w.length || 1;
      return {
        rank,
        busy_ms: w.reduce((s, p) => s + p.busy, 0) / n,
        idle_ms: w.reduce((s, p) => s + p.idle, 0) / n,
      };
    });
    return { world: this.world, ranks, windowIterations: WINDOW, lastIteration: this.newest };
  }

  /** Percent of all workers' recent time spent idle, or null before any telemetry. */
  idleShare() {
    const d = this.idleData().ranks;
    const busy = d.reduce((s, r) => s + r.busy_ms, 0);
    const idle = d.reduce((s, r) => s + r.idle_ms, 0);
    return busy + idle > 0 ? (100 * idle) / (busy + idle) : null;
  }

  /** Samples per second over rank 0's recent iterations (its own timestamps); before two live
   * ones, what the server measured over them when the page loaded (null if nothing). */
  speed() {
    const r = this.rank0;
    if (r.length < 2) return this.recentSpeed;
    const [it0, ts0] = r[0];
    const [it1, ts1] = r[r.length - 1];
    return ts1 > ts0 ? (this.job.spec.global_batch * (it1 - it0)) / (ts1 - ts0) : this.recentSpeed;
  }

  /** The heatmap's grid of `metric` ("busy" or "idle") per rank over iterations. */
  heatmap(metric) {
    return heatmapGrid(this.heat[metric], HEAT_COLUMNS);
  }
}

/**
 * Put per-rank series ({x: iterations, y: values}) on one grid of at most `columns` iteration
 * buckets: x holds each bucket's first iteration, z[rank][bucket] the mean of the rank's values
 * in it (null where the rank reported nothing). Rank r is row r.
 */
export function heatmapGrid(rankLanes, columns) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const lane of rankLanes) {
    if (!lane.x.length) continue;
    lo = Math.min(lo, lane.x[0]);
    hi = Math.max(hi, lane.x[lane.x.length - 1]);
  }
  const y = rankLanes.map((_, r) => r);
  if (lo === Infinity) return { x: [], y, z: rankLanes.map(() => []), bucket: 1 };
  const bucket = Math.max(1, Math.ceil((hi - lo + 1) / Math.max(1, columns)));
  const n = Math.floor((hi - lo) / bucket) + 1;
  const x = Array.from({ length: n }, (_, b) => lo + b * bucket);
  const z = rankLanes.map((lane) => {
    const sum = new Float64Array(n);
    const count = new Uint32Array(n);
    lane.x.forEach((it, i) => {
      const v = lane.y[i];
      if (v === null || v === undefined) return;
      const b = Math.floor((it - lo) / bucket);
      sum[b] += v;
      count[b] += 1;
    });
    return Array.from(sum, (s, b) => (count[b] ? s / count[b] : null));
  });
  return { x, y, z, bucket };
}
