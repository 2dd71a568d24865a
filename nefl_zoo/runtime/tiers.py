"""TierRuntime: the tiers of one manifest, their cached sessions and the budget-driven selector."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import onnxruntime as ort

from ..bounds import MAX_MS, MIN_MS, number
from ..manifest import MANIFEST_NAME, PRECISIONS, Manifest, ManifestError, TierEntry, load_manifest
from ..memory import WORKING_SET_FACTOR, check_batch_memory
from ..timing import interleaved_median_ms
from .adaptive import AdaptivePolicy, Candidate, Deadline
from .nested import TIER_INPUT, TierSession, nested_metadata
from .session import CPU_PROVIDER, create_session

class NoTierFits(ValueError):
    """No tier of the manifest meets the budget."""


@dataclass(frozen=True)
class Selection:
    """The (tier, precision) :meth:`TierRuntime.select` chose, and why.

    Attributes:
        tier: the chosen tier's name.
        reason: why, in one line (the budget, what fits, its latency).
        fitting: the labels of every entry within the budget.
        precision: the chosen entry's precision.
        label: the chosen entry's label (``NAME`` or ``NAME:PRECISION``).
    """

    tier: str
    reason: str
    fitting: tuple[str, ...]
    precision: str
    label: str  # the entry's label: the tier name for FP32, else NAME:PRECISION


class TierRuntime:
    """The tiers of one manifest, loaded lazily and cached, and a budget-driven selector.

    Args:
        manifest_path: ``manifest.json`` or the export directory holding it.
        providers: onnxruntime execution providers, in order of preference.
        threads: onnxruntime intra-op threads per session (default: one per physical core).
        policy: a :class:`~nefl_zoo.runtime.adaptive.Deadline` for ``run(batch,
            tier="adaptive")``: each request is served by the entry an
            :class:`~nefl_zoo.runtime.adaptive.AdaptivePolicy` chooses, timed, and the time fed
            back to it. The sessions of the policy's ladder are created and run once at once,
            so a switch never waits for a session and a first run's set-up is not taken for
            a slowdown.
        latencies: the policy's starting estimates, label -> ms at the request batch (e.g.
            :meth:`LatencyTable.for_batch` of a table measured on this device); default: the
            manifest's latency at export.
        precisions: the precisions the policy may serve (default: all).
        clock: seconds, monotonic: times the adaptive requests (injectable for tests).
        low_memory: sessions without constant folding: a nested model's session keeps one copy
            of the shared weights instead of every tier's, and cuts the tier's weights out of
            them at every run (slower: see the nested model's documentation for when it wins).

    onnxruntime's own log lines are off unless ``NEFL_ZOO_ORT_LOG`` asks for them
    (:func:`~nefl_zoo.runtime.session.ort_log_severity`).

    Raises :class:`ManifestError` for a manifest that cannot be read or is inconsistent, and
    for a failure of onnxruntime while loading or running an entry (one line naming the file
    and the entry); ``ValueError`` for a policy without a starting estimate for some entry.

    Examples:
        >>> import numpy as np
        >>> from nefl_zoo.runtime import TierRuntime
        >>> rt = TierRuntime("exports/tiers")  # three tiers, in FP32 and INT8
        >>> rt.select(max_file_mb=0.1).label
        'small:int8'
        >>> batch = np.zeros((2, *rt.manifest.input.shape), np.float32)
        >>> rt.run(batch).shape, rt.last_label
        ((2, 10), 'small:int8')
    """

    def __init__(
        self, manifest_path: str | Path, providers: tuple[str, ...] = (CPU_PROVIDER,), threads: int | None = None,
        policy: Deadline | None = None, latencies: Mapping[str, float] | None = None,
        precisions: Sequence[str] | None = None, clock: Callable[[], float] = time.perf_counter,
        low_memory: bool = False,
    ):
        path = Path(manifest_path)
        self.manifest_path = path / MANIFEST_NAME if path.is_dir() else path
        self.manifest: Manifest = load_manifest(self.manifest_path)
        self.root = self.manifest_path.parent  # tier files must resolve inside it
        self.providers = tuple(providers)
        self.threads = threads
        self.low_memory = low_memory
        self._sessions: dict[str, ort.InferenceSession] = {}  # by file: a nested model serves every entry in it
        self._views: dict[str, TierSession] = {}  # by label
        self.selection: Selection = self.select()
        self.clock = clock
        self.adaptive: AdaptivePolicy | None = None
        self.last_label: str | None = None  # the entry that served the latest run
        if policy is not None:
            entries = self.entries(precisions)
            estimates = latencies or {t.label: t.latency.median_ms for t in entries}
            missing = [t.label for t in entries if t.label not in estimates]
            if missing:
                raise ValueError(f"latencies: no starting estimate for {', '.join(missing)}")
            candidates = [Candidate(t.label, t.accuracy, t.macs, estimates[t.label]) for t in entries]
            self.adaptive = AdaptivePolicy(candidates, policy, clock=clock)
            warmup = {self.manifest.input.name: np.zeros((self.manifest.input.batch or 1, *self.manifest.input.shape), np.float32)}
            for label in self.adaptive.ladder:  # created and run once: a first run's set-up is no slowdown
                self.session(label).run(None, warmup)

    def session(self, tier: str, precision: str | None = None) -> TierSession:
        """The session of an entry (:meth:`Manifest.tier`). Each file is read, checked against
        its sha256 and opened once, on first use, and cached.

        Args:
            tier: an entry's label, or a tier's name.
            precision: the precision, with a tier's name.

        Returns:
            A :class:`TierSession` over its file's session that feeds a nested model the
            entry's index and names the file and entry when onnxruntime fails.

        Raises:
            KeyError: no such entry.
            ManifestError: a file that fails its checks, or that onnxruntime cannot load.
        """
        entry = self.manifest.tier(tier, precision)
        path = self.root / entry.file
        if entry.file not in self._sessions:
            session = create_session(path, entry.sha256, self.providers, self.threads, root=self.root, size=entry.bytes,
                                     low_memory=self.low_memory, tier=entry.label)
            self._check_io(session, str(path))
            if self.manifest.format == "nested":
                self._check_tiers(session, entry.file)
            self._sessions[entry.file] = session
        session = self._sessions[entry.file]
        view = self._views.get(entry.label)
        if view is None or view.session is not session:
            view = self._views[entry.label] = TierSession(session, entry.index, str(path), entry.label)
        return view

    def _check_io(self, session: ort.InferenceSession, source: str) -> None:
        """:class:`ManifestError` unless the model takes the manifest's input (name, shape,
        batch), for a nested model also an int64 scalar ``tier``, and gives
        ``output.num_classes`` logits."""
        spec, where = self.manifest.input, str(self.manifest_path)
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if self.manifest.format == "nested":
            tier = [i for i in inputs if i.name == TIER_INPUT]
            if not tier or tier[0].type != "tensor(int64)" or tier[0].shape != []:
                raise ManifestError(where, "format", f"nested, but {Path(source).name} has no int64 scalar input {TIER_INPUT!r}")
            inputs = [i for i in inputs if i.name != TIER_INPUT]
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

    def _check_tiers(self, session: ort.InferenceSession, name: str) -> None:
        """:class:`ManifestError` unless every entry of the nested file ``name`` points at a
        tier its tier table holds, by index and name."""
        try:
            table = [t.get("name") if isinstance(t, dict) else None for t in nested_metadata(session)["tiers"]]
        except ValueError as exc:
            raise ManifestError(str(self.root / name), "metadata_props", str(exc)) from None
        for i, entry in enumerate(self.manifest.tiers):
            if entry.file != name:
                continue
            if not 0 <= entry.index < len(table):
                raise ManifestError(str(self.manifest_path), f"tiers[{i}].index",
                                    f"{entry.index}, but {name} holds {len(table)} tiers (0..{len(table) - 1}); re-export")
            if table[entry.index] != entry.name:
                raise ManifestError(str(self.manifest_path), f"tiers[{i}].index",
                                    f"{entry.index} is tier {table[entry.index]!r} in {name}, not {entry.name!r}; re-export")

    def select(
        self,
        latency_ms: float | None = None,
        max_macs: float | None = None,
        max_params: float | None = None,
        max_memory_mb: float | None = None,
        batch: int = 1,
        max_file_mb: float | None = None,
        precisions: Sequence[str] | None = None,
        latencies: Mapping[str, float] | None = None,
        latency_source: str = "on export",
    ) -> Selection:
        """Choose the most accurate (tier, precision) within every given budget (the largest
        by MACs when some fitting entry has no measured accuracy; ties go to fewer MACs, then
        the smaller file) and make it the ``"auto"`` tier.

        Args:
            latency_ms: the latency budget (ms), against the latency measured at export (at
                the manifest's batch), or ``latencies`` when given.
            max_macs: the MACs budget.
            max_params: the parameters budget.
            max_memory_mb: the memory budget (MB), against :meth:`TierEntry.memory_mb`.
            batch: the batch the latency and memory budgets are for.
            max_file_mb: the budget on the tier's own file (MB).
            precisions: the precisions to consider (default: all).
            latencies: label -> ms, e.g. a device's
                :class:`~nefl_zoo.runtime.latency.LatencyTable` at ``batch``.
            latency_source: where ``latencies`` were measured, for the reason.

        Returns:
            The choice, which ``run(batch)`` (``tier="auto"``) now serves.

        Raises :class:`NoTierFits` when no entry meets every budget, ``ValueError`` for a budget
        that is negative or not finite, a batch below 1, a latency the adaptive policy would
        refuse (below a microsecond or above a day), a precision without files, or
        ``latencies`` missing an entry.
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
        tiers = self.entries(precisions)
        if latencies is not None:
            missing = [t.label for t in tiers if t.label not in latencies]
            if missing:
                raise ValueError(f"latencies: no latency for {', '.join(missing)} (measured {latency_source})")
            for t in tiers:  # what the adaptive policy takes as an estimate, no less
                number(f"latencies[{t.label}]", latencies[t.label], MIN_MS, MAX_MS)
            expected = lambda t: latencies[t.label]  # noqa: E731
        else:
            expected, latency_source = (lambda t: t.latency.median_ms), "on export"  # noqa: E731
        if latency_ms is not None:
            checks.append((f"latency <= {latency_ms:g} ms", expected, latency_ms))
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
        at = batch if latencies is not None else best.latency.batch
        reason = (
            f"{best.label}: {why} of {len(fitting)}/{len(tiers)} tiers within {budget}; "
            f"{expected(best):.3g} ms at batch {at} {latency_source}"
        )
        self.selection = Selection(best.name, reason, tuple(t.label for t in fitting), best.precision, best.label)
        return self.selection

    def entries(self, precisions: Sequence[str] | None = None) -> list[TierEntry]:
        """The manifest's entries at ``precisions``; ``ValueError`` for a precision without files.

        Args:
            precisions: the precisions wanted.

        Returns:
            The entries, in the manifest's order.
        """
        if precisions is None:
            return list(self.manifest.tiers)
        have = list(dict.fromkeys(t.precision for t in self.manifest.tiers))
        for precision in precisions:
            if precision not in have:
                known = "" if precision in PRECISIONS else f" (precisions are {', '.join(PRECISIONS)})"
                raise ValueError(f"precision {precision}: the manifest has no such files{known}; it has {', '.join(have)}")
        return [t for t in self.manifest.tiers if t.precision in precisions]

    def check_batch(self, batch: np.ndarray) -> np.ndarray:
        """``batch`` as a float32 array of the manifest's input shape; ``ValueError`` if not.

        Args:
            batch: images, ``(N, C, H, W)``, floating point.

        Returns:
            The batch as a contiguous float32 array.
        """
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
        """The label of the selected entry for ``"auto"``, of the policy's choice for
        ``"adaptive"``, else of :meth:`Manifest.tier`; ``KeyError`` if unknown, ``ValueError``
        for ``"adaptive"`` without a policy.

        Args:
            tier: ``"auto"``, ``"adaptive"``, a label or a tier's name.
            precision: the precision, with a tier's name.

        Returns:
            The entry's label.
        """
        if tier == "auto":
            return self.selection.label
        if tier == "adaptive":
            if self.adaptive is None:
                raise ValueError("tier adaptive: this runtime has no policy (TierRuntime(..., policy=Deadline(ms=...)))")
            return self.adaptive.choose()
        return self.manifest.tier(tier, precision).label

    def run(self, batch: np.ndarray, tier: str = "auto") -> np.ndarray:
        """Logits of ``batch`` from ``tier`` (``"adaptive"``: the policy's choice, timed and
        reported back to it); :attr:`last_label` is the entry that ran. ``ValueError`` for a
        batch of the wrong type or shape, ``KeyError`` for an unknown entry.

        Args:
            batch: images, ``(N, C, H, W)``, normalised as the manifest's input says.
            tier: ``"auto"`` (the selected entry), ``"adaptive"`` or a label.

        Returns:
            The logits, ``(N, num_classes)``.
        """
        feed = {self.manifest.input.name: self.check_batch(batch)}
        label = self.resolve(tier)
        session = self.session(label)
        start = self.clock()
        logits = session.run(None, feed)[0]
        if tier == "adaptive":
            self.adaptive.observe(label, (self.clock() - start) * 1e3)
        self.last_label = label
        return logits

    def check_memory(self, batch: int, tiers: list[str] | None = None) -> None:
        """``ValueError`` when running ``batch`` inputs through any of ``tiers`` cannot fit in
        the memory available: the weights, plus per sample the input and
        :data:`~nefl_zoo.memory.WORKING_SET_FACTOR` times the largest activation working set.

        Args:
            batch: the batch size.
            tiers: the entries' labels (default: every entry).
        """
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
        machine; ``ValueError`` for a batch the export does not take or that cannot fit in memory.

        Args:
            tier: an entry's label.
            batch: the batch size.
            runs: timed runs.
            warmup: untimed runs before them.

        Returns:
            The median latency, in milliseconds.
        """
        return self.benchmark_many([tier], batch, runs, warmup)[self.resolve(tier)]

    def benchmark_many(self, tiers: Sequence[str], batch: int, runs: int = 10, warmup: int = 2) -> dict[str, float]:
        """Median latency (ms) of each of ``tiers`` (labels) on one random batch, measured now,
        the files timed in turn (``warmup`` untimed rounds, then ``runs`` timed ones);
        ``ValueError`` as :meth:`benchmark`.

        Args:
            tiers: the entries' labels.
            batch: the batch size.
            runs: timed rounds.
            warmup: untimed rounds before them.

        Returns:
            The median latency in milliseconds, by label.
        """
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
    """``run`` over ``images`` in chunks; the outputs concatenated.

    Args:
        run: maps a batch to its outputs (e.g. :meth:`TierRuntime.run`).
        images: every image, ``(N, C, H, W)``.
        fixed_batch: an export's fixed batch (the last chunk zero-padded to it), or ``None``.
        chunk: the chunk size with a dynamic batch.

    Returns:
        The outputs of every image, in order (padding dropped).
    """
    size = fixed_batch or chunk
    out = []
    for start in range(0, len(images), size):
        part = images[start : start + size]
        if fixed_batch is not None and len(part) < fixed_batch:
            part = np.concatenate([part, np.zeros((fixed_batch - len(part), *part.shape[1:]), part.dtype)])
        out.append(run(part)[: len(images) - start])
    return np.concatenate(out)
