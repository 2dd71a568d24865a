"""Run exported tiers with onnxruntime and pick the (tier, precision) that fits a device budget.

Depends only on numpy, onnxruntime, pydantic and the standard library (never torch)::

    rt = TierRuntime("exports/resnet20/manifest.json")
    choice = rt.select(latency_ms=5.0)         # Selection(tier="g0.6", precision="int8", ...)
    logits = rt.run(images)                    # runs the selected entry ("auto")
    logits = rt.run(images, tier="g1.0")       # or any tier's FP32 file by its name,
    logits = rt.run(images, tier="g1.0:int8")  # or any entry by its label; sessions stay cached

Every tier file (of any precision) is read once into memory (:func:`read_tier`): its path must stay inside the
manifest's folder (no ``..``, no symlink out of it), its bytes are checked against the
manifest's sha256, and those same bytes, never the path again, are handed to onnxruntime
(:func:`session_from_bytes`), so a file swapped after the check is never run. A session's
input and output shapes are checked against the manifest's ``input.shape`` and
``output.num_classes`` when it is created.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnxruntime as ort

from .memory import WORKING_SET_FACTOR, check_batch_memory
from .manifest import MANIFEST_NAME, PRECISIONS, Manifest, ManifestError, TierEntry, load_manifest
from .timing import interleaved_median_ms

CPU_PROVIDER = "CPUExecutionProvider"
MAX_TIER_BYTES = 2**31  # protobuf's limit: a self-contained .onnx file is never larger


class NoTierFits(ValueError):
    """No tier of the manifest meets the budget."""


@dataclass(frozen=True)
class Selection:
    """The (tier, precision) :meth:`TierRuntime.select` chose and why; ``fitting`` holds the
    labels of every entry within the budget."""

    tier: str
    reason: str
    fitting: tuple[str, ...]
    precision: str
    label: str  # the entry's label: the tier name for FP32, else NAME:PRECISION


def read_tier(path: str | Path, sha256: str, root: str | Path | None = None) -> bytes:
    """The bytes of a tier file, read once and checked against ``sha256``.

    With ``root`` (the manifest's folder), the path, resolved through every symlink, must lie
    inside it. Raises :class:`ManifestError` naming the file when it is missing, outside
    ``root``, not a regular file, too large or does not match the hash.
    """
    path = Path(path)
    if root is not None:
        resolved, folder = path.resolve(), Path(root).resolve()
        if not resolved.is_relative_to(folder):
            raise ManifestError(
                str(path), "", f"resolves to {resolved}, outside the manifest's folder {folder} (refused; re-export)"
            )
        path = resolved  # opened below without following a symlink swapped in since
    # O_NONBLOCK: a FIFO in the tier's place is refused below instead of blocking the open
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ManifestError(str(path), "", "tier file is missing (re-export the model)") from None
    except OSError as exc:
        raise ManifestError(str(path), "", f"cannot read the tier file ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # checked before fdopen, which refuses a directory itself
        os.close(fd)
        raise ManifestError(str(path), "", "not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_TIER_BYTES + 1)
    if len(data) > MAX_TIER_BYTES:
        raise ManifestError(str(path), "", "larger than 2 GiB, which no self-contained .onnx file is")
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise ManifestError(
            str(path),
            "",
            f"sha256 {actual[:12]}... does not match the manifest's {sha256[:12]}... "
            "(the file was modified or corrupted; re-export it)",
        )
    return data


def session_from_bytes(
    model: bytes, source: str, providers: tuple[str, ...] = (CPU_PROVIDER,), threads: int | None = None
) -> ort.InferenceSession:
    """An onnxruntime session for the serialized ``model`` (already verified bytes);
    ``source`` names it in a :class:`ManifestError` when onnxruntime cannot load it."""
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(model, options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ManifestError(source, "", f"onnxruntime cannot load the model ({first_line})") from None


def create_session(
    path: str | Path,
    sha256: str,
    providers: tuple[str, ...] = (CPU_PROVIDER,),
    threads: int | None = None,
    root: str | Path | None = None,
) -> ort.InferenceSession:
    """An onnxruntime session for the tier file ``path``: read once (:func:`read_tier`, inside
    ``root`` when given), checked against ``sha256``, and those bytes loaded; ``threads``
    caps onnxruntime's intra-op threads (default: one per physical core)."""
    return session_from_bytes(read_tier(path, sha256, root), str(path), providers, threads)


class TierRuntime:
    """The tiers of one manifest, loaded lazily and cached, and a budget-driven selector.

    Args:
        manifest_path: ``manifest.json`` or the export directory holding it.
        providers: onnxruntime execution providers, in order of preference.
        threads: onnxruntime intra-op threads per session (default: one per physical core).
    """

    def __init__(
        self, manifest_path: str | Path, providers: tuple[str, ...] = (CPU_PROVIDER,), threads: int | None = None
    ):
        path = Path(manifest_path)
        self.manifest_path = path / MANIFEST_NAME if path.is_dir() else path
        self.manifest: Manifest = load_manifest(self.manifest_path)
        self.root = self.manifest_path.parent  # tier files must resolve inside it
        self.providers = tuple(providers)
        self.threads = threads
        self._sessions: dict[str, ort.InferenceSession] = {}
        self.selection: Selection = self.select()

    def session(self, tier: str, precision: str | None = None) -> ort.InferenceSession:
        """The (cached) session of an entry (:meth:`Manifest.tier`: a label, or a tier name
        and ``precision``); the file's sha256 is checked on first use."""
        entry = self.manifest.tier(tier, precision)
        if entry.label not in self._sessions:
            path = self.root / entry.file
            session = create_session(path, entry.sha256, self.providers, self.threads, root=self.root)
            self._check_io(session, str(path))
            self._sessions[entry.label] = session
        return self._sessions[entry.label]

    def _check_io(self, session: ort.InferenceSession, source: str) -> None:
        """:class:`ManifestError` unless the model takes the manifest's input (name, shape,
        batch) and gives ``output.num_classes`` logits."""
        spec, where = self.manifest.input, str(self.manifest_path)
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if len(inputs) != 1 or inputs[0].name != spec.name:
            names = ", ".join(i.name for i in inputs)
            raise ManifestError(where, "input.name", f"{spec.name!r}, but {Path(source).name} takes {names or 'nothing'}")
        shape = list(inputs[0].shape)
        expected = [spec.batch, *spec.shape]
        fixed = [d if isinstance(d, int) else None for d in shape]
        if len(shape) != 4 or any(f is not None and f != e for f, e in zip(fixed[1:], expected[1:])):
            raise ManifestError(where, "input.shape", f"{spec.shape}, but {Path(source).name} takes {shape}")
        if fixed[0] is not None and fixed[0] != spec.batch:
            raise ManifestError(where, "input.batch", f"{spec.batch}, but {Path(source).name} takes a batch of {fixed[0]}")
        out_shape = list(outputs[0].shape) if outputs else []
        classes = out_shape[-1] if out_shape else None
        if isinstance(classes, int) and classes != self.manifest.output.num_classes:
            raise ManifestError(
                where, "output.num_classes", f"{self.manifest.output.num_classes}, but {Path(source).name} gives {classes} logits"
            )

    def select(
        self,
        latency_ms: float | None = None,
        max_macs: float | None = None,
        max_params: float | None = None,
        max_memory_mb: float | None = None,
        batch: int = 1,
        max_file_mb: float | None = None,
        precisions: Sequence[str] | None = None,
    ) -> Selection:
        """Choose the most accurate (tier, precision) within every given budget (the largest
        by MACs when some fitting entry has no measured accuracy; ties go to fewer MACs, then
        the smaller file) and make it the ``"auto"`` tier.

        ``latency_ms`` is compared with the latency measured at export time (at the batch the
        manifest records); ``max_memory_mb`` with :meth:`TierEntry.memory_mb` at ``batch``;
        ``max_file_mb`` with the file's size; ``precisions`` (default: all) restricts the
        entries considered. Raises :class:`NoTierFits` when no entry meets the budget,
        ``ValueError`` for a budget that is negative or not a finite number, a batch below 1,
        or a precision the manifest has no file of.
        """
        budgets = {
            "latency_ms": latency_ms, "max_macs": max_macs, "max_params": max_params,
            "max_memory_mb": max_memory_mb, "max_file_mb": max_file_mb,
        }
        for name, value in budgets.items():
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch: must be an integer >= 1, got {batch}")
        checks: list[tuple[str, Callable[[TierEntry], float], float]] = []
        if latency_ms is not None:
            checks.append((f"latency <= {latency_ms:g} ms", lambda t: t.latency.median_ms, latency_ms))
        if max_macs is not None:
            checks.append((f"MACs <= {max_macs:,.0f}", lambda t: t.macs, max_macs))
        if max_params is not None:
            checks.append((f"params <= {max_params:,.0f}", lambda t: t.params, max_params))
        if max_memory_mb is not None:
            checks.append(
                (f"memory <= {max_memory_mb:g} MB at batch {batch}", lambda t: t.memory_mb(batch), max_memory_mb)
            )
        if max_file_mb is not None:
            checks.append((f"file <= {max_file_mb:g} MB", lambda t: t.weights_mb, max_file_mb))
        tiers = self.entries(precisions)
        fitting = [t for t in tiers if all(cost(t) <= limit for _, cost, limit in checks)]
        budget = " and ".join(label for label, _, _ in checks) or "no budget"
        if not fitting:
            cheapest = min(tiers, key=lambda t: (t.macs, t.weights_mb))
            needs = ", ".join(f"{label.split(' <=')[0]} {cost(cheapest):,.4g}" for label, cost, _ in checks)
            raise NoTierFits(f"no tier fits {budget}; the smallest, {cheapest.label}, needs {needs}")
        if all(t.accuracy is not None for t in fitting):
            best = max(fitting, key=lambda t: (t.accuracy, -t.macs, -t.weights_mb))
            why = f"most accurate (accuracy {best.accuracy:.4g})"
        else:
            best = max(fitting, key=lambda t: (t.macs, t.params, t.weights_mb))
            why = f"largest ({best.macs:,} MACs; accuracy not measured for every tier)"
        lat = best.latency
        reason = (
            f"{best.label}: {why} of {len(fitting)}/{len(tiers)} tiers within {budget}; "
            f"{lat.median_ms:.3g} ms at batch {lat.batch} on export"
        )
        self.selection = Selection(best.name, reason, tuple(t.label for t in fitting), best.precision, best.label)
        return self.selection

    def entries(self, precisions: Sequence[str] | None = None) -> list[TierEntry]:
        """The manifest's entries at ``precisions`` (all when ``None``); ``ValueError`` for a
        precision that is unknown or has no file in the manifest."""
        if precisions is None:
            return list(self.manifest.tiers)
        have = list(dict.fromkeys(t.precision for t in self.manifest.tiers))
        for precision in precisions:
            if precision not in have:
                known = "" if precision in PRECISIONS else f" (precisions are {', '.join(PRECISIONS)})"
                raise ValueError(f"precision {precision}: the manifest has no such files{known}; it has {', '.join(have)}")
        return [t for t in self.manifest.tiers if t.precision in precisions]

    def check_batch(self, batch: np.ndarray) -> np.ndarray:
        """``batch`` as a float32 array of the manifest's input shape; ``ValueError`` if not."""
        spec = self.manifest.input
        batch = np.asarray(batch)
        if not np.issubdtype(batch.dtype, np.floating):
            raise ValueError(f"input must be floating point (float32), got {batch.dtype}")
        expected = tuple(spec.shape)
        if batch.ndim != 4 or tuple(batch.shape[1:]) != expected:
            raise ValueError(f"input shape {tuple(batch.shape)} != (batch, {', '.join(map(str, expected))})")
        if spec.batch is not None and batch.shape[0] != spec.batch:
            raise ValueError(f"this export has a fixed batch of {spec.batch}, got {batch.shape[0]}")
        return np.ascontiguousarray(batch, dtype=np.float32)

    def resolve(self, tier: str, precision: str | None = None) -> str:
        """The label of the selected entry for ``"auto"``, else of :meth:`Manifest.tier`
        (``tier`` a label, or a tier name and ``precision``); ``KeyError`` if unknown."""
        if tier == "auto":
            return self.selection.label
        return self.manifest.tier(tier, precision).label

    def run(self, batch: np.ndarray, tier: str = "auto") -> np.ndarray:
        """Logits of ``batch`` (N, C, H, W, already normalised) from ``tier`` (a label or
        ``"auto"``)."""
        session = self.session(self.resolve(tier))
        return session.run(None, {self.manifest.input.name: self.check_batch(batch)})[0]

    def check_memory(self, batch: int, tiers: list[str] | None = None) -> None:
        """``ValueError`` when running ``batch`` inputs through any of ``tiers`` (labels;
        default: every entry) cannot fit in the memory available: the weights, plus per sample
        the input and :data:`~nefl_zoo.memory.WORKING_SET_FACTOR` times the largest activation
        working set."""
        input_bytes = 4 * math.prod(self.manifest.input.shape)
        for name in tiers or [t.label for t in self.manifest.tiers]:
            entry = self.manifest.tier(self.resolve(name))
            per_sample = WORKING_SET_FACTOR * entry.activation_mb_per_sample * 2**20 + input_bytes
            check_batch_memory(
                batch, per_sample, entry.weights_mb * 2**20,
                what=f"tier {entry.label}: {per_sample / 2**20:,.2f} MiB per input",
            )

    def benchmark(self, tier: str, batch: int, runs: int = 10, warmup: int = 2) -> float:
        """Median latency (ms) of ``tier`` (a label) on a random batch, measured now on this
        machine; ``ValueError`` for a batch the export does not take or that cannot fit in memory."""
        return self.benchmark_many([tier], batch, runs, warmup)[self.resolve(tier)]

    def benchmark_many(self, tiers: Sequence[str], batch: int, runs: int = 10, warmup: int = 2) -> dict[str, float]:
        """Median latency (ms) of each of ``tiers`` (labels) on one random batch, measured now,
        the files timed in turn (``warmup`` untimed rounds, then ``runs`` timed ones), keyed by
        label; ``ValueError`` as :meth:`benchmark`."""
        fixed = self.manifest.input.batch
        if fixed is not None and batch != fixed:
            raise ValueError(f"this export has a fixed batch of {fixed}, got --batch {batch}")
        labels = [self.resolve(t) for t in tiers]
        self.check_memory(batch, labels)
        sessions = {label: self.session(label) for label in labels}
        x = np.random.default_rng(0).standard_normal((batch, *self.manifest.input.shape), dtype=np.float32)
        feed = {self.manifest.input.name: x}
        calls = {label: functools.partial(session.run, None, feed) for label, session in sessions.items()}
        return interleaved_median_ms(calls, runs, warmup_rounds=warmup)


def run_in_chunks(run: Callable[[np.ndarray], np.ndarray], images: np.ndarray, fixed_batch: int | None,
                  chunk: int = 256) -> np.ndarray:
    """``run`` over ``images`` in chunks of ``chunk`` images, or of ``fixed_batch`` (the last
    one zero-padded to it) for an export with a fixed batch; the outputs concatenated."""
    size = fixed_batch or chunk
    out = []
    for start in range(0, len(images), size):
        part = images[start : start + size]
        if fixed_batch is not None and len(part) < fixed_batch:
            part = np.concatenate([part, np.zeros((fixed_batch - len(part), *part.shape[1:]), part.dtype)])
        out.append(run(part)[: len(images) - start])
    return np.concatenate(out)
