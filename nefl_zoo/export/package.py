"""Assemble and verify a nested package while the tiers are exported (``--format nested``).

Each tier's files (:mod:`.precisions`: verified, with their test logits) are turned into
package entries (:func:`~.nested.nested_entry`). Every entry is then rebuilt the way the
runtime builds it (:func:`nefl_zoo.runtime.nested.assemble`, from the bytes written) and must
give its per-tier file's logits: FP32 within :func:`~.verify.tolerance_for` (in practice the
same floats), INT8 and FP16 within the bounds a per-tier INT8/FP16 file is held to against
FP32 (:func:`~.verify.check_agreement`; an entry outside them is dropped with a warning, as a
file would be). After the last tier the shared files are written and the whole staged package
is read back through :class:`~nefl_zoo.runtime.TierRuntime` and checked once more.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import onnx
import torch

from ..manifest import MANIFEST_NAME, Manifest, PackageFile
from ..runtime import TierRuntime
from ..runtime.nested import assemble
from ..runtime.session import session_from_bytes
from ..slim.slicemap import SliceMap
from .data import ExportImages
from .nested import SharedTensors, fold_factors, nested_entry, shared_file
from .precisions import PrecisionFile, tier_logits
from .verify import ExportError, check_agreement, tolerance_for


def _write(folder: Path, name: str, data: bytes) -> PackageFile:
    (folder / name).write_bytes(data)
    return PackageFile(file=name, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))


class PackageWriter:
    """The nested package of one export, entry by entry, then its shared files."""

    def __init__(self, global_state: Mapping[str, torch.Tensor], precisions: list[str], threads: int | None,
                 fixed_batch: int | None):
        self.fp32 = SharedTensors("fp32", global_state)
        self.shared = {p: self.fp32 if p == "fp32" else SharedTensors(p, global_state) for p in precisions}
        self.threads, self.fixed_batch = threads, fixed_batch
        self.checks: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # label -> (inputs, verified logits)

    def add(self, name: str, tier_file: str, module: torch.nn.Module, slice_map: SliceMap, files: list[PrecisionFile],
            x: np.ndarray, images: ExportImages | None, folder: Path, warn: Callable[[str], None]) -> list[PrecisionFile]:
        """The package entries of one tier's verified ``files`` (FP32 first), written to
        ``folder``: each a :class:`PrecisionFile` whose file is the graph, whose session and
        logits are the assembled model's, and whose ``tensors`` is its per-tier file."""
        factors = fold_factors(module)
        fp32_model = onnx.load_model_from_string(files[0].data)
        inputs = images.test if images is not None else x
        reference = files[0].logits if files[0].logits is not None else tier_logits(files[0].session, x, self.fixed_batch)
        stem = tier_file.removesuffix(".onnx")
        entries = []
        for file in files:
            model = fp32_model if file.precision == "fp32" else onnx.load_model_from_string(file.data)
            entry = nested_entry(model, slice_map, factors, self.shared[file.precision], self.fp32, fp32_model)
            graph = _write(folder, f"{stem}.{file.precision}.graph.onnx", entry.graph)
            tensors = _write(folder, f"{stem}.{file.precision}.tensors.safetensors", entry.tensors)
            model_bytes = assemble(entry.graph, entry.tensors, self.shared[file.precision].arrays, str(folder / tensors.file))
            session = session_from_bytes(model_bytes, graph.file, threads=self.threads)
            logits = tier_logits(session, inputs, self.fixed_batch)
            own = file.logits if file.logits is not None else reference
            diff = float(np.abs(logits.astype(np.float64) - own).max())
            agreement = None
            if file.precision == "fp32":
                if not diff <= tolerance_for(torch.from_numpy(own)):
                    raise ExportError(f"tier {name}: the nested package's logits differ from its file's by {diff:.3g}")
            else:
                try:
                    agreement = check_agreement(name, file.precision, reference, logits)
                except ExportError as exc:
                    warn(f"{exc} (nested package); not shipped")
                    (folder / graph.file).unlink()
                    (folder / tensors.file).unlink()
                    continue
            label = name if file.precision == "fp32" else f"{name}:{file.precision}"
            self.checks[label] = (inputs, logits)
            entries.append(dataclasses.replace(
                file, file=graph.file, sha256=graph.sha256, session=session, logits=logits if images is not None else None,
                agreement=agreement, tensors=tensors, model_bytes=len(model_bytes),
            ))
        return entries

    def finish(self, folder: Path, precisions: list[str]) -> dict[str, PackageFile]:
        """Write the shared file of each of ``precisions`` (those an entry ships)."""
        return {p: _write(folder, f"shared.{p}.safetensors", shared_file(self.shared[p])) for p in precisions}

    def verify(self, folder: Path, manifest: Manifest) -> None:
        """Read the staged package back as the runtime does and check every entry's logits
        against those verified when it was made; :class:`ExportError` if one differs."""
        (folder / MANIFEST_NAME).write_text(manifest.model_dump_json())
        try:
            runtime = TierRuntime(folder, threads=self.threads)
            for label, (inputs, logits) in self.checks.items():
                if label not in {t.label for t in manifest.tiers}:
                    continue
                read_back = tier_logits(runtime.session(label), inputs, self.fixed_batch)
                if not np.array_equal(read_back, logits):
                    raise ExportError(f"entry {label}: the package read back gives other logits than when it was made")
        finally:
            (folder / MANIFEST_NAME).unlink(missing_ok=True)

