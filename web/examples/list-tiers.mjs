// List the tiers of a nested model from its .onnx file alone: no manifest, no session.
import { readFileSync } from "node:fs";
import { readNestedMetadata } from "nefl-zoo-web/nested";

const { tiers } = readNestedMetadata(readFileSync(process.argv[2]));
for (const t of tiers) console.log(`tier ${t.index}: ${t.name}, ${t.params} parameters, ${t.macs} MACs`);
