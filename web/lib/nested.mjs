/**
 * Run a nefl-zoo nested ONNX model (every tier in one file, chosen by an int64 `tier` input)
 * with onnxruntime: pass `onnxruntime-node` in Node or `onnxruntime-web` in a browser.
 * No Node-only imports: bytes in, sessions out.
 *
 *   const model = await loadNestedModel(ort, bytes, { sha256: entry.sha256, size: entry.bytes });
 *   const { logits, dims } = await model.run("g0.6", images, batch);
 *
 * `{ lowMemory: true }` keeps one copy of the shared weights in the session (slower runs).
 */

import { sha256 } from "@noble/hashes/sha2.js";
import { bytesToHex } from "@noble/hashes/utils.js";

/** The key of the tier table (JSON) in the ModelProto's metadata_props. */
export const METADATA_KEY = "nefl_zoo.nested";

const toBytes = (bytes) => (bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes));

/** The SHA-256 of `bytes` (Uint8Array or ArrayBuffer) as lowercase hex. Computed by
 * `@noble/hashes`, not Web Crypto: a page served over plain HTTP to a phone on the local
 * network is no secure context and has no `crypto.subtle`. */
export async function sha256Hex(bytes) {
  return bytesToHex(sha256(toBytes(bytes)));
}

/** The protobuf fields of `bytes[start, end)` as `[field, wireType, value]`: a number for
 * varints, a Uint8Array view for length-delimited fields, null for fixed-size ones. */
function* fields(bytes, start = 0, end = bytes.length) {
  let pos = start;
  const varint = () => {
    let value = 0;
    for (let scale = 1; ; scale *= 128) {
      if (pos >= end) throw new Error("nested model: truncated protobuf (not an ONNX file?)");
      const byte = bytes[pos++];
      value += (byte & 0x7f) * scale;
      if (byte < 0x80) return value;
    }
  };
  while (pos < end) {
    const key = varint();
    const [field, wire] = [Math.floor(key / 8), key % 8];
    if (wire === 0) yield [field, wire, varint()];
    else if (wire === 1 || wire === 5) {
      pos += wire === 1 ? 8 : 4;
      yield [field, wire, null];
    } else if (wire === 2) {
      const length = varint();
      if (pos + length > end) throw new Error("nested model: truncated protobuf (not an ONNX file?)");
      yield [field, wire, bytes.subarray(pos, pos + length)];
      pos += length;
    } else throw new Error(`nested model: unsupported protobuf wire type ${wire} (not an ONNX file?)`);
  }
  if (pos > end) throw new Error("nested model: truncated protobuf (not an ONNX file?)");
}

/** The ModelProto's metadata_props (field 14: StringStringEntryProto {1: key, 2: value}). */
export function readMetadataProps(bytes) {
  const data = toBytes(bytes);
  const text = new TextDecoder();
  const props = {};
  for (const [field, wire, value] of fields(data)) {
    if (field !== 14 || wire !== 2) continue;
    let key = "";
    let entry = "";
    for (const [f, w, v] of fields(value)) {
      if (w !== 2) continue;
      if (f === 1) key = text.decode(v);
      else if (f === 2) entry = text.decode(v);
    }
    props[key] = entry;
  }
  return props;
}

// Field numbers of onnx/onnx.proto that can hold a tensor: ModelProto {7: graph, 25: functions},
// GraphProto {1: node, 5: initializer, 15: sparse_initializer}, NodeProto {5: attribute},
// FunctionProto {7: node}, AttributeProto {5: t, 6: g, 10: tensors, 11: graphs, 22: sparse_tensor,
// 23: sparse_tensors}, SparseTensorProto {1: values, 2: indices}, TensorProto {8: name,
// 13: external_data, 14: data_location (1: EXTERNAL)}.
function tensorExternal(tensor) {
  let name = "";
  let external = false;
  for (const [field, wire, value] of fields(tensor)) {
    if (field === 8 && wire === 2) name = new TextDecoder().decode(value);
    else if ((field === 13 && wire === 2) || (field === 14 && wire === 0 && value === 1)) external = true;
  }
  return external ? name || "<unnamed tensor>" : null;
}

function* sparseExternal(sparse) {
  for (const [field, wire, value] of fields(sparse)) {
    if (wire === 2 && (field === 1 || field === 2)) {
      const found = tensorExternal(value);
      if (found) yield found;
    }
  }
}

function* nodeExternal(node) {
  for (const [field, wire, attribute] of fields(node)) {
    if (field !== 5 || wire !== 2) continue;
    for (const [f, w, value] of fields(attribute)) {
      if (w !== 2) continue;
      if (f === 5 || f === 10) {
        const found = tensorExternal(value);
        if (found) yield found;
      } else if (f === 22 || f === 23) yield* sparseExternal(value);
      else if (f === 6 || f === 11) yield* graphExternal(value);
    }
  }
}

function* graphExternal(graph) {
  for (const [field, wire, value] of fields(graph)) {
    if (wire !== 2) continue;
    if (field === 5) {
      const found = tensorExternal(value);
      if (found) yield found;
    } else if (field === 15) yield* sparseExternal(value);
    else if (field === 1) yield* nodeExternal(value);
  }
}

/** The names of every tensor of a serialized ModelProto whose data lives in an external file
 * (initializers, sparse initializers, attribute tensors; in the main graph, every subgraph and
 * every model-local function), as nefl_zoo.runtime.wire walks it. */
export function externalTensors(bytes) {
  const found = [];
  for (const [field, wire, value] of fields(toBytes(bytes))) {
    if (wire !== 2) continue;
    if (field === 7) found.push(...graphExternal(value));
    else if (field === 25) {
      for (const [f, w, node] of fields(value)) if (f === 7 && w === 2) found.push(...nodeExternal(node));
    }
  }
  return found;
}

/** Session options that keep one copy of a nested model's shared weights: onnxruntime's constant
 * folding off (`optimization.disable_specified_optimizers`), so each tier's weights are cut out
 * of them at every run instead of held per tier (slower; see the nested model's documentation). */
export function lowMemoryOptions(sessionOptions = {}) {
  const extra = sessionOptions.extra ?? {};
  return { ...sessionOptions,
    extra: { ...extra, optimization: { ...(extra.optimization ?? {}), disable_specified_optimizers: "ConstantFolding" } } };
}

/** The tier table (parsed JSON) a nested model stores under `nefl_zoo.nested`. */
export function readNestedMetadata(bytes) {
  const props = readMetadataProps(bytes);
  if (!(METADATA_KEY in props)) {
    const keys = Object.keys(props);
    throw new Error(`nested model: no metadata_props key '${METADATA_KEY}' (keys: ${keys.length ? keys.join(", ") : "none"}): ` +
      "not a nefl-zoo nested model");
  }
  let table;
  try {
    table = JSON.parse(props[METADATA_KEY]);
  } catch (err) {
    throw new Error(`nested model: '${METADATA_KEY}' is not JSON (${err.message})`);
  }
  if (table?.format !== "nefl-zoo-nested" || !Array.isArray(table.tiers)) {
    throw new Error(`nested model: '${METADATA_KEY}' is not a nefl-zoo-nested tier table (format ${JSON.stringify(table?.format)})`);
  }
  return table;
}

/** A manifest entry's label: the tier name for fp32, `NAME:PRECISION` otherwise. */
export const entryLabel = (entry) => (entry.precision === "fp32" ? entry.name : `${entry.name}:${entry.precision}`);

/** The manifest (v4, nested) entry labelled `label` (`g0.6`, `g0.6:int8`); throws listing the labels. */
export function loadManifestEntry(manifest, label) {
  const entry = manifest.tiers.find((e) => entryLabel(e) === label);
  if (!entry) throw new Error(`unknown label '${label}' (known: ${manifest.tiers.map(entryLabel).join(", ")})`);
  return entry;
}

/** The nested files of a manifest: `{file, precision, sha256, size}` per precision, in table
 * order (`size`: the declared bytes, null before schema 5). */
export function manifestFiles(manifest) {
  const files = new Map();
  for (const e of manifest.tiers) {
    if (!files.has(e.file)) files.set(e.file, { file: e.file, precision: e.precision, sha256: e.sha256, size: e.bytes ?? null });
  }
  return [...files.values()];
}

/** One nested model's session and tier table. */
export class NestedModel {
  constructor(ort, session, metadata) {
    Object.assign(this, { ort, session, metadata });
    /** The tier table: `[{index, name, params, macs, accuracy, ...}]`, `tier` order. */
    this.tiers = metadata.tiers;
  }

  /** The `tier` input value of a tier name or index (negative counts from the end). */
  tierIndex(nameOrIndex) {
    const count = this.tiers.length;
    if (typeof nameOrIndex === "number") {
      if (!Number.isInteger(nameOrIndex) || nameOrIndex < -count || nameOrIndex >= count) {
        throw new Error(`tier ${nameOrIndex} is out of range: the model has ${count} tiers (0..${count - 1}, or -${count}..-1)`);
      }
      return nameOrIndex < 0 ? nameOrIndex + count : nameOrIndex;
    }
    const tier = this.tiers.find((t) => t.name === nameOrIndex);
    if (!tier) throw new Error(`unknown tier '${nameOrIndex}' (known: ${this.tiers.map((t) => t.name).join(", ")})`);
    return tier.index;
  }

  /** The logits of `tier` (name or index) on `data`, a Float32Array of `batch` images of the
   * model's input shape (NCHW): `{logits: Float32Array, dims}`. */
  async run(tier, data, batch = undefined) {
    const { input, output, tier_input: tierInput } = this.metadata;
    const size = input.shape.reduce((a, b) => a * b, 1);
    const n = batch ?? data.length / size;
    if (!Number.isInteger(n) || n < 1 || data.length !== n * size) {
      throw new Error(`input: ${data.length} values are not ${batch ?? "a whole number of"} images of shape [${input.shape}]`);
    }
    if (input.batch != null && n !== input.batch) throw new Error(`input: the model takes batches of ${input.batch}, got ${n}`);
    const feeds = {
      [input.name]: new this.ort.Tensor("float32", data, [n, ...input.shape]),
      [tierInput]: new this.ort.Tensor("int64", BigInt64Array.of(BigInt(this.tierIndex(tier))), []),
    };
    const result = (await this.session.run(feeds))[output.name];
    return { logits: result.data, dims: result.dims };
  }
}

/** A NestedModel from the bytes of a nested `.onnx` file. When `size` (the manifest's
 * `bytes`) and `sha256` (hex) are given the bytes are checked first, the size before the hash:
 * a mismatch throws before any session is created; so does a model that keeps a tensor in
 * external data (bytes no hash covers). `lowMemory`: see `lowMemoryOptions`. */
export async function loadNestedModel(ort, bytes, { sha256, size, sessionOptions, lowMemory = false } = {}) {
  const data = toBytes(bytes);
  if (size != null && data.length !== size) {
    throw new Error(`size mismatch: the manifest declares ${size} bytes, got ${data.length}: ` +
      "the file was truncated, replaced or appended to; refusing to load it");
  }
  if (sha256 != null) {
    const actual = await sha256Hex(data);
    if (actual !== String(sha256).toLowerCase()) {
      throw new Error(`sha256 mismatch: expected ${String(sha256).slice(0, 16)}..., got ${actual.slice(0, 16)}...: ` +
        "the file is not the one the manifest describes; refusing to load it");
    }
  }
  const external = externalTensors(data);
  if (external.length) {
    const more = external.length > 1 ? ` (and ${external.length - 1} more)` : "";
    throw new Error(`nested model: tensor ${external[0]}${more} is stored as external data, which no hash covers ` +
      "(refused; export self-contained files)");
  }
  const metadata = readNestedMetadata(data);
  const session = await ort.InferenceSession.create(data, lowMemory ? lowMemoryOptions(sessionOptions) : sessionOptions);
  return new NestedModel(ort, session, metadata);
}
