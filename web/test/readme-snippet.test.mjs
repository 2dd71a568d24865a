// The documentation's example (examples/choose-tier.mjs, shown in docs/tutorials/deploy-tiers.md)
// runs against a nested export: short, and each
// request served by one of the export's fp32 tiers. Needs NEFL_EXPORT_DIR; skipped without it.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const EXAMPLE = fileURLToPath(new URL("../examples/choose-tier.mjs", import.meta.url));
const DIR = process.env.NEFL_EXPORT_DIR;

test("the example stays README-sized", () => {
  assert.ok(readFileSync(EXAMPLE, "utf8").trimEnd().split("\n").length <= 20);
});

test("the example loads the export and chooses a tier per request", { skip: DIR ? false : "NEFL_EXPORT_DIR is not set" }, async () => {
  const manifest = JSON.parse(readFileSync(join(DIR, "manifest.json"), "utf8"));
  const names = manifest.tiers.filter((e) => e.precision === "fp32").map((e) => e.name);
  const { stdout } = await promisify(execFile)(process.execPath, [EXAMPLE, DIR], { timeout: 60_000 });
  const lines = stdout.trim().split("\n");
  assert.equal(lines.length, 5, stdout);
  lines.forEach((line, i) => {
    const [, request, tier, cls] = line.match(/^request (\d+): tier (\S+), class (\d+)$/) ?? [];
    assert.equal(Number(request), i, line);
    assert.ok(names.includes(tier), `${line}: a tier of ${names}`);
    assert.ok(Number(cls) < manifest.output.num_classes, line);
  });
});

test("the documentation shows this example, character for character", () => {
  const page = readFileSync(fileURLToPath(new URL("../../docs/tutorials/deploy-tiers.md", import.meta.url)), "utf8");
  const block = page.match(/```javascript\n([\s\S]*?)```/);
  assert.ok(block, "docs/tutorials/deploy-tiers.md has a ```javascript block");
  assert.equal(block[1], readFileSync(EXAMPLE, "utf8"));
});
