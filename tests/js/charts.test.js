// The pure parts of the charts and the form helpers under node's test runner: `make jstest`.

import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { compacted, labelRows, planMarkers } from "../../frontend/static/charts.js";
import { parseCount } from "../../frontend/static/dom.js";

const plans = new Map([1, 2, 3, 4, 5, 6].map((v) => [v, { version: v, source: "automatic" }]));
const effects = (its) => its.map((iteration, i) => ({ version: i + 1, iteration }));

/** Label extents in iterations for a chart of `span` iterations over 880 px (800 px plot). */
function overlaps(markers, span) {
  const perPx = span / 800;
  const boxes = markers.annotations.map((a) => [a.y, a.x, a.x + (a.text.length * 6.6 + 10) * perPx]);
  return boxes.some(([y, lo, hi], i) => boxes.some(([y2, lo2, hi2], j) => i !== j && y === y2 && lo < hi2 && lo2 < hi));
}

describe("plan labels", () => {
  it("stagger labels of plans that took effect a few iterations apart", () => {
    const m = planMarkers(effects([0, 100, 104, 108]), plans, { span: 1000, widthPx: 880 });
    assert.equal(m.shapes.length, 3, "a line for each change");
    assert.equal(m.annotations.length, 3);
    assert.equal(new Set(m.annotations.map((a) => a.y)).size, 3, "three rows");
    assert.equal(overlaps(m, 1000), false);
  });

  it("hide what does not fit in three rows, keeping the newest", () => {
    const m = planMarkers(effects([0, 100, 101, 102, 103, 104]), plans, { span: 1000, widthPx: 880 });
    assert.equal(m.shapes.length, 5);
    assert.deepEqual(m.annotations.map((a) => a.name).sort(), ["plan-v4", "plan-v5", "plan-v6"]);
    assert.equal(overlaps(m, 1000), false);
  });

  it("keep one row when the changes are far apart", () => {
    const m = planMarkers(effects([0, 100, 500, 900]), plans, { span: 1000, widthPx: 880 });
    assert.deepEqual(m.annotations.map((a) => a.y), [0.99, 0.99, 0.99]);
  });

  it("place each label on the first free row", () => {
    assert.deepEqual(labelRows([0, 5, 10, 50], [8, 8, 8, 8], 3), [0, 1, 0, 0]);
    assert.deepEqual(labelRows([0, 1, 2, 3], [10, 10, 10, 10], 2), [null, null, 1, 0]);
    assert.deepEqual(labelRows([0, 4, 8], [10, 10, 10], 3), [2, 1, 0]);
  });
});

describe("compaction", () => {
  it("halves the old half once a trace holds over twice its budget", () => {
    const x = Array.from({ length: 50 }, (_, i) => i);
    assert.equal(compacted(x, x, 25), null);
    const c = compacted([...x, 50], [...x, 50], 25);
    assert.equal(c.x.length, 13 + 25);
    assert.deepEqual(c.x.slice(-25), x.slice(26).concat([50]));
  });
});

describe("parseCount", () => {
  it("turns counts into numbers and leaves anything else for the API to name", () => {
    assert.equal(parseCount(" 12 "), 12);
    assert.equal(parseCount("-3"), -3);
    assert.equal(parseCount("1.5"), 1.5, "a number: the API answers that it must be an integer");
    assert.equal(parseCount(".5"), 0.5);
    assert.equal(parseCount("12abc"), "12abc");
    assert.equal(parseCount(""), "");
    assert.equal(parseCount(null), "");
    assert.equal(parseCount(7), 7);
  });
});
