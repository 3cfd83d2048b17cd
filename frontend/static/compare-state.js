// The compare page's numbers, without a DOM: each job's downsampled series (SeriesOut) turned
// into throughput, iteration time and idle share per bucket of iterations, and a summary.
// Tested under node (tests/js/compare-state.test.js).

export const MAX_JOBS = 8;

/**
 * The job ids of `?jobs=3,4`: {ids} or {error}. Ids are kept in the order given, repeats dropped.
 */
export function parseJobIds(search) {
  const raw = new URLSearchParams(search).get("jobs") ?? "";
  const parts = raw.split(",").map((p) => p.trim()).filter((p) => p !== "");
  if (parts.length < 2) return { error: "Choose two or more jobs to compare: /compare?jobs=3,4" };
  const bad = parts.find((p) => !/^\d{1,10}$/.test(p) || Number(p) < 1);
  if (bad !== undefined) return { error: `"${bad}" in jobs= is not a job id` };
  const ids = [...new Set(parts.map(Number))];
  if (ids.length > MAX_JOBS) return { error: `At most ${MAX_JOBS} jobs side by side (${ids.length} given)` };
  return { ids };
}

/** Per bucket (keyed by its first iteration): the workers' idle and total time, and the
 * samples of one iteration (the sum of the ranks' mean local batches). */
function perBucket(series) {
  const sums = new Map(); // iteration -> {idle, total, samples}
  for (const r of series.ranks) {
    r.iteration.forEach((it, i) => {
      const s = sums.get(it) ?? { idle: 0, total: 0, samples: 0 };
      s.idle += r.sync_ms[i];
      s.total += r.data_ms[i] + r.compute_ms[i] + r.sync_ms[i];
      s.samples += r.batch_size[i];
      sums.set(it, s);
    });
  }
  return sums;
}

const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);

/**
 * One job's comparable series, per bucket of iterations: samples/s (the samples of an iteration
 * over the measured iteration time, so an epoch's short last batch counts as the few samples it
 * had), the measured iteration time, and the workers' idle share; and the whole run's figures.
 */
export function compareSeries(job, series) {
  const its = series.measured.iteration;
  const ms = series.measured.iteration_ms;
  const buckets = perBucket(series);
  const samplesAt = (it) => buckets.get(it)?.samples ?? job.spec.global_batch;
  const idleIts = [...buckets.keys()].sort((a, b) => a - b);
  let idleMs = 0;
  let totalMs = 0;
  for (const b of buckets.values()) {
    idleMs += b.idle;
    totalMs += b.total;
  }
  const runMs = ms.reduce((a, b) => a + b, 0);
  const runSamples = its.reduce((a, it) => a + samplesAt(it), 0);
  return {
    id: job.id,
    label: `#${job.id} ${job.name} (${job.spec.policy?.name ?? "minmax"})`,
    throughput: { x: its, y: its.map((it, i) => (ms[i] > 0 ? (1000 * samplesAt(it)) / ms[i] : null)) },
    iterationMs: { x: its, y: ms },
    idlePct: {
      x: idleIts,
      y: idleIts.map((it) => (buckets.get(it).total > 0 ? (100 * buckets.get(it).idle) / buckets.get(it).total : 0)),
    },
    summary: {
      iterations: series.last_iteration === null ? 0 : series.last_iteration + 1,
      meanMs: mean(ms),
      samplesPerS: runMs > 0 ? (1000 * runSamples) / runMs : null,
      idlePct: totalMs > 0 ? (100 * idleMs) / totalMs : null,
    },
  };
}

/** Each job's speed relative to the first one's (null where either is unknown). */
export function speedups(rows) {
  const base = rows[0]?.summary.samplesPerS ?? null;
  return rows.map((r) => (base && r.summary.samplesPerS ? r.summary.samplesPerS / base : null));
}
