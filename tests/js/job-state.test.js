// The job page's pure state under node's test runner (no DOM, no Plotly): `make jstest`.

import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { JobState, STALE_MS, WINDOW, budgetFor, heatmapGrid, worldOf } from "../../frontend/static/job-state.js";

const COLUMNS = ["rank", "iteration", "ts", "batch_size", "data_ms", "compute_ms", "sync_ms", "plan_version"];

function job(world = 2) {
  return { id: 1, workers: [], spec: { workers: world, global_batch: 64 }, plan_version: 1 };
}

/** One telemetry stream message: rows of [rank, iteration, busy ms, idle ms]. */
function telemetry(rows, version = 1) {
  return {
    columns: COLUMNS,
    rows: rows.map(([rank, it, busy, idle = 0]) => [rank, it, 100 + it * 0.1, 32, 1, busy - 1, idle, version]),
  };
}

/** A bucket-1 history: per rank, the iterations it reported, each with `busy(rank)` ms. */
function series(reported, busy = () => 10, idle = () => 2) {
  const ranks = reported.map((its, rank) => ({
    rank,
    iteration: its,
    batch_size: its.map(() => 32),
    data_ms: its.map(() => 1),
    compute_ms: its.map(() => busy(rank) - 1),
    sync_ms: its.map(() => idle(rank)),
    plan_version: its.map(() => 1),
  }));
  const all = [...new Set(reported.flat())].sort((a, b) => a - b);
  return {
    bucket: 1,
    last_iteration: all.length ? all[all.length - 1] : null,
    last_id: 0,
    ranks,
    measured: {
      iteration: all,
      iteration_ms: all.map((it) => Math.max(...ranks.filter((r) => r.iteration.includes(it)).map((r) => busy(r.rank) + idle(r.rank)))),
    },
    plan_effects: all.length ? [{ version: 1, iteration: all[0] }] : [],
    window: [],
  };
}

const increasing = (xs) => xs.every((x, i) => i === 0 || x > xs[i - 1]);
const range = (a, b) => Array.from({ length: b - a }, (_, i) => a + i);

describe("sizes", () => {
  it("takes the world from the placed workers, else from the spec", () => {
    assert.equal(worldOf({ workers: [{}, {}, {}], spec: { workers: 8 } }), 3);
    assert.equal(worldOf({ workers: [], spec: { workers: 8 } }), 8);
    assert.equal(worldOf({ workers: [], spec: { devices: [1, 2] } }), 2);
  });
  it("keeps every chart's points within the budget", () => {
    assert.equal(budgetFor(4), 2000);
    assert.equal(budgetFor(64), 375);
    assert.equal(budgetFor(10_000), 150);
  });
});

describe("the measured line", () => {
  it("never steps back when a page opens while ranks are out of step (the false diagonal)", () => {
    // Rank 0 reported 0..5, rank 1 only 0..2: its batch of 3..5 is still on its way.
    const s = new JobState(job(2));
    const history = s.loadHistory(series([range(0, 6), range(0, 3)]), [], 0);
    assert.deepEqual(history.measured.x, [0, 1, 2], "iterations rank 1 has not reported wait");
    s.ingest(telemetry([[1, 3, 30], [1, 4, 30], [1, 5, 30], [0, 6, 10], [1, 6, 10]]), 10);
    const q = s.takeQueue();
    const xs = [...history.measured.x, ...q.measured.x];
    assert.ok(increasing(xs), `measured x must only grow: ${xs}`);
    assert.deepEqual(q.measured.x, [3, 4, 5, 6]);
    assert.deepEqual(q.measured.y, [30, 30, 30, 10], "the late rank's slower time is the iteration's");
  });

  it("draws an iteration a rank never reports once it is stale, and drops it if the rank is later", () => {
    const s = new JobState(job(2));
    s.loadHistory(series([[], []]), [], 0);
    s.ingest(telemetry([[0, 0, 10], [0, 1, 10]]), 0);
    assert.deepEqual(s.takeQueue().measured.x, [], "waits for rank 1");
    assert.equal(s.settle(STALE_MS - 1), true);
    assert.equal(s.settle(STALE_MS), false);
    assert.deepEqual(s.takeQueue().measured.x, [0, 1]);
    s.ingest(telemetry([[1, 0, 50], [1, 1, 50], [0, 2, 10], [1, 2, 10]]), STALE_MS + 1);
    assert.deepEqual(s.takeQueue().measured.x, [2], "0 and 1 are drawn already: never again");
  });

  it("pairs each measured point with the prediction of the plan in force", () => {
    const s = new JobState(job(1));
    s.setPlans([{ version: 1, predicted_ms: null }, { version: 2, predicted_ms: 7 }]);
    s.loadHistory(series([[0, 1]]), [], 0);
    s.ingest(telemetry([[0, 2, 10]], 2), 0);
    const q = s.takeQueue();
    assert.deepEqual(q.measured.x, [2]);
    assert.deepEqual(q.predicted, { x: [2], y: [7] });
    assert.equal(s.predictedAt(1), null);
  });
});

describe("live rows", () => {
  it("drops repeats, reports each plan's first iteration once, and keeps a bounded window", () => {
    const s = new JobState(job(1));
    s.loadHistory(series([[0]]), [], 0);
    s.recentSpeed = 500;
    assert.equal(s.speed(), 500, "the server's figure until the stream brings two iterations");
    const rows = range(1, 40).map((it) => [0, it, 10, 1]);
    assert.deepEqual(s.ingest(telemetry(rows.slice(0, 5), 2), 0), [[2, 1]]);
    assert.deepEqual(s.ingest(telemetry(rows, 2), 0), [], "no new plan version");
    assert.equal(s.takeQueue().busy[0].x.length, 39, "each iteration once");
    assert.equal(s.window[0].length, WINDOW);
    assert.equal(s.newest, 39);
    assert.ok(Math.abs(s.speed() - 640) < 1e-6, "64 samples per 0.1 s");
    assert.ok(Math.abs(s.idleShare() - 100 / 11) < 1e-9);
  });

  it("ignores ranks beyond the job's world", () => {
    const s = new JobState(job(2));
    s.loadHistory(series([[], []]), [], 0);
    s.ingest(telemetry([[5, 0, 10]]), 0);
    assert.deepEqual(s.takeQueue().busy.map((l) => l.x.length), [0, 0]);
  });
});

describe("the per-rank heatmap", () => {
  it("shows the slow rank as the hot row, live rows included", () => {
    const s = new JobState(job(3));
    s.loadHistory(series([range(0, 10), range(0, 10), range(0, 10)], (r) => (r === 2 ? 40 : 10)), [], 0);
    s.ingest(telemetry([[0, 10, 10, 2], [1, 10, 10, 2], [2, 10, 40, 2]]), 0);
    const grid = s.heatmap("busy");
    assert.deepEqual(grid.y, [0, 1, 2]);
    assert.equal(grid.x.length, 11);
    const mean = (row) => row.reduce((a, b) => a + b, 0) / row.length;
    assert.ok(mean(grid.z[2]) > 3 * mean(grid.z[0]));
    assert.ok(s.heatmap("idle").z.every((row) => row.every((v) => v === 2)));
  });

  it("buckets long histories into at most the given columns, with gaps where a rank was silent", () => {
    const grid = heatmapGrid([{ x: range(0, 1000), y: range(0, 1000).map(() => 4) }, { x: [0, 999], y: [1, 3] }], 100);
    assert.equal(grid.bucket, 10);
    assert.equal(grid.x.length, 100);
    assert.deepEqual(grid.x.slice(0, 3), [0, 10, 20]);
    assert.ok(grid.z[0].every((v) => v === 4));
    assert.equal(grid.z[1][0], 1);
    assert.equal(grid.z[1][99], 3);
    assert.equal(grid.z[1][50], null);
  });

  it("is empty before any telemetry", () => {
    assert.deepEqual(heatmapGrid([{ x: [], y: [] }], 10), { x: [], y: [0], z: [[]], bucket: 1 });
  });
});
