import { readFileSync } from "node:fs";
import * as ort from "onnxruntime-node";
import { loadNestedModel } from "nefl-zoo-web/nested";
import { AdaptivePolicy, Candidate, Deadline } from "nefl-zoo-web/policy";
const dir = process.argv[2] ?? process.env.NEFL_EXPORT_DIR;
const read = (name) => readFileSync(`${dir}/${name}`);
const manifest = JSON.parse(read("manifest.json"));
const tiers = manifest.tiers.filter((e) => e.precision === "fp32");
const { file, sha256, bytes: size } = tiers[0];
const model = await loadNestedModel(ort, read(file), { sha256, size });
const policy = new AdaptivePolicy(tiers.map((e) => new Candidate({ label: e.name,
  accuracy: e.accuracy, macs: e.macs, expectedMs: e.latency.median_ms })),
  new Deadline({ ms: 20 })); // the most accurate tier expected within 20 ms
const image = new Float32Array(manifest.input.shape.reduce((a, b) => a * b)); // input
for (let i = 0; i < 5; i++) {
  const tier = policy.choose(), start = performance.now();
  const y = (await model.run(tier, image, 1)).logits;
  policy.observe(tier, performance.now() - start);
  console.log(`request ${i}: tier ${tier}, class ${y.indexOf(Math.max(...y))}`);
}
