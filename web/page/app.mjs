// The page of `nefl-zoo serve EXPORT_DIR`: runs a nested export (one .onnx file per precision
// holding every tier, chosen by its `tier` input) with onnxruntime-web's WASM backend.
//
// It loads /export/manifest.json, fetches the precision's nested file and refuses it unless its
// sha256 is the manifest's, lists the tiers the file's metadata names, classifies the bundled
// samples (/samples.json) with any tier, serves requests adaptively under a deadline with
// web/lib/policy.mjs, and measures every entry's latency into the latency-table JSON that
// `nefl-zoo select --latency-table` reads (nefl_zoo/runtime/latency.py).
//
// window.nefl is a small hook for tests (tests/test_browser.py): `ready` resolves to
// {ok, error} once the first model is loaded (or refused), and the functions below return
// plain JSON-able results.

import * as ort from "/ort/ort.wasm.min.mjs";
import { entryLabel, loadNestedModel, sha256Hex } from "/lib/nested.mjs";
import { AdaptivePolicy, Candidate, Deadline } from "/lib/policy.mjs";

const params = new URLSearchParams(location.search);
// Threads need cross-origin isolation, which a browser grants only to a secure context
// (localhost, or `serve --tls`): over plain HTTP from another device the page runs on one thread.
const ISOLATED = globalThis.crossOriginIsolated === true;
const ASKED_THREADS = Math.max(0, Math.floor(Number(params.get("threads")) || 0));
ort.env.wasm.wasmPaths = "/ort/";
ort.env.wasm.numThreads = ISOLATED ? ASKED_THREADS || Math.min(4, Math.ceil((navigator.hardwareConcurrency || 1) / 2)) : 1;
ort.env.logLevel = "error";

const LATENCY_SCHEMA = "nefl-zoo-latency-table";
const LATENCY_VERSION = 1;
const COLOURS = ["#0969da", "#1a7f37", "#bf8700", "#8250df", "#cf222e", "#1b7c83", "#953800", "#6e7781"];

const $ = (id) => document.getElementById(id);
const state = {
  manifest: null, // manifest.json as parsed
  manifestSha256: null, // of its bytes as served
  samples: null, // {images: Float32Array, labels, shape, count, source, random}
  models: new Map(), // precision -> Promise<NestedModel> (verified)
  precision: null, // the precision shown
  latency: null, // the latency table object, once measured
  spread: new Map(), // label -> {median, p25, p75, p95} of its measured runs
  predictions: new Map(), // label -> {tier, precision, index, argmax, logits, dims, accuracy}
};

// ---------------------------------------------------------------------------------------------
// small helpers

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
  window.nefl.error = message;
}

async function fetchOk(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status} ${response.statusText}`);
  return response;
}

const labelOf = entryLabel; // `g0.6` for FP32, `g0.6:int8` otherwise
const fmt = (x, digits = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
const percent = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
const shortSha = (sha) => `${sha.slice(0, 12)}…`;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

/** Python's statistics.median and latency.median_p95's nearest-rank 95th percentile, with the
 * nearest-rank quartiles (the spread shown beside the median). */
function latencyStats(times) {
  const s = [...times].sort((a, b) => a - b);
  const mid = Math.floor(s.length / 2);
  const rank = (q) => s[Math.max(0, Math.ceil(q * s.length) - 1)];
  return { median: s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2, p25: rank(0.25), p75: rank(0.75), p95: rank(0.95) };
}

/** A seeded normal batch (mulberry32 + Box-Muller), so that every run times the same input. */
function randomInput(size, seed = 0) {
  let a = seed >>> 0;
  const uniform = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const out = new Float32Array(size);
  for (let i = 0; i < size; i++) out[i] = Math.sqrt(-2 * Math.log(1 - uniform())) * Math.cos(2 * Math.PI * uniform());
  return out;
}

function argmaxRows(logits, rows, classes) {
  const out = new Array(rows);
  for (let r = 0; r < rows; r++) {
    let best = 0;
    for (let k = 1; k < classes; k++) if (logits[r * classes + k] > logits[r * classes + best]) best = k;
    out[r] = best;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// the export: manifest, samples, models

function entries(precision = null) {
  return state.manifest.tiers.filter((t) => precision === null || t.precision === precision);
}

function precisions() {
  return [...new Set(state.manifest.tiers.map((t) => t.precision))];
}

function inputSize() {
  return state.manifest.input.shape.reduce((a, b) => a * b, 1);
}

/** The verified model of `precision` (fetched and checked once; a refused file stays refused). */
function model(precision) {
  if (!state.models.has(precision)) state.models.set(precision, loadModel(precision));
  return state.models.get(precision);
}

async function loadModel(precision) {
  const mine = entries(precision);
  const files = new Set(mine.map((t) => `${t.file} ${t.sha256}`));
  if (files.size !== 1) {
    throw new Error(`manifest.json: the ${precision} entries name ${files.size} different files; a nested export has one per precision`);
  }
  const { file, sha256 } = mine[0];
  const bytes = new Uint8Array(await (await fetchOk(`/export/${encodeURIComponent(file)}`)).arrayBuffer());
  const got = await sha256Hex(bytes);
  if (got !== sha256) {
    throw new Error(
      `${file}: sha256 ${shortSha(got)} is not the manifest's ${shortSha(sha256)}: the file was modified or ` +
        `re-exported without its manifest; refusing to run it`,
    );
  }
  const nested = await loadNestedModel(ort, bytes, { sha256, size: mine[0].bytes });
  for (const entry of mine) {
    const tier = nested.tiers.find((t) => t.index === entry.index);
    if (!tier || tier.name !== entry.name) {
      const found = tier ? `'${tier.name}'` : "missing";
      throw new Error(`${file}: tier ${entry.index} is ${found} in the file but '${entry.name}' in manifest.json`);
    }
  }
  return { precision, file, sha256, bytes: bytes.length, nested };
}

/** The logits of `images` (count x C x H x W, flat) under tier `index`, in chunks of the
 * export's fixed batch (zero-padded) when it has one. */
async function runAll(loaded, index, images, count) {
  const size = inputSize();
  const classes = state.manifest.output.num_classes;
  const fixed = state.manifest.input.batch;
  if (!fixed) {
    const { logits } = await loaded.nested.run(index, images, count);
    return Float32Array.from(logits);
  }
  const out = new Float32Array(count * classes);
  for (let start = 0; start < count; start += fixed) {
    const n = Math.min(fixed, count - start);
    const chunk = new Float32Array(fixed * size);
    chunk.set(images.subarray(start * size, (start + n) * size));
    const { logits } = await loaded.nested.run(index, chunk, fixed);
    out.set(Float32Array.prototype.slice.call(logits, 0, n * classes), start * classes);
  }
  return out;
}

async function loadSamples() {
  const data = await (await fetchOk("/samples.json")).json();
  if (data.error) throw new Error(`/samples.json: ${data.error}`);
  const raw = Uint8Array.from(atob(data.data), (c) => c.charCodeAt(0));
  const images = new Float32Array(raw.buffer);
  return { ...data, images };
}

// ---------------------------------------------------------------------------------------------
// model section: precision chooser and tier table

function renderTiers() {
  const body = $("tiers").querySelector("tbody");
  body.replaceChildren();
  const measured = new Map((state.latency?.entries ?? []).map((e) => [e.label, e]));
  for (const entry of entries(state.precision).sort((a, b) => a.index - b.index)) {
    const label = labelOf(entry);
    const prediction = state.predictions.get(label);
    const timing = measured.get(label);
    body.append(
      el("tr", { "data-label": label },
        el("td", {}, entry.index), el("td", {}, label),
        el("td", { class: "num" }, entry.params.toLocaleString("en")),
        el("td", { class: "num" }, fmt(entry.macs_ratio)),
        el("td", { class: "num" }, percent(entry.accuracy)),
        el("td", { class: "num" }, prediction ? percent(prediction.accuracy) : "–"),
        el("td", { class: "num" }, timing ? fmt(timing.median_ms) : "–"),
        el("td", { class: "num" }, timing ? fmt(timing.p95_ms) : "–")),
    );
  }
  const tierSelect = $("tier");
  const chosen = tierSelect.value;
  tierSelect.replaceChildren(...entries(state.precision).map((e) => el("option", { value: String(e.index) }, labelOf(e))));
  if ([...tierSelect.options].some((o) => o.value === chosen)) tierSelect.value = chosen;
  else tierSelect.value = tierSelect.options[tierSelect.options.length - 1]?.value ?? "";
}

async function choosePrecision(precision) {
  if (adaptive.running) { // its policy's candidates are the other precision's entries
    adaptive.running = false;
    $("adaptive-run").textContent = "Start";
  }
  state.precision = precision;
  $("precision").value = precision;
  $("file-status").textContent = `loading ${entries(precision)[0].file}…`;
  renderTiers();
  showPrediction();
  try {
    const loaded = await model(precision);
    $("file-status").replaceChildren(
      el("span", {}, `${loaded.file}, ${(loaded.bytes / 2 ** 20).toFixed(2)} MB, sha256 ${shortSha(loaded.sha256)} `),
      el("span", { class: "ok" }, "verified"),
      `; ${loaded.nested.tiers.length} tiers in the file`,
    );
    for (const b of ["classify-run", "adaptive-run", "adaptive-remeasure", "latency-run"]) $(b).disabled = false;
    $("tier").disabled = false;
    return loaded;
  } catch (error) {
    $("file-status").replaceChildren(el("span", { class: "bad" }, "refused"));
    for (const b of ["classify-run", "adaptive-run", "adaptive-remeasure"]) $(b).disabled = true;
    showError(error.message);
    throw error;
  }
}

// ---------------------------------------------------------------------------------------------
// classify section

function drawSample(canvas, images, i, shape) {
  const [channels, h, w] = shape.slice(1);
  const size = channels * h * w;
  const pixels = images.subarray(i * size, (i + 1) * size);
  let lo = Infinity, hi = -Infinity;
  for (const v of pixels) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  const scale = hi > lo ? 255 / (hi - lo) : 0;
  canvas.width = w;
  canvas.height = h;
  const context = canvas.getContext("2d");
  const image = context.createImageData(w, h);
  for (let p = 0; p < h * w; p++) {
    for (let c = 0; c < 3; c++) {
      const v = pixels[(channels === 3 ? c : 0) * h * w + p];
      image.data[4 * p + c] = (v - lo) * scale;
    }
    image.data[4 * p + 3] = 255;
  }
  context.putImageData(image, 0, 0);
}

const className = (k) => state.manifest.class_names?.[k] ?? String(k);

function renderSamples(prediction = null) {
  const { images, labels, shape, count } = state.samples;
  const grid = $("samples");
  grid.replaceChildren();
  for (let i = 0; i < count; i++) {
    const canvas = el("canvas");
    drawSample(canvas, images, i, shape);
    const predicted = prediction ? prediction.argmax[i] : null;
    const verdict = prediction && labels ? (predicted === labels[i] ? "right" : "wrong") : "";
    const caption = prediction ? className(predicted) : "?";
    const title = labels ? `label ${className(labels[i])}` : "no label";
    grid.append(el("div", { class: `sample ${verdict}`, title }, canvas, el("span", {}, caption)));
  }
}

/** Every tier of `precision` on every sample: label -> {argmax, logits (flat), dims, accuracy}. */
async function classifyPrecision(precision) {
  const loaded = await model(precision);
  const { images, labels, count } = state.samples;
  const classes = state.manifest.output.num_classes;
  const out = {};
  for (const entry of entries(precision)) {
    const logits = await runAll(loaded, entry.index, images, count);
    const argmax = argmaxRows(logits, count, classes);
    const accuracy = labels ? argmax.filter((p, i) => p === labels[i]).length / count : null;
    const result = {
      tier: entry.name, precision, index: entry.index, argmax, logits: Array.from(logits), dims: [count, classes], accuracy,
    };
    state.predictions.set(labelOf(entry), result);
    out[labelOf(entry)] = result;
  }
  return out;
}

/** The grid and the status line of the tier chosen now: its predictions, or that it has none
 * yet (never another tier's: the status always names the tier whose grid is shown). */
function showPrediction(note = "") {
  const entry = entries(state.precision).find((e) => String(e.index) === $("tier").value);
  const prediction = entry && state.predictions.get(labelOf(entry));
  if (state.samples) renderSamples(prediction ?? null);
  let text = "";
  if (entry && !prediction) text = `${labelOf(entry)}: not classified yet (Classify runs every tier)`;
  else if (prediction && prediction.accuracy === null) text = `${labelOf(entry)}: predicted (no labels: random inputs)`;
  else if (prediction) text = `${labelOf(entry)}: ${percent(prediction.accuracy)} right on ${state.samples.count} samples`;
  $("classify-status").textContent = text + note;
}

async function classify() {
  $("classify-status").textContent = "running…";
  const started = performance.now();
  await classifyPrecision(state.precision);
  renderTiers();
  showPrediction(`; every tier in ${(performance.now() - started).toFixed(0)} ms`);
}

// ---------------------------------------------------------------------------------------------
// latency section

function machine() {
  const ua = navigator.userAgentData;
  return {
    processor: ua?.platform ? `${ua.platform} (${navigator.platform})` : navigator.platform || "unknown",
    platform: navigator.userAgent,
    cpu_count: Math.max(1, navigator.hardwareConcurrency || 1),
    onnxruntime: `onnxruntime-web ${ort.env.versions?.web ?? "unknown"}`,
    provider: "wasm",
  };
}

/** Every entry of every precision timed at batch 1 (the fixed batch if the export has one),
 * `warmup` untimed rounds then `runs` rounds, each round running every entry once in turn. */
async function measureLatency({ runs = 30, warmup = 5 } = {}) {
  if (!(Number.isInteger(runs) && runs >= 1)) throw new Error(`runs: must be an integer >= 1, got ${runs}`);
  if (!(Number.isInteger(warmup) && warmup >= 0)) throw new Error(`warmup: must be an integer >= 0, got ${warmup}`);
  const batch = state.manifest.input.batch ?? 1;
  const input = randomInput(batch * inputSize());
  const calls = [];
  for (const precision of precisions()) {
    const loaded = await model(precision); // throws for a refused file: no table without it
    for (const entry of entries(precision)) calls.push({ label: labelOf(entry), entry, loaded, times: [] });
  }
  for (let round = 0; round < warmup + runs; round++) {
    for (const call of calls) {
      const start = performance.now();
      await call.loaded.nested.run(call.entry.index, input, batch);
      const ms = performance.now() - start;
      if (round >= warmup) call.times.push(ms);
    }
    if (round % 10 === 9) {
      $("latency-status").textContent = `round ${round + 1} of ${warmup + runs}…`;
      await new Promise((resolve) => setTimeout(resolve, 0)); // let the page repaint
    }
  }
  state.latency = {
    schema: LATENCY_SCHEMA,
    version: LATENCY_VERSION,
    model: state.manifest.model,
    manifest_sha256: state.manifestSha256,
    machine: machine(),
    threads: ort.env.wasm.numThreads,
    runs,
    warmup,
    entries: calls.map(({ label, loaded, times }) => {
      const { median, p95 } = latencyStats(times);
      return { label, sha256: loaded.sha256, batch, median_ms: median, p95_ms: p95, runs };
    }),
  };
  state.spread = new Map(calls.map(({ label, times }) => [label, latencyStats(times)]));
  return state.latency;
}

function renderLatency() {
  const body = $("latency-table").querySelector("tbody");
  body.replaceChildren(...state.latency.entries.map((e) => {
    const { p25, p75 } = state.spread.get(e.label);
    return el("tr", {}, el("td", {}, e.label), el("td", { class: "num" }, fmt(e.median_ms)),
      el("td", { class: "num" }, `${fmt(p25)}–${fmt(p75)}`), el("td", { class: "num" }, fmt(e.p95_ms)), el("td", { class: "num" }, e.runs));
  }));
  renderTiers();
  setDeadlineRange();
}

async function latencyClicked() {
  $("latency-run").disabled = true;
  $("latency-status").textContent = "measuring…";
  try {
    await window.nefl.measureLatency({ runs: Number($("runs").value), warmup: Number($("warmup").value) });
  } catch (error) {
    $("latency-status").textContent = "";
    showError(error.message);
  } finally {
    $("latency-run").disabled = false;
  }
}

function downloadLatency() {
  const blob = new Blob([JSON.stringify(state.latency, null, 2) + "\n"], { type: "application/json" });
  const link = el("a", { href: URL.createObjectURL(blob), download: `latency-${state.manifest.model}-browser.json` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

// ---------------------------------------------------------------------------------------------
// adaptive section

const adaptive = { running: false, policy: null, log: [], switches: [], colours: new Map(), deadlineSet: false, loop: null };

/** The current precision's entries as the policy's candidates, expected at this browser's medians. */
function candidates() {
  const measured = new Map(state.latency.entries.map((e) => [e.label, e.median_ms]));
  return entries(state.precision).map((e) => new Candidate({
    label: labelOf(e), accuracy: e.accuracy, macs: e.macs, expectedMs: Math.max(measured.get(labelOf(e)), 1e-3),
  }));
}

function setDeadlineRange() {
  const mine = entries(state.precision).map((e) => state.latency.entries.find((x) => x.label === labelOf(e)).median_ms);
  const slider = $("deadline");
  const [lo, hi] = [Math.min(...mine), Math.max(...mine)];
  // first: a deadline the middle tier meets with room to probe back up to it after a load
  const middle = [...mine].sort((a, b) => a - b)[Math.floor((mine.length - 1) / 2)];
  const chosen = adaptive.deadlineSet ? Number(slider.value) : middle / 0.7;
  slider.min = Math.max(lo * 0.5, 1e-3).toFixed(3); // Deadline.ms is at least a microsecond
  slider.max = (hi * 3).toFixed(3);
  slider.step = (lo / 20).toPrecision(2);
  slider.value = Math.min(Math.max(chosen, Number(slider.min)), hi * 3).toFixed(3);
  adaptive.deadlineSet = true;
  showDeadline();
}

function showDeadline() {
  $("deadline-value").textContent = `${Number($("deadline").value).toFixed(3)} ms`;
  $("load-value").textContent = `×${Number($("load").value).toFixed(2)}`;
}

function newPolicy() {
  const deadline = new Deadline({ ms: Number($("deadline").value) });
  adaptive.policy = new AdaptivePolicy(candidates(), deadline);
  adaptive.policy.ladder.forEach((label, i) => adaptive.colours.set(label, COLOURS[i % COLOURS.length]));
  $("adaptive-legend").replaceChildren(
    ...adaptive.policy.ladder.map((label) => el("span", { style: `--swatch: ${adaptive.colours.get(label)}` }, label)),
    el("em", { class: "muted" }, "each bar: one request's ms, coloured by the tier that served it; dashed: the deadline"),
  );
  const reason = `deadline ${deadline.ms.toFixed(3)} ms: start`;
  adaptive.switches.push({ at: performance.now(), from: null, to: adaptive.policy.current, reason });
  $("ladder-status").textContent = explainLadder();
}

const ms3 = (x) => `${x.toPrecision(3)} ms`;

/** The ladder the policy switches along, each step's median and spread in this browser, and
 * why each entry left out of it is left out. */
function explainLadder() {
  const policy = adaptive.policy;
  const all = candidates();
  const byLabel = new Map(all.map((c) => [c.label, c]));
  const spread = (label) => {
    const s = state.spread.get(label);
    return s ? ` (${fmt(s.p25)}–${fmt(s.p75)})` : "";
  };
  const steps = policy.ladder.map((label) => `${label} ${ms3(byLabel.get(label).expectedMs)}${spread(label)}`);
  const rank = (c) => c.accuracy ?? c.macs;
  const left = all.filter((c) => !policy.ladder.includes(c.label)).map((c) => {
    const better = all.find((o) => o !== c && o.expectedMs <= c.expectedMs && rank(o) >= rank(c));
    return better
      ? `${c.label} (${better.label} is as fast and as accurate)`
      : `${c.label} (within ×${policy.deadline.minSpeedup} of a neighbour's latency)`;
  });
  return `Ladder, fastest first, median (p25–p75) in this browser: ${steps.join(" → ")}` +
    (left.length ? `; left out: ${left.join(", ")}` : "") +
    (policy.ladder.length === 1 ? ". One step: the policy has nothing to switch between." : ".");
}

/** Why the policy serves what it serves now and does not switch (empty while it has no
 * measurement since its last switch). */
function explainStay() {
  const policy = adaptive.policy;
  const recent = adaptive.log.slice(-policy.deadline.recent);
  if (!recent.length) return "";
  const ladder = policy.ladder;
  const at = ladder.indexOf(policy.current);
  const budget = policy.deadline.headroom * policy.deadline.ms;
  const over = recent.filter((r) => r.ms > r.deadline).length;
  if (ladder.length === 1) return `Not switching: ${policy.current} is the only step of the ladder.`;
  if (at === 0 && over) {
    return `Not switching: ${policy.current} is the fastest step and still over the deadline ` +
      `(${over} of the last ${recent.length} requests); no faster tier is left.`;
  }
  if (at === ladder.length - 1) return `Not switching: ${policy.current} is the most accurate step; nothing to probe up to.`;
  const up = ladder[at + 1];
  const expected = policy.expectedMs(up);
  return expected > budget * policy.deadline.upMargin
    ? `Not switching up: ${up} is expected at ${ms3(expected)} under the current load (×${policy.slowdown.toFixed(2)}), ` +
      `over ${ms3(budget * policy.deadline.upMargin)} (the budget ${ms3(budget)} less its margin).`
    : `${up} is expected at ${ms3(expected)}: the policy probes it after ${policy.deadline.probeAfterS * policy.backoff} s without a miss.`;
}

async function adaptiveLoop() {
  const input = state.samples.images.subarray(0, inputSize());
  const batch = state.manifest.input.batch ?? 1;
  const request = batch === 1 ? input : new Float32Array(batch * inputSize()).fill(0).map((_, i) => input[i % input.length]);
  const loaded = await model(state.precision);
  const byLabel = new Map(entries(state.precision).map((e) => [labelOf(e), e]));
  while (adaptive.running) {
    const policy = adaptive.policy;
    const before = policy.switches.length;
    const label = policy.choose(); // may probe one step up
    const start = performance.now();
    await loaded.nested.run(byLabel.get(label).index, request, batch);
    let ms = performance.now() - start;
    const load = Number($("load").value);
    if (load > 1) {
      const until = start + ms * load; // a busy device: every request takes `load` times as long
      while (performance.now() < until) { /* spin */ }
      ms = performance.now() - start;
    }
    policy.observe(label, ms); // may step down
    adaptive.log.push({ label, ms, deadline: policy.deadline.ms });
    for (const s of policy.switches.slice(before)) adaptive.switches.push(s);
    if (adaptive.log.length % 4 === 0) renderAdaptive();
    await new Promise((resolve) => setTimeout(resolve, 4));
  }
  renderAdaptive();
}

function renderAdaptive() {
  const canvas = $("adaptive-chart");
  const context = canvas.getContext("2d");
  const { width, height } = canvas;
  const shown = adaptive.log.slice(-180);
  const top = 2.5 * Math.max(...shown.map((r) => r.deadline), 1e-6); // slower requests are clipped
  context.clearRect(0, 0, width, height);
  const bar = width / 180;
  shown.forEach((r, i) => {
    const h = Math.min(r.ms / top, 1) * height;
    context.fillStyle = adaptive.colours.get(r.label) ?? "#888";
    context.fillRect(i * bar, height - h, Math.max(bar - 1, 1), h);
  });
  if (shown.length) {
    const y = height - (shown.at(-1).deadline / top) * height;
    context.strokeStyle = "#cf222e";
    context.setLineDash([6, 4]);
    context.beginPath();
    context.moveTo(0, y);
    context.lineTo(width, y);
    context.stroke();
    context.setLineDash([]);
  }
  const policy = adaptive.policy;
  const counts = {};
  for (const r of adaptive.log) counts[r.label] = (counts[r.label] ?? 0) + 1;
  const missed = adaptive.log.filter((r) => r.ms > r.deadline).length;
  $("adaptive-status").textContent = policy
    ? `${adaptive.log.length} requests; now serving ${policy.current} (slowdown ×${policy.slowdown.toFixed(2)}); ` +
      `served: ${Object.entries(counts).map(([l, n]) => `${l} ${n}`).join(", ")}; over the deadline: ${missed}`
    : "";
  $("switches").replaceChildren(...adaptive.switches.slice(-30).map((s) =>
    el("li", {}, s.from ? `${s.from} → ${s.to}: ${s.reason}` : `${s.to}: ${s.reason}`)));
  for (const row of $("tiers").querySelectorAll("tbody tr")) row.classList.toggle("current", row.dataset.label === policy?.current);
  if (policy) $("ladder-status").textContent = `${explainLadder()} ${explainStay()}`;
}

/** Measure this browser's latencies with the latency section's runs and warm-up (30 and 5 by
 * default: enough for a stable median on a busy device). */
async function measureForPolicy() {
  $("adaptive-status").textContent = "measuring this browser's latencies…";
  await window.nefl.measureLatency({ runs: Number($("runs").value), warmup: Number($("warmup").value) });
}

async function remeasureClicked() {
  const wasRunning = adaptive.running;
  adaptive.running = false;
  $("adaptive-remeasure").disabled = true;
  try {
    await adaptive.loop; // the request in flight finishes first
    await measureForPolicy();
    newPolicy();
    renderAdaptive();
    if (wasRunning) startAdaptive();
  } finally {
    $("adaptive-remeasure").disabled = false;
  }
}

function startAdaptive() {
  adaptive.running = true;
  $("adaptive-run").textContent = "Stop";
  adaptive.loop = adaptiveLoop().catch((error) => { adaptive.running = false; showError(error.message); });
}

async function adaptiveClicked() {
  if (adaptive.running) {
    adaptive.running = false;
    $("adaptive-run").textContent = "Start";
    return;
  }
  if (!state.latency) await measureForPolicy();
  newPolicy();
  startAdaptive();
}

/** Python's snake_case fields as policy.mjs's camelCase ones. */
const camel = (obj) => Object.fromEntries(Object.entries(obj).map(([k, v]) => [k.replace(/_(.)/g, (_, c) => c.toUpperCase()), v]));

/** Replay tests/data/policy_traces.json's cases through policy.mjs (a clock at each step's
 * time) and list every decision that differs from Python's. */
function replayTraces(traces) {
  const mismatches = [];
  let steps = 0;
  const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
  for (const c of traces.cases) {
    let now = 0;
    const policy = new AdaptivePolicy(c.candidates.map((x) => new Candidate(camel(x))), new Deadline(camel(c.deadline)), () => now);
    const miss = (what, got, want) => mismatches.push({ case: c.name, what, got, want });
    if (!same(policy.ladder, c.ladder)) miss("ladder", policy.ladder, c.ladder);
    if (policy.current !== c.start) miss("start", policy.current, c.start);
    c.steps.forEach((step, n) => {
      now = step.at;
      steps += 1;
      if (step.op === "choose") {
        const got = policy.choose();
        if (got !== step.expect) miss(`step ${n} choose`, got, step.expect);
      } else {
        policy.observe(step.label, step.ms);
        if (policy.current !== step.current) miss(`step ${n} observe`, policy.current, step.current);
      }
    });
    if (!same(policy.switches, c.switches)) miss("switches", policy.switches, c.switches);
    if (policy.slowdown !== c.slowdown) miss("slowdown", policy.slowdown, c.slowdown);
    if (policy.backoff !== c.backoff) miss("backoff", policy.backoff, c.backoff);
  }
  return { cases: traces.cases.length, steps, mismatches };
}

// ---------------------------------------------------------------------------------------------
// start

async function start() {
  const manifestBytes = new Uint8Array(await (await fetchOk("/export/manifest.json")).arrayBuffer());
  state.manifestSha256 = await sha256Hex(manifestBytes);
  state.manifest = JSON.parse(new TextDecoder().decode(manifestBytes));
  const m = state.manifest;
  if (m.format !== "nested") throw new Error(`manifest.json: format '${m.format}'; this page runs nested exports`);
  const shape = `${m.input.shape.join("×")}`;
  $("summary").textContent = `${m.model}: ${new Set(m.tiers.map((t) => t.name)).size} tiers in one file per precision ` +
    `(${precisions().join(", ")}); input ${shape}${m.input.dataset ? ` (${m.input.dataset})` : ""}, ${m.output.num_classes} classes`;
  const choices = $("precision");
  choices.replaceChildren(...precisions().map((p) => el("option", { value: p }, p)));
  choices.disabled = false;
  choices.addEventListener("change", () => choosePrecision(choices.value).catch(() => {}));
  const first = precisions().includes("fp32") ? "fp32" : precisions()[0];
  model(first).catch(() => {}); // fetched, verified and compiled while the samples load (errors: below)
  state.samples = await loadSamples();
  $("samples-source").textContent = state.samples.random
    ? `No test images: ${state.samples.source}. Accuracy cannot be measured.`
    : `Samples: ${state.samples.source}.`;
  renderSamples();
  const threads = ISOLATED ? "cross-origin isolated"
    : `not cross-origin isolated (${isSecureContext ? "" : "no secure context: plain HTTP from another device; `nefl-zoo serve --tls` gives one; "}` +
      `${ASKED_THREADS > 1 ? `${ASKED_THREADS} threads asked, ` : ""}one thread)`;
  $("footer").textContent = `onnxruntime-web ${ort.env.versions?.web ?? ""} (WASM, ${ort.env.wasm.numThreads} thread(s)); ` +
    `${threads}; manifest sha256 ${shortSha(state.manifestSha256)}`;
  await choosePrecision(first);
}

$("classify-run").addEventListener("click", () => classify().catch((e) => showError(e.message)));
$("tier").addEventListener("change", () => showPrediction());
$("latency-run").addEventListener("click", latencyClicked);
$("latency-download").addEventListener("click", downloadLatency);
$("adaptive-run").addEventListener("click", () => adaptiveClicked().catch((e) => showError(e.message)));
$("adaptive-remeasure").addEventListener("click", () => remeasureClicked().catch((e) => showError(e.message)));
$("deadline").addEventListener("input", () => {
  showDeadline();
  if (adaptive.running) newPolicy(); // a new deadline: a new policy from the same latencies
});
$("load").addEventListener("input", showDeadline);

window.nefl = {
  error: null,
  state,
  ready: null,
  /** Every tier of every precision (or of `only`) on the samples: label -> result. */
  async predictAll(only = null) {
    const out = {};
    for (const p of only ? [only] : precisions()) Object.assign(out, await classifyPrecision(p));
    renderTiers();
    return out;
  },
  replayTraces,
  /** Measure, show and return the latency table. */
  async measureLatency(options) {
    const table = await measureLatency(options);
    renderLatency();
    $("latency-download").disabled = false;
    $("latency-status").textContent = `${table.entries.length} entries, ${table.runs} runs each at batch ${table.entries[0].batch}, ` +
      `${table.threads} thread(s), ${crossOriginIsolated ? "" : "not "}cross-origin isolated`;
    return table;
  },
  choosePrecision,
  classify,
  /** The adaptive mode's requests so far: the label that served each and its ms, the switches. */
  adaptive: () => ({
    running: adaptive.running,
    ladder: adaptive.policy?.ladder ?? [],
    requests: adaptive.log.map(({ label, ms }) => ({ label, ms })),
    switches: adaptive.switches.map(({ from, to, reason }) => ({ from, to, reason })),
    why: $("ladder-status").textContent,
  }),
  samples: () => ({ count: state.samples.count, shape: state.samples.shape, labels: state.samples.labels, random: state.samples.random }),
};
window.nefl.ready = start().then(
  () => ({ ok: true, error: null }),
  (error) => {
    showError(error.message);
    return { ok: false, error: error.message };
  },
);
