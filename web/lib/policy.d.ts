/** Type declarations of `nefl-zoo-web/policy` (lib/policy.mjs). */

/** The smallest latency a candidate may declare (a microsecond), in ms. */
export const MIN_MS: number;
/** The largest latency a candidate may declare (a day), in ms. */
export const MAX_MS: number;

/** `value` if it is a number within the bounds; else an Error naming `name`. */
export function number(
  name: string, value: unknown, low: number, high?: number,
  options?: { openLow?: boolean; openHigh?: boolean; integer?: boolean },
): number;

/** Python's `format(x, ".3g")`. */
export function format3g(x: number): string;

/** The `q`-th percentile (%) of `values`, interpolated linearly between the closest ranks. */
export function percentile(values: readonly number[], q: number): number;

/** One (tier, precision) entry the policy may serve. */
export class Candidate {
  constructor(init: { label: string; accuracy?: number | null; macs: number; expectedMs: number });
  readonly label: string;
  readonly accuracy: number | null;
  readonly macs: number;
  readonly expectedMs: number;
}

/** The policy's settings: each request should finish within `ms`. */
export class Deadline {
  constructor(init: {
    ms: number; percentile?: number; window?: number; headroom?: number; probeAfterS?: number;
    upMargin?: number; maxBackoff?: number; recent?: number; minSpeedup?: number;
  });
  readonly ms: number;
  readonly percentile: number;
  readonly window: number;
  readonly headroom: number;
  readonly probeAfterS: number;
  readonly upMargin: number;
  readonly maxBackoff: number;
  readonly recent: number;
  readonly minSpeedup: number;
}

/** The candidates no other dominates, fastest first, spaced `minSpeedup` apart. */
export function buildLadder(candidates: readonly Candidate[], budgetMs?: number, minSpeedup?: number): Candidate[];

/** One change of the served entry. */
export interface Switch { at: number; from: string; to: string; reason: string }

/** Chooses, request by request, the most accurate candidate expected to meet the deadline. */
export class AdaptivePolicy {
  constructor(candidates: readonly Candidate[], deadline: Deadline, clock?: () => number);
  readonly deadline: Deadline;
  /** Every change of the served entry. */
  readonly switches: Switch[];
  /** The label now served. */
  readonly current: string;
  /** The labels the policy may serve, fastest first. */
  readonly ladder: string[];
  /** The percentile of the recent latency / baseline ratios. */
  readonly slowdown: number;
  /** The factor of `probeAfterS` the next quiet period lasts. */
  readonly backoff: number;
  /** The latency of `label` expected now. */
  expectedMs(label: string): number;
  /** The label to serve the next request with. */
  choose(): string;
  /** Record that `label` served a request in `ms` milliseconds. */
  observe(label: string, ms: number): void;
}
