// The JavaScript port of the adaptive policy reproduces every decision that the Python policy
// made on the traces of tests/data/policy_traces.json (tools/policy_traces.py writes it).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { pathToFileURL } from "node:url";

import { AdaptivePolicy, Candidate, Deadline, format3g, percentile } from "nefl-zoo-web/policy";

// the repository's root: NEFL_REPO where the tests run in an app that installed the package
const REPO = process.env.NEFL_REPO ? pathToFileURL(`${process.env.NEFL_REPO}/`) : new URL("../../", import.meta.url);
const TRACES = JSON.parse(readFileSync(new URL("tests/data/policy_traces.json", REPO), "utf8"));

/** Python's snake_case settings and fields as the port's camelCase ones. */
const camel = (obj) => Object.fromEntries(Object.entries(obj).map(([k, v]) => [k.replace(/_(.)/g, (_, c) => c.toUpperCase()), v]));

test("Deadline defaults and percentile match Python", () => {
  const { ms, ...defaults } = new Deadline({ ms: 1 });
  assert.deepEqual(defaults, camel(TRACES.deadline_defaults));
  for (const { values, q, expect } of TRACES.percentile) assert.equal(percentile(values, q), expect);
});

test("format3g writes numbers as Python's format(x, '.3g') (switch reasons)", () => {
  const python = { 1.125: "1.12", 1.135: "1.14", 2.675: "2.67", 0.5: "0.5", 14: "14", 999.5: "1e+03", 9995: "1e+04",
    0.000123456: "0.000123", 1e-5: "1e-05", 123456: "1.23e+05", 8.100000000000001: "8.1", 0: "0" };
  for (const [x, want] of Object.entries(python)) assert.equal(format3g(Number(x)), want, x);
  assert.equal(format3g(Infinity), "inf");
});

test("invalid settings and candidates are refused as in Python", () => {
  for (const settings of TRACES.invalid_deadlines) assert.throws(() => new Deadline(camel(settings)), /Deadline\./, JSON.stringify(settings));
  for (const fields of TRACES.invalid_candidates) assert.throws(() => new Candidate(camel(fields)), /Candidate/, JSON.stringify(fields));
  const c = new Candidate({ label: "a", accuracy: 0.5, macs: 1, expectedMs: 1 });
  assert.throws(() => new AdaptivePolicy([], new Deadline({ ms: 1 })), /at least one/);
  assert.throws(() => new AdaptivePolicy([c, c], new Deadline({ ms: 1 })), /duplicate labels a/);
  const policy = new AdaptivePolicy([c], new Deadline({ ms: 1 }), () => 0);
  assert.throws(() => policy.observe("b", 1), /'b' is not a candidate \(a\)/);
  assert.throws(() => policy.observe("a", -1), /^Error: ms: must be a number in \[0, 86400000\], got -1$/);
  assert.throws(() => policy.observe("a", NaN), /ms: must be/);
  assert.throws(() => policy.observe("a", 1e308), /ms: must be a number in \[0, 86400000\], got 1e\+308/);
  // the same words as Python's (tests/test_adaptive.py), numbers written alike
  assert.throws(() => new Deadline({ ms: 1, window: 10001 }), /^Error: Deadline\.window: must be an integer in 1\.\.10000, got 10001$/);
  assert.throws(() => new Deadline({ ms: 1, upMargin: 1 }), /^Error: Deadline\.upMargin: must be a number in \(0, 1\), got 1$/);
  assert.throws(() => new Deadline({ ms: 0 }), /^Error: Deadline\.ms: must be a number in \[0\.001, 86400000\], got 0$/);
  assert.throws(() => new Candidate({ label: "x", macs: -1, expectedMs: 1 }), /^Error: Candidate 'x' macs: must be an integer >= 0, got -1$/);
  const top = new Deadline({ ms: 86_400_000, window: 10_000, recent: 10_000, probeAfterS: 86_400, maxBackoff: 1e6, minSpeedup: 1000 });
  assert.equal(top.window, 10_000);
});

for (const c of TRACES.cases) {
  test(`trace ${c.name}: ${c.about}`, () => {
    let now = 0;
    const policy = new AdaptivePolicy(c.candidates.map((x) => new Candidate(camel(x))), new Deadline(camel(c.deadline)), () => now);
    assert.deepEqual(policy.ladder, c.ladder);
    assert.equal(policy.current, c.start);
    c.steps.forEach((step, n) => {
      now = step.at;
      if (step.op === "choose") {
        assert.equal(policy.choose(), step.expect, `step ${n}: ${JSON.stringify(step)}`);
      } else {
        policy.observe(step.label, step.ms);
        assert.equal(policy.current, step.current, `step ${n}: ${JSON.stringify(step)}`);
      }
    });
    assert.deepEqual(policy.switches, c.switches);
    assert.equal(policy.slowdown, c.slowdown);
    assert.equal(policy.backoff, c.backoff);
    for (const x of c.candidates) assert.equal(policy.expectedMs(x.label), x.expected_ms * c.slowdown);
  });
}
