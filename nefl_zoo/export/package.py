"""Build and verify the nested models of an export (``--format nested``, the default).

Each tier's verified files (:mod:`.precisions`) are traced back to the shared tensors
(:func:`~.nested.nested_entry`) and the entry is checked on its own: a nested model of that one
tier (:func:`~.nested_model.nested_model`) must give its per-tier file's logits, FP32 within
:func:`~.verify.tolerance_for` (in practice the same floats), INT8 and FP16 within the bounds a
per-tier INT8/FP16 file is held to against FP32 (:func:`~.verify.check_agreement`; an entry
outside them is dropped with a warning, as a file would be). After the last tier, one nested
model per precision holds every entry that passed; it must pass ``onnx.checker`` (full check)
and give, tier by tier, the logits its entry gave alone (FP32 within :func:`~.verify.tolerance_for`:
onnxruntime may fuse a branch's ops otherwise than a main graph's, about 1e-7 apart; INT8 and
FP16 within :func:`~.verify.check_agreement`'s bounds); then the
staged export is read back through :class:`~nefl_zoo.runtime.TierRuntime` and must give
exactly those logits.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ..manifest import MANIFEST_NAME, Manifest, PackageFile
from ..runtime import TierRuntime
from ..runtime.nested import TierSession
from ..runtime.session import MAX_TIER_BYTES, session_from_bytes
from ..slim.slicemap import SliceMap
from .data import ExportImages
from .nested import NestedEntry, SharedTensors, nested_entry
from .nested_model import nested_model
from .precisions import PrecisionFile, tier_logits
from .verify import ExportError, check_agreement, tolerance_for


def nested_filename(precision: str) -> str:
    """The nested model of ``precision``: ``nested.fp32.onnx``."""
    return f"nested.{precision}.onnx"


@dataclasses.dataclass(frozen=True)
class NestedFile:
    """One precision's nested model, written and opened."""

    file: PackageFile
    session: ort.InferenceSession


class PackageWriter:
    """The nested models of one export, entry by entry, then one file per precision."""

    def __init__(self, shared: Mapping[str, SharedTensors], precisions: list[str], threads: int | None,
                 fixed_batch: int | None):
        self.fp32, self.shared = shared["fp32"], shared
        self.threads, self.fixed_batch = threads, fixed_batch
        self.entries: dict[str, list[NestedEntry]] = {p: [] for p in precisions}
        self.checks: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # label -> (inputs, verified logits)

    def add(self, name: str, factors: Mapping[str, torch.Tensor], slice_map: SliceMap, files: list[PrecisionFile],
            x: np.ndarray, images: ExportImages | None, warn: Callable[[str], None]) -> list[PrecisionFile]:
        """The entries of one tier's verified ``files`` (FP32 first) at the precisions shipped
        that pass their check: each a :class:`PrecisionFile` whose session and logits are its
        one-tier nested model's (``factors``: :func:`~.nested.fold_factors` of the tier's module)."""
        fp32_model = onnx.load_model_from_string(files[0].data)
        inputs = images.test if images is not None else x
        reference = files[0].logits if files[0].logits is not None else tier_logits(files[0].session, x, self.fixed_batch)
        kept = []
        for file in (f for f in files if f.precision in self.entries):
            model = fp32_model if file.precision == "fp32" else onnx.load_model_from_string(file.data)
            shared = self.shared[file.precision]
            entry = nested_entry(name, model, slice_map, factors, shared, self.fp32, fp32_model)
            alone = nested_model([entry], shared.arrays, {}).SerializeToString()
            session = TierSession(session_from_bytes(alone, f"tier {name} ({file.precision})", threads=self.threads), 0)
            logits = tier_logits(session, inputs, self.fixed_batch)
            own = file.logits if file.logits is not None else reference
            diff = float(np.abs(logits.astype(np.float64) - own).max())
            agreement = None
            if file.precision == "fp32":
                if not diff <= tolerance_for(torch.from_numpy(own)):
                    raise ExportError(f"tier {name}: the nested model's logits differ from its file's by {diff:.3g}")
            else:
                try:
                    agreement = check_agreement(name, file.precision, reference, logits)
                except ExportError as exc:
                    warn(f"{exc} (nested model); not shipped")
                    continue
            self.entries[file.precision].append(entry)
            self.checks[name if file.precision == "fp32" else f"{name}:{file.precision}"] = (inputs, logits)
            kept.append(dataclasses.replace(
                file, session=session, logits=logits if images is not None else None, agreement=agreement,
                model_bytes=len(file.data),
            ))
        return kept

    def finish(self, folder: Path, metadata: Callable[[str, list[str]], dict]) -> dict[str, NestedFile]:
        """Write the nested model of every precision that kept an entry, its tier table from
        ``metadata(precision, tier names)``, and check each tier against its entry alone."""
        out = {}
        for precision, entries in self.entries.items():
            if not entries:
                continue
            names = [e.name for e in entries]
            model = nested_model(entries, self.shared[precision].arrays, metadata(precision, names))
            if model.ByteSize() > MAX_TIER_BYTES:
                raise ExportError(
                    f"the {precision} nested model is {model.ByteSize() / 2**30:.2f} GiB, past ONNX's 2 GiB protobuf "
                    "limit for one file; export --format files (one file per tier) or fewer tiers"
                )
            onnx.checker.check_model(model, full_check=True)
            data = model.SerializeToString()
            name = nested_filename(precision)
            (folder / name).write_bytes(data)
            session = session_from_bytes(data, name, threads=self.threads)
            for index, tier in enumerate(names):
                label = tier if precision == "fp32" else f"{tier}:{precision}"
                inputs, alone = self.checks[label]
                logits = tier_logits(TierSession(session, index), inputs, self.fixed_batch)
                diff = float(np.abs(logits.astype(np.float64) - alone).max())
                if precision != "fp32":  # other kernels may round INT8 and FP16 a step apart
                    check_agreement(f"{label} (nested model vs the tier alone)", precision, alone, logits)
                elif not diff <= tolerance_for(torch.from_numpy(alone)):
                    raise ExportError(f"entry {label}: the nested model's logits differ from the tier's alone by {diff:.3g}")
                self.checks[label] = (inputs, logits)  # what reading the export back must give exactly
            file = PackageFile(file=name, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
            out[precision] = NestedFile(file, session)
        return out

    def verify(self, folder: Path, manifest: Manifest) -> None:
        """Read the staged export back as the runtime does and check every entry's logits
        against those verified when it was made; :class:`ExportError` if one differs."""
        (folder / MANIFEST_NAME).write_text(manifest.model_dump_json())
        try:
            runtime = TierRuntime(folder, threads=self.threads)
            for entry in manifest.tiers:
                inputs, logits = self.checks[entry.label]
                read_back = tier_logits(runtime.session(entry.label), inputs, self.fixed_batch)
                if not np.array_equal(read_back, logits):
                    raise ExportError(f"entry {entry.label}: the export read back gives other logits than when it was made")
        finally:
            (folder / MANIFEST_NAME).unlink(missing_ok=True)
