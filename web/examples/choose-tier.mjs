// Serve requests from a nested export, each with the most accurate tier expected within 20 ms.
import { readFileSync } from "node:fs";
import * as ort from "onnxruntime-node";
import { loadNestedModel } from "nefl-zoo-web/nested";
import { AdaptivePolicy, Candidate, Deadline } from "nefl-zoo-web/policy";

const dir = process.argv[2] ?? process.env.NEFL_EXPORT_DIR;
const manifest = JSON.parse(readFileSync(`${dir}/manifest.json`, "utf8"));
const tiers = manifest.tiers.filter((e) => e.precision === "fp32");
const model = await loadNestedModel(ort, readFileSync(`${dir}/${tiers[0].file}`), { sha256: tiers[0].sha256, size: tiers[0].bytes });
const policy = new AdaptivePolicy(tiers.map((e) => new Candidate({ label: e.name, accuracy: e.accuracy, macs: e.macs,
  expectedMs: e.latency.median_ms })), new Deadline({ ms: 20 }));
const image = new Float32Array(manifest.input.shape.reduce((a, b) => a * b)); // your preprocessed image here
for (let request = 0; request < 5; request++) {
  const tier = policy.choose();
  const start = performance.now();
  const { logits } = await model.run(tier, image, 1);
  policy.observe(tier, performance.now() - start);
  console.log(`request ${request}: tier ${tier}, class ${logits.indexOf(Math.max(...logits))}`);
}
