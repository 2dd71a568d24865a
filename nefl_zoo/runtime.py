"""Run exported tiers with onnxruntime and pick the tier that fits a device budget.

Depends only on numpy, onnxruntime, pydantic and the standard library (never torch)::

    rt = TierRuntime("exports/resnet20/manifest.json")
    choice = rt.select(latency_ms=5.0)      # Selection(tier="g0.6", reason="...")
    logits = rt.run(images)                 # runs the selected tier ("auto")
    logits = rt.run(images, tier="g1.0")    # or any tier by name; sessions stay cached

Every tier file is checked against the manifest's sha256 before onnxruntime loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnxruntime as ort

from .manifest import MANIFEST_NAME, Manifest, ManifestError, TierEntry, file_sha256, load_manifest
from .timing import median_ms

CPU_PROVIDER = "CPUExecutionProvider"


class NoTierFits(ValueError):
    """No tier of the manifest meets the budget."""


@dataclass(frozen=True)
class Selection:
    """The tier :meth:`TierRuntime.select` chose and why."""

    tier: str
    reason: str
    fitting: tuple[str, ...]


def create_session(
    path: str | Path, sha256: str, providers: tuple[str, ...] = (CPU_PROVIDER,), threads: int | None = None
) -> ort.InferenceSession:
    """An onnxruntime session for ``path`` after checking the file's sha256; ``threads``
    caps onnxruntime's intra-op threads (default: one per physical core)."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(str(path), "", "tier file is missing (re-export the model)")
    actual = file_sha256(path)
    if actual != sha256:
        raise ManifestError(
            str(path),
            "",
            f"sha256 {actual[:12]}... does not match the manifest's {sha256[:12]}... "
            "(the file was modified or corrupted; re-export it)",
        )
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(path), options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ManifestError(str(path), "", f"onnxruntime cannot load the model ({first_line})") from None


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
        self.root = self.manifest_path.parent
        self.providers = tuple(providers)
        self.threads = threads
        self._sessions: dict[str, ort.InferenceSession] = {}
        self.selection: Selection = self.select()

    def session(self, tier: str) -> ort.InferenceSession:
        """The (cached) session of ``tier``; the file's sha256 is checked on first use."""
        if tier not in self._sessions:
            entry = self.manifest.tier(tier)
            self._sessions[tier] = create_session(
                self.root / entry.file, entry.sha256, self.providers, self.threads
            )
        return self._sessions[tier]

    def select(
        self,
        latency_ms: float | None = None,
        max_macs: float | None = None,
        max_params: float | None = None,
        max_memory_mb: float | None = None,
        batch: int = 1,
    ) -> Selection:
        """Choose the most accurate tier within every given budget (the largest by MACs when
        some fitting tier has no measured accuracy) and make it the ``"auto"`` tier.

        ``latency_ms`` is compared with the latency measured at export time (at the batch the
        manifest records); ``max_memory_mb`` with :meth:`TierEntry.memory_mb` at ``batch``.
        Raises :class:`NoTierFits` when no tier meets the budget.
        """
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
        tiers = self.manifest.tiers
        fitting = [t for t in tiers if all(cost(t) <= limit for _, cost, limit in checks)]
        budget = " and ".join(label for label, _, _ in checks) or "no budget"
        if not fitting:
            cheapest = min(tiers, key=lambda t: t.macs)
            needs = ", ".join(f"{label.split(' <=')[0]} {cost(cheapest):,.4g}" for label, cost, _ in checks)
            raise NoTierFits(f"no tier fits {budget}; the smallest, {cheapest.name}, needs {needs}")
        if all(t.accuracy is not None for t in fitting):
            best = max(fitting, key=lambda t: (t.accuracy, -t.macs))
            why = f"most accurate (accuracy {best.accuracy:.4g})"
        else:
            best = max(fitting, key=lambda t: (t.macs, t.params))
            why = f"largest ({best.macs:,} MACs; accuracy not measured for every tier)"
        lat = best.latency
        reason = (
            f"{best.name}: {why} of {len(fitting)}/{len(tiers)} tiers within {budget}; "
            f"{lat.median_ms:.3g} ms at batch {lat.batch} on export"
        )
        self.selection = Selection(best.name, reason, tuple(t.name for t in fitting))
        return self.selection

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

    def resolve(self, tier: str) -> str:
        """``tier`` itself, or the selected tier for ``"auto"``; ``KeyError`` if unknown."""
        if tier == "auto":
            return self.selection.tier
        return self.manifest.tier(tier).name

    def run(self, batch: np.ndarray, tier: str = "auto") -> np.ndarray:
        """Logits of ``batch`` (N, C, H, W, already normalised) from ``tier``."""
        session = self.session(self.resolve(tier))
        return session.run(None, {self.manifest.input.name: self.check_batch(batch)})[0]

    def benchmark(self, tier: str, batch: int, runs: int = 10, warmup: int = 2) -> float:
        """Median latency (ms) of ``tier`` on a random batch, measured now on this machine."""
        session = self.session(self.resolve(tier))
        fixed = self.manifest.input.batch
        if fixed is not None and batch != fixed:
            raise ValueError(f"this export has a fixed batch of {fixed}, got --batch {batch}")
        x = np.random.default_rng(0).standard_normal((batch, *self.manifest.input.shape), dtype=np.float32)
        feed = {self.manifest.input.name: x}
        return median_ms(lambda: session.run(None, feed), runs, warmup)
