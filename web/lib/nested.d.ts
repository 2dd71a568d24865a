/** Type declarations of `nefl-zoo-web/nested` (lib/nested.mjs). */

/** The parts of an onnxruntime module (`onnxruntime-node` or `onnxruntime-web`) this package uses. */
export interface OrtModule {
  InferenceSession: { create(model: Uint8Array, options?: object): Promise<OrtSession> };
  Tensor: new (type: string, data: Float32Array | BigInt64Array, dims: readonly number[]) => unknown;
}

/** The parts of an onnxruntime `InferenceSession` this package uses. */
export interface OrtSession {
  run(feeds: Record<string, unknown>): Promise<Record<string, { data: unknown; dims: readonly number[] }>>;
  readonly inputNames: readonly string[];
  readonly outputNames: readonly string[];
}

/** One tier of a nested model's tier table. */
export interface TierInfo {
  /** The value of the model's `tier` input that runs this tier. */
  index: number;
  /** The tier's name in its spec (`g0.2`). */
  name: string;
  /** Parameters of the tier. */
  params: number;
  /** Multiply-accumulates of one image. */
  macs: number;
  /** Test accuracy measured at export, or null. */
  accuracy: number | null;
  [key: string]: unknown;
}

/** The tier table a nested model stores in its metadata (key `nefl_zoo.nested`). */
export interface NestedMetadata {
  format: "nefl-zoo-nested";
  tier_input: string;
  input: { name: string; shape: number[]; batch: number | null; [key: string]: unknown };
  output: { name: string; [key: string]: unknown };
  tiers: TierInfo[];
  [key: string]: unknown;
}

/** One entry of an export's manifest.json (`tiers[]`). */
export interface ManifestEntry {
  name: string;
  precision: "fp32" | "int8" | "fp16";
  index: number;
  file: string;
  sha256: string;
  bytes?: number | null;
  accuracy?: number | null;
  macs: number;
  [key: string]: unknown;
}

/** An export's manifest.json (the fields this package reads). */
export interface Manifest {
  tiers: ManifestEntry[];
  [key: string]: unknown;
}

/** The key of the tier table (JSON) in the ModelProto's metadata_props. */
export const METADATA_KEY: "nefl_zoo.nested";

/** The SHA-256 of `bytes` as lowercase hex (no secure context needed). */
export function sha256Hex(bytes: Uint8Array | ArrayBuffer): Promise<string>;

/** The ModelProto's metadata_props, read from the file's bytes without a session. */
export function readMetadataProps(bytes: Uint8Array | ArrayBuffer): Record<string, string>;

/** The names of every tensor of a serialized model whose data lives in an external file. */
export function externalTensors(bytes: Uint8Array | ArrayBuffer): string[];

/** Session options that keep one copy of a nested model's shared weights (constant folding off). */
export function lowMemoryOptions<T extends { extra?: object }>(sessionOptions?: T): T & { extra: object };

/** The tier table of a nested model's bytes: list its tiers without creating a session. */
export function readNestedMetadata(bytes: Uint8Array | ArrayBuffer): NestedMetadata;

/** A manifest entry's label: the tier name for fp32, `NAME:PRECISION` otherwise. */
export function entryLabel(entry: Pick<ManifestEntry, "name" | "precision">): string;

/** The manifest entry labelled `label` (`g0.6`, `g0.6:int8`); throws listing the labels. */
export function loadManifestEntry(manifest: Manifest, label: string): ManifestEntry;

/** The nested files of a manifest, one per precision, in table order. */
export function manifestFiles(manifest: Manifest): { file: string; precision: string; sha256: string; size: number | null }[];

/** One nested model's session and tier table. */
export class NestedModel {
  constructor(ort: OrtModule, session: OrtSession, metadata: NestedMetadata);
  readonly ort: OrtModule;
  readonly session: OrtSession;
  readonly metadata: NestedMetadata;
  /** The tier table, in `tier` order. */
  readonly tiers: TierInfo[];
  /** The `tier` input value of a tier name or index (negative counts from the end). */
  tierIndex(nameOrIndex: string | number): number;
  /** The logits of `tier` on `batch` images of the model's input shape (NCHW, flat). */
  run(tier: string | number, data: Float32Array, batch?: number): Promise<{ logits: Float32Array; dims: readonly number[] }>;
}

/** Options of {@link loadNestedModel}. */
export interface LoadOptions {
  /** The manifest's sha256 (hex) of the file: checked before any session is created. */
  sha256?: string;
  /** The manifest's `bytes` of the file: checked before the hash. */
  size?: number | null;
  /** Passed to `InferenceSession.create`. */
  sessionOptions?: object;
  /** One copy of the shared weights in the session (constant folding off; slower runs). */
  lowMemory?: boolean;
}

/** A NestedModel from the bytes of a nested `.onnx` file, checked first when `size` / `sha256`
 * are given; a model keeping a tensor in external data is refused. */
export function loadNestedModel(ort: OrtModule, bytes: Uint8Array | ArrayBuffer, options?: LoadOptions): Promise<NestedModel>;
