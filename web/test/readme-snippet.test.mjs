// The documented examples (examples/*.mjs, shown in the package's README.md and in the
// documentation's deploy tutorial) run against a nested export: short, and each request served
// by one of the export's fp32 tiers. Needs NEFL_EXPORT_DIR; skipped without it.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath, pathToFileURL } from "node:url";
import { promisify } from "node:util";

const run = (script, ...args) => promisify(execFile)(process.execPath, [script, ...args], { timeout: 60_000 });
const example = (name) => fileURLToPath(new URL(`../examples/${name}`, import.meta.url));
// the repository's root: NEFL_REPO where the tests run in an app that installed the package
const REPO = process.env.NEFL_REPO ? pathToFileURL(`${process.env.NEFL_REPO}/`) : new URL("../../", import.meta.url);
const DIR = process.env.NEFL_EXPORT_DIR;
const SKIP = DIR ? false : "NEFL_EXPORT_DIR is not set";
const manifest = DIR ? JSON.parse(readFileSync(join(DIR, "manifest.json"), "utf8")) : null;
const fp32 = DIR ? manifest.tiers.filter((e) => e.precision === "fp32") : [];

/** The ```javascript blocks of a Markdown file of the repository. */
const blocks = (page) => [...readFileSync(new URL(page, REPO), "utf8").matchAll(/```javascript\n([\s\S]*?)```/g)].map((m) => m[1]);

test("the examples stay README-sized", () => {
  for (const name of ["choose-tier.mjs", "list-tiers.mjs"]) {
    assert.ok(readFileSync(example(name), "utf8").trimEnd().split("\n").length <= 20, name);
  }
});

test("choose-tier: loads the export and chooses a tier per request", { skip: SKIP }, async () => {
  const { stdout } = await run(example("choose-tier.mjs"), DIR);
  const lines = stdout.trim().split("\n");
  assert.equal(lines.length, 5, stdout);
  lines.forEach((line, i) => {
    const [, request, tier, cls] = line.match(/^request (\d+): tier (\S+), class (\d+)$/) ?? [];
    assert.equal(Number(request), i, line);
    assert.ok(fp32.some((e) => e.name === tier), `${line}: a tier of ${fp32.map((e) => e.name)}`);
    assert.ok(Number(cls) < manifest.output.num_classes, line);
  });
});

test("list-tiers: the tier table of the .onnx file alone, as the manifest has it", { skip: SKIP }, async () => {
  const { stdout } = await run(example("list-tiers.mjs"), join(DIR, fp32[0].file));
  const expected = fp32.map((e) => `tier ${e.index}: ${e.name}, ${e.params} parameters, ${e.macs} MACs`);
  assert.deepEqual(stdout.trim().split("\n"), expected);
});

test("the package's README and the deploy tutorial show these examples, character for character", () => {
  const files = ["choose-tier.mjs", "list-tiers.mjs"].map((name) => readFileSync(example(name), "utf8"));
  assert.deepEqual(blocks("web/README.md"), files);
  assert.equal(blocks("docs/tutorials/deploy-tiers.md")[0], files[0]);
});
