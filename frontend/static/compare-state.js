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

/** Per bucket of the series: the workers' idle share (sync over all their time), in percent. */
function idlePerBucket(series) {
  const sums = new Map(); // iteration -> [idle, total]
  for (const r of series.ranks) {
    r.iteration.forEach((it, i) => {
      const idle = r.sync_ms[i];
      const total = r.data_ms[i] + r.compute_ms[i] + idle;
      const s = sums.get(it) ?? [0, 0];
      sums.set(it, [s[0] + idle, s[1] + total]);
    });
  }
  const its = [...sums.keys()].sort((a, b) => a - b);
  return { x: its, y: its.map((it) => (sums.get(it)[1] > 0 ? (100 * sums.get(it)[0]) / sums.get(it)[1] : 0)) };
}

const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);

/**
 * One job's comparable series: samples/s (the global batch over the measured iteration time),
 * the measured iteration time, and the idle share, each per bucket; and their means over the run.
 */
export function compareSeries(job, series) {
  const batch = job.spec.global_batch;
  const its = series.measured.iteration;
  const ms = series.measured.iteration_ms;
  const idle = idlePerBucket(series);
  const meanMs = mean(ms);
  // Weight each bucket's idle share by its time, as the whole run's share would be.
  const idleAll = (() => {
    let idleMs = 0;
    let totalMs = 0;
    for (const r of series.ranks) {
      r.iteration.forEach((_, i) => {
        idleMs += r.sync_ms[i];
        totalMs += r.data_ms[i] + r.compute_ms[i] + r.sync_ms[i];
      });
    }
    return totalMs > 0 ? (100 * idleMs) / totalMs : null;
  })();
  return {
    id: job.id,
    label: `#${job.id} ${job.name} (${job.spec.policy?.name ?? "minmax"})`,
    throughput: { x: its, y: ms.map((m) => (m > 0 ? (1000 * batch) / m : null)) },
    iterationMs: { x: its, y: ms },
    idlePct: idle,
    summary: {
      iterations: series.last_iteration === null ? 0 : series.last_iteration + 1,
      meanMs,
      samplesPerS: meanMs ? (1000 * batch) / meanMs : null,
      idlePct: idleAll,
    },
  };
}

/** Each job's speed relative to the first one's (null where either is unknown). */
export function speedups(rows) {
  const base = rows[0]?.summary.samplesPerS ?? null;
  return rows.map((r) => (base && r.summary.samplesPerS ? r.summary.samplesPerS / base : null));
}
