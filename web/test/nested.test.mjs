// A nested export in onnxruntime-node: every precision's file checked against the manifest's
// sha256 and tier list, every tier's logits equal to Python's (NEFL_CASES), tampered files and
// out-of-range tiers refused. Needs NEFL_EXPORT_DIR and NEFL_CASES (tests/test_node.py sets
// them); skipped without them.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import * as ort from "onnxruntime-node";

import {
  entryLabel, externalTensors, loadManifestEntry, loadNestedModel, lowMemoryOptions, manifestFiles, readNestedMetadata, sha256Hex,
} from "nefl-zoo-web/nested";

const { NEFL_EXPORT_DIR: DIR, NEFL_CASES } = process.env;
const SKIP = DIR && NEFL_CASES ? false : "NEFL_EXPORT_DIR and NEFL_CASES are not set (tests/test_node.py sets them)";
const manifest = SKIP ? null : JSON.parse(readFileSync(join(DIR, "manifest.json"), "utf8"));
const CASES = SKIP ? null : JSON.parse(readFileSync(NEFL_CASES, "utf8"));

function assertClose(actual, expected, tolerance, what) {
  assert.equal(actual.length, expected.length, `${what}: length`);
  let worst = 0;
  for (let i = 0; i < actual.length; i++) worst = Math.max(worst, Math.abs(actual[i] - expected[i]));
  assert.ok(worst <= tolerance, `${what}: max |diff| ${worst} > ${tolerance}`);
}

test("every nested file: sha256, tier table and logits of every tier as in Python", { skip: SKIP }, async () => {
  const files = manifestFiles(manifest);
  assert.ok(files.some((f) => f.precision === "fp32"), "the export has an fp32 file");
  assert.deepEqual(Object.keys(CASES).sort(), manifest.tiers.map(entryLabel).sort(), "a case per manifest label");
  for (const { file, precision, sha256, size } of files) {
    const bytes = readFileSync(join(DIR, file));
    assert.equal(await sha256Hex(bytes), sha256, `${file}: sha256`);
    assert.equal(bytes.length, size, `${file}: declared bytes`);
    const model = await loadNestedModel(ort, bytes, { sha256, size });
    const entries = manifest.tiers.filter((e) => e.file === file);
    assert.equal(model.metadata.precision, precision);
    assert.deepEqual(model.tiers.map((t) => [t.index, t.name, t.params, t.macs, t.accuracy]),
      entries.map((e) => [e.index, e.name, e.params, e.macs, e.accuracy]), `${file}: tiers of metadata_props vs manifest`);
    assert.deepEqual(model.metadata.input.shape, manifest.input.shape);
    assert.equal(model.metadata.output.name, manifest.output.name);
    for (const entry of entries) {
      const label = entryLabel(entry);
      assert.equal(loadManifestEntry(manifest, label), entry);
      const { input, dims, logits, logits_dims: logitsDims } = CASES[label];
      const byName = await model.run(entry.name, Float32Array.from(input), dims[0]);
      assert.deepEqual(byName.dims, logitsDims, `${label}: dims`);
      assertClose(byName.logits, logits, 1e-4, label);
      const byIndex = await model.run(entry.index - model.tiers.length, Float32Array.from(input)); // negative, batch implied
      assert.deepEqual(Array.from(byIndex.logits), Array.from(byName.logits), `${label}: by negative index`);
    }
  }
});

test("a tampered, truncated or appended file is refused before any session is created", { skip: SKIP }, async () => {
  const { file, sha256, size } = manifestFiles(manifest)[0];
  const bytes = readFileSync(join(DIR, file));
  bytes[bytes.length >> 1] ^= 0x01;
  let created = 0;
  const spy = { ...ort, InferenceSession: { create: (...args) => (created++, ort.InferenceSession.create(...args)) } };
  await assert.rejects(loadNestedModel(spy, bytes, { sha256 }), (err) => {
    assert.match(err.message, /sha256/);
    assert.ok(err.message.includes(sha256.slice(0, 16)), err.message);
    return true;
  });
  assert.equal(created, 0);
  bytes[bytes.length >> 1] ^= 0x01; // restored
  for (const cut of [bytes.subarray(0, -1), Buffer.concat([bytes, Buffer.of(0)])]) { // truncated, appended to
    await assert.rejects(loadNestedModel(spy, cut, { sha256, size }), (err) => {
      assert.equal(err.message.split("\n").length, 1);
      assert.ok(err.message.startsWith(`size mismatch: the manifest declares ${size} bytes, got ${cut.length}`), err.message);
      return true;
    });
  }
  assert.equal(created, 0); // the same spy creates its session on the intact bytes
  await loadNestedModel(spy, bytes, { sha256, size });
  assert.equal(created, 1);
});

test("unknown tier names and out-of-range tiers fail", { skip: SKIP }, async () => {
  const { file } = manifestFiles(manifest)[0];
  const bytes = readFileSync(join(DIR, file));
  const model = await loadNestedModel(ort, bytes, { sessionOptions: { logSeverityLevel: 4 } }); // quiet: failures expected
  const count = model.tiers.length;
  const images = new Float32Array(manifest.input.shape.reduce((a, b) => a * b, 1));
  assert.throws(() => model.tierIndex("nope"), new RegExp(`unknown tier 'nope' \\(known: ${model.tiers.map((t) => t.name).join(", ")}\\)`));
  await assert.rejects(model.run(count, images), /out of range/);
  await assert.rejects(model.run(-count - 1, images), /out of range/);
  await assert.rejects(model.run(0, images.subarray(1)), /input: \d+ values are not a whole number of images/);
  await assert.rejects(model.run(0, images, 2), /input: \d+ values are not 2 images/);
  assert.throws(() => loadManifestEntry(manifest, "nope"), /unknown label 'nope' \(known: /);
  // The file itself refuses them, in the node the contract names.
  for (const tier of [count, -count - 1]) {
    const feeds = { [manifest.input.name]: new ort.Tensor("float32", images, [1, ...manifest.input.shape]),
      tier: new ort.Tensor("int64", BigInt64Array.of(BigInt(tier)), []) };
    await assert.rejects(model.session.run(feeds), /tier_out_of_range/);
  }
});

test("bytes without the tier table are refused clearly", () => {
  assert.throws(() => readNestedMetadata(new Uint8Array([0x08, 0x08])), /no metadata_props key 'nefl_zoo.nested'/);
  assert.throws(() => readNestedMetadata(new Uint8Array([0x3a, 0x05, 0x00])), /truncated/);
  // ModelProto {1: ir_version 8, 14: {1: key, 2: value}} (strings under 128 bytes)
  const utf8 = (text) => [...new TextEncoder().encode(text)];
  const model = (key, value) => {
    const entry = [0x0a, utf8(key).length, ...utf8(key), 0x12, utf8(value).length, ...utf8(value)];
    return new Uint8Array([0x08, 0x08, 0x72, entry.length, ...entry]);
  };
  assert.throws(() => readNestedMetadata(model("other", "{}")), /no metadata_props key 'nefl_zoo.nested' \(keys: other\)/);
  assert.throws(() => readNestedMetadata(model("nefl_zoo.nested", "{")), /'nefl_zoo.nested' is not JSON/);
  assert.throws(() => readNestedMetadata(model("nefl_zoo.nested", "{}")), /not a nefl-zoo-nested tier table/);
  const table = { format: "nefl-zoo-nested", version: 1, tiers: [{ index: 0, name: "g1.0" }] };
  assert.deepEqual(readNestedMetadata(model("nefl_zoo.nested", JSON.stringify(table)).buffer), table);
});

// ---- external data refused; the low-memory mode


// A hand-written ModelProto: fields as [number, value] (a string or bytes: length-delimited; a
// number: a varint), nested messages as arrays.
function encode(fieldsList) {
  const out = [];
  const varint = (n) => { do { out.push((n & 0x7f) | (n > 0x7f ? 0x80 : 0)); n >>>= 7; } while (n); };
  for (const [field, value] of fieldsList) {
    if (typeof value === "number") { varint(field * 8); varint(value); continue; }
    const bytes = typeof value === "string" ? new TextEncoder().encode(value) : Array.isArray(value) ? encode(value) : value;
    varint(field * 8 + 2); varint(bytes.length); out.push(...bytes);
  }
  return Uint8Array.from(out);
}

test("a model keeping a tensor in external data is refused before any session is created", async () => {
  const table = JSON.stringify({ format: "nefl-zoo-nested", version: 1, tiers: [{ index: 0, name: "g1" }] });
  const metadata = [14, [[1, "nefl_zoo.nested"], [2, table]]];
  const external = (name) => [[8, name], [13, [[1, "location"], [2, "weights.bin"]]], [14, 1]];
  const inGraph = (tensor) => [[5, tensor]]; // an initializer
  const ifNode = (tensor) => [[1, [[4, "If"], [5, [[1, "then_branch"], [6, inGraph(tensor)]]]]]]; // a branch's initializer
  const models = {
    planted: [[1, 8], [7, inGraph(external("planted"))], metadata],
    branch: [[1, 8], [7, ifNode(external("branch"))], metadata],
    constant: [[1, 8], [25, [[7, [[4, "Constant"], [5, [[1, "value"], [5, external("constant")]]]]]]], metadata], // in a function
  };
  let created = 0;
  const spy = { ...ort, InferenceSession: { create: () => { created++; throw new Error("not reached"); } } };
  for (const [name, fieldsList] of Object.entries(models)) {
    const bytes = encode(fieldsList);
    assert.deepEqual(externalTensors(bytes), [name]);
    await assert.rejects(loadNestedModel(spy, bytes), (err) => {
      assert.equal(err.message, `nested model: tensor ${name} is stored as external data, which no hash covers ` +
        "(refused; export self-contained files)");
      return true;
    });
  }
  assert.equal(created, 0);
  assert.deepEqual(externalTensors(encode([[1, 8], [7, inGraph([[8, "inside"], [9, "AAAA"]])], metadata])), []);
});

test("the low-memory mode turns constant folding off and gives the same logits", { skip: SKIP }, async () => {
  assert.deepEqual(lowMemoryOptions({ logSeverityLevel: 3, extra: { session: { x: "1" } } }),
    { logSeverityLevel: 3, extra: { session: { x: "1" }, optimization: { disable_specified_optimizers: "ConstantFolding" } } });
  const { file, sha256, size } = manifestFiles(manifest)[0];
  const bytes = readFileSync(join(DIR, file));
  const options = [];
  const spy = { ...ort, InferenceSession: { create: (data, o) => (options.push(o), ort.InferenceSession.create(data, o)) } };
  const model = await loadNestedModel(spy, bytes, { sha256, size, lowMemory: true });
  assert.equal(options[0].extra.optimization.disable_specified_optimizers, "ConstantFolding");
  for (const entry of manifest.tiers.filter((e) => e.file === file)) {
    const { input, dims, logits } = CASES[entryLabel(entry)];
    assertClose((await model.run(entry.name, Float32Array.from(input), dims[0])).logits, logits, 1e-4, `${entryLabel(entry)} (low memory)`);
  }
});
