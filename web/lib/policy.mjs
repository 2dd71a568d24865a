/**
 * AdaptivePolicy: serve each request with the most accurate entry expected to meet a deadline.
 *
 * An exact port of nefl_zoo/runtime/adaptive.py (its module docstring states the rules): the
 * same arithmetic, sort order and tie-breaking, so the same observations at the same clock
 * values give the same choices and switches as in Python (tests/data/policy_traces.json).
 * Runtime-agnostic, no dependencies. The clock returns seconds.
 *
 *   const label = policy.choose();   // the entry that serves this request
 *   ...                              // run it, time it
 *   policy.observe(label, elapsedMs);
 */

const repr = (v) => (typeof v === "string" ? `'${v}'` : String(v));

// nefl_zoo/bounds.py's limits and its `number` check, with the same messages.
export const MIN_MS = 0.001; // a microsecond
export const MAX_MS = 86_400_000; // a day, in ms
const MAX_WAIT_S = 86_400; // a day
const MAX_WINDOW = 10_000;
const MAX_BACKOFF = 1_000_000;
const MAX_SPEEDUP = 1_000;

/** `value` if it is a number (an integer when `integer`) from `low` to `high`, the ends
 * excluded when `openLow` / `openHigh`; else an Error `NAME: must be a number in (0, 1], got 1.5`. */
export function number(name, value, low, high = Infinity, { openLow = false, openHigh = false, integer = false } = {}) {
  const ok = typeof value === "number" && Number.isFinite(value) && (!integer || Number.isInteger(value))
    && (openLow ? value > low : value >= low) && (openHigh ? value < high : value <= high);
  if (!ok) {
    const want = integer
      ? (high === Infinity ? `an integer >= ${low}` : `an integer in ${low}..${high}`)
      : (high === Infinity ? `a finite number ${openLow ? ">" : ">="} ${low}`
        : `a number in ${openLow ? "(" : "["}${low}, ${high}${openHigh ? ")" : "]"}`);
    throw new Error(`${name}: must be ${want}, got ${repr(value)}`);
  }
  return value;
}

/** Python's `format(x, ".3g")` (round half to even on the exact binary value, like CPython). */
export function format3g(x) {
  if (Number.isNaN(x)) return "nan";
  if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
  if (x === 0) return Object.is(x, -0) ? "-0" : "0";
  const sign = x < 0 ? "-" : "";
  // 100 significant digits: exact for every double a tie could come from.
  const [mantissa, exp] = Math.abs(x).toExponential(99).split("e");
  const digits = mantissa.replace(".", "");
  let kept = Number(digits.slice(0, 3));
  let e = Number(exp);
  const rest = digits.slice(3);
  if (rest[0] > "5" || (rest[0] === "5" && (/[1-9]/.test(rest.slice(1)) || kept % 2 === 1))) kept += 1;
  if (kept === 1000) [kept, e] = [100, e + 1];
  const strip = (s) => (s.includes(".") ? s.replace(/0+$/, "").replace(/\.$/, "") : s);
  const ds = String(kept);
  if (e < -4 || e >= 3) {
    const m = strip(`${ds[0]}.${ds.slice(1)}`);
    return `${sign}${m}e${e < 0 ? "-" : "+"}${String(Math.abs(e)).padStart(2, "0")}`;
  }
  const fixed = e >= 0 ? `${ds.slice(0, e + 1)}.${ds.slice(e + 1)}` : `0.${"0".repeat(-e - 1)}${ds}`;
  return sign + strip(fixed);
}

/** One (tier, precision) entry: its label (`g0.6`, `g0.6:int8`), accuracy (`null`: not
 * measured), MACs and its latency on this device at the request batch when idle. */
export class Candidate {
  constructor({ label, accuracy = null, macs, expectedMs }) {
    if (typeof label !== "string" || !label) {
      throw new Error(`Candidate.label: must be a non-empty string, got ${repr(label)}`);
    }
    if (accuracy !== null && !(typeof accuracy === "number" && Number.isFinite(accuracy))) {
      throw new Error(`Candidate '${label}': accuracy must be a finite number or null, got ${repr(accuracy)}`);
    }
    number(`Candidate '${label}' macs`, macs, 0, Infinity, { integer: true });
    number(`Candidate '${label}' expectedMs`, expectedMs, MIN_MS, MAX_MS);
    Object.assign(this, { label, accuracy, macs, expectedMs });
    Object.freeze(this);
  }
}

/** The policy's settings (Python's `Deadline`, same defaults, limits and messages, camelCase
 * names): each request should finish within `ms`. */
export class Deadline {
  constructor({
    ms, percentile = 95.0, window = 20, headroom = 0.9, probeAfterS = 0.5, upMargin = 0.9,
    maxBackoff = 32.0, recent = 3, minSpeedup = 1.2,
  }) {
    Object.assign(this, { ms, percentile, window, headroom, probeAfterS, upMargin, maxBackoff, recent, minSpeedup });
    const check = (name, low, high, kind) => number(`Deadline.${name}`, this[name], low, high, kind);
    check("ms", MIN_MS, MAX_MS);
    check("percentile", 0, 100, { openLow: true });
    check("window", 1, MAX_WINDOW, { integer: true });
    check("recent", 1, MAX_WINDOW, { integer: true });
    check("headroom", 0, 1, { openLow: true });
    check("probeAfterS", 0, MAX_WAIT_S);
    check("upMargin", 0, 1, { openLow: true, openHigh: true });
    check("maxBackoff", 1, MAX_BACKOFF);
    check("minSpeedup", 1, MAX_SPEEDUP);
    Object.freeze(this);
  }
}

/** The `q`-th percentile (%) of `values`, interpolated linearly between the closest ranks. */
export function percentile(values, q) {
  const ordered = [...values].sort((a, b) => a - b);
  const rank = (q / 100) * (ordered.length - 1);
  const low = Math.floor(rank);
  const high = Math.min(low + 1, ordered.length - 1);
  return ordered[low] + (ordered[high] - ordered[low]) * (rank - low);
}

const compare = (a, b) => (a < b ? -1 : a > b ? 1 : 0);

/** The candidates no other dominates, fastest first, spaced `minSpeedup` apart from the most
 * accurate one within `budgetMs`. */
export function buildLadder(candidates, budgetMs = Infinity, minSpeedup = 1.0) {
  const byAccuracy = candidates.every((c) => c.accuracy !== null);
  const rank = (c) => (byAccuracy && c.accuracy !== null ? c.accuracy : c.macs);
  const sorted = [...candidates].sort((a, b) =>
    compare(a.expectedMs, b.expectedMs) || compare(-rank(a), -rank(b)) || compare(a.macs, b.macs) || compare(a.label, b.label));
  const front = [];
  for (const c of sorted) if (!front.length || rank(c) > rank(front.at(-1))) front.push(c);
  let start = 0;
  front.forEach((c, i) => { if (c.expectedMs <= budgetMs) start = i; });
  const below = [front[start]];
  const above = [front[start]];
  for (const c of front.slice(0, start).reverse()) if (c.expectedMs * minSpeedup <= below.at(-1).expectedMs) below.push(c);
  for (const c of front.slice(start + 1)) if (c.expectedMs >= above.at(-1).expectedMs * minSpeedup) above.push(c);
  return [...below.reverse(), ...above.slice(1)];
}

/** Chooses, request by request, the most accurate candidate expected to meet `deadline` from
 * the latencies it observes. `clock` returns monotonic seconds (injectable for tests). */
export class AdaptivePolicy {
  constructor(candidates, deadline, clock = () => performance.now() / 1000) {
    if (!candidates.length) throw new Error("candidates: must hold at least one Candidate, got none");
    const labels = candidates.map((c) => c.label);
    const duplicates = [...new Set(labels.filter((l, i) => labels.indexOf(l) !== i))].sort(compare);
    if (duplicates.length) throw new Error(`candidates: duplicate labels ${duplicates.join(", ")}`);
    this.deadline = deadline;
    this._clock = clock;
    this._baseline = new Map(candidates.map((c) => [c.label, c.expectedMs]));
    this._ladder = buildLadder(candidates, deadline.headroom * deadline.ms, deadline.minSpeedup);
    this._ratios = [];
    this._recent = [];
    this._slowdown = 1.0;
    this._index = this._fittingIndex(1.0);
    this._quietSince = clock();
    this._onTrial = true; // the start is a guess from the idle estimates, like a probe
    this._backoff = 1.0;
    this._observedSinceSwitch = false;
    /** Every change of the served entry: `{at, from, to, reason}`. */
    this.switches = [];
  }

  /** The label now served. */
  get current() { return this._ladder[this._index].label; }

  /** The labels the policy may serve, fastest (least accurate) first. */
  get ladder() { return this._ladder.map((c) => c.label); }

  /** The `percentile` of the recent latency / baseline ratios (1 before any observation). */
  get slowdown() { return this._slowdown; }

  /** The factor of `probeAfterS` the next quiet period lasts. */
  get backoff() { return this._backoff; }

  /** The latency of `label` expected at `percentile` now: its baseline times the slowdown. */
  expectedMs(label) { return this._baseline.get(this._known(label)) * this._slowdown; }

  /** The label to serve the next request with; probes one step up when due. */
  choose() {
    const d = this.deadline;
    const now = this._clock();
    const quiet = now - this._quietSince;
    if (!this._observedSinceSwitch) return this.current;
    if (this._onTrial && quiet >= d.probeAfterS) [this._onTrial, this._backoff] = [false, 1.0]; // a sustained success
    if (quiet >= d.probeAfterS * this._backoff) {
      const up = this._index + 1;
      const limit = d.upMargin * d.headroom * d.ms;
      const expected = up < this._ladder.length ? this._ladder[up].expectedMs * Math.max(...this._recent) : Infinity;
      if (expected <= limit) {
        this._switch(now, up, `probe: expected ${format3g(expected)} ms <= ${format3g(limit)} ms after ${format3g(quiet)} s quiet`);
        this._onTrial = true;
      }
    }
    return this.current;
  }

  /** Record that `label` served a request in `ms` milliseconds; steps down at once when that
   * threatens the deadline. Throws for an unknown label or a negative / non-finite latency. */
  observe(label, ms) {
    const d = this.deadline;
    const baseline = this._baseline.get(this._known(label));
    number("ms", ms, 0, MAX_MS);
    const now = this._clock();
    const ratio = ms / baseline;
    push(this._ratios, ratio, d.window);
    push(this._recent, ratio, d.recent);
    this._slowdown = percentile(this._ratios, d.percentile);
    this._observedSinceSwitch = true;
    const slowdown = this._slowdown;
    const budget = d.headroom * d.ms;
    const current = this._ladder[this._index].expectedMs;
    const expected = current * slowdown;
    if (expected <= budget || current * ratio <= budget) return;
    const missed = ms > d.ms;
    this._quietSince = now;
    if (this._onTrial) {
      this._onTrial = false;
      this._backoff = Math.min(2 * this._backoff, d.maxBackoff);
    }
    const target = this._fittingIndex(slowdown);
    if (target < this._index) {
      const why = missed
        ? `miss: ${label} took ${format3g(ms)} ms > ${format3g(d.ms)} ms`
        : `threat: ${this.current} expected ${format3g(expected)} ms > ${format3g(budget)} ms`;
      this._switch(now, target, `${why} (slowdown x${format3g(slowdown)})`);
    }
  }

  _known(label) {
    if (!this._baseline.has(label)) {
      throw new Error(`label: ${repr(label)} is not a candidate (${[...this._baseline.keys()].join(", ")})`);
    }
    return label;
  }

  /** The most accurate ladder step expected within `headroom * ms` under `slowdown`; 0 if none. */
  _fittingIndex(slowdown) {
    const budget = this.deadline.headroom * this.deadline.ms;
    let fitting = 0;
    this._ladder.forEach((c, i) => { if (c.expectedMs * slowdown <= budget) fitting = i; });
    return fitting;
  }

  _switch(now, index, reason) {
    this.switches.push({ at: now, from: this.current, to: this._ladder[index].label, reason });
    this._index = index;
    this._quietSince = now;
    this._observedSinceSwitch = false;
  }
}

/** Append `value`, keeping the last `maxlen` (a deque with maxlen). */
function push(array, value, maxlen) {
  array.push(value);
  if (array.length > maxlen) array.shift();
}
