// The compare page's numbers under node's test runner: `make jstest`.

import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { MAX_JOBS, compareSeries, parseJobIds, speedups } from "../../frontend/static/compare-state.js";

describe("parseJobIds", () => {
  it("reads the ids in order, without repeats", () => {
    assert.deepEqual(parseJobIds("?jobs=4,3,4"), { ids: [4, 3] });
    assert.deepEqual(parseJobIds("?jobs=%203%20,%204"), { ids: [3, 4] });
  });
  it("says what is wrong", () => {
    assert.match(parseJobIds("").error, /two or more/);
    assert.match(parseJobIds("?jobs=3").error, /two or more/);
    assert.match(parseJobIds("?jobs=3,x").error, /"x" in jobs= is not a job id/);
    assert.match(parseJobIds("?jobs=3,0").error, /"0"/);
    const many = Array.from({ length: MAX_JOBS + 1 }, (_, i) => i + 1).join(",");
    assert.match(parseJobIds(`?jobs=${many}`).error, /At most/);
  });
});

function series(ms, ranks, batches = ms.map(() => 100)) {
  const its = ms.map((_, i) => i * 10);
  return {
    last_iteration: its.length ? its[its.length - 1] + 9 : null,
    measured: { iteration: its, iteration_ms: ms },
    ranks: ranks.map(([busy, idle], rank) => ({
      rank,
      iteration: its,
      data_ms: its.map(() => 0),
      batch_size: batches,
      compute_ms: its.map(() => busy),
      sync_ms: its.map(() => idle),
    })),
  };
}

describe("compareSeries", () => {
  const job = (id, policy) => ({ id, name: "mlp", spec: { global_batch: 200, policy: { name: policy } } });

  it("turns measured iteration time into samples per second and idle into a share", () => {
    const equal = compareSeries(job(1, "equal"), series([100, 100], [[50, 50], [100, 0]]));
    assert.deepEqual(equal.throughput.y, [2000, 2000]);
    assert.deepEqual(equal.idlePct.y, [25, 25]);
    assert.equal(equal.summary.samplesPerS, 2000);
    assert.equal(equal.summary.idlePct, 25);
    assert.equal(equal.summary.iterations, 20);
    assert.equal(equal.label, "#1 mlp (equal)");

    const minmax = compareSeries(job(2, "minmax"), series([50, 50], [[48, 2], [48, 2]]));
    assert.deepEqual(speedups([equal, minmax]), [1, 2]);
  });

  it("counts an epoch's short last batch as the samples it had", () => {
    // Bucket 10 ran 20 samples per rank in a fifth of the time: the same rate, not five times it.
    const tail = compareSeries(job(4, "minmax"), series([100, 20], [[90, 10], [90, 10]], [100, 20]));
    assert.deepEqual(tail.throughput.y, [2000, 2000]);
    assert.equal(tail.summary.samplesPerS, 2000);
  });

  it("has no numbers before any telemetry", () => {
    const empty = compareSeries(job(3, "minmax"), series([], []));
    assert.equal(empty.summary.samplesPerS, null);
    assert.equal(empty.summary.idlePct, null);
    assert.equal(empty.summary.iterations, 0);
    assert.deepEqual(speedups([empty, empty]), [null, null]);
  });
});
