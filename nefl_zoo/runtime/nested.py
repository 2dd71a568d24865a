"""Nested models: one standard ONNX file per precision holding every tier.

A nested export (``manifest.json`` with ``format: nested``) holds, next to the manifest, one
self-contained ``nested.PREC.onnx`` per precision (written by :mod:`nefl_zoo.export.
nested_model`). Any onnxruntime opens it with default options::

    inputs   input   float32 [N, C, H, W]    the images, normalised as the manifest says
             tier    int64 []                0 .. T-1: the entry's ``index`` in the manifest
                                             (negative values count from the end)
    output   logits  float32 [N, num_classes]

Its ``metadata_props`` hold the tier table under :data:`METADATA_KEY` (JSON: format, version,
precision, tier_input, input, output, class_names and per tier its index, name, params,
params_ratio, macs, macs_ratio, gamma_w and accuracy). :class:`TierSession` serves one tier of
such a session with the interface of an ``InferenceSession`` over the images alone.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np
import onnxruntime as ort

TIER_INPUT = "tier"
METADATA_KEY = "nefl_zoo.nested"
METADATA_FORMAT = "nefl-zoo-nested"


class TierSession:
    """One entry's view of a session, with the interface of an ``InferenceSession`` over the
    images alone: ``run`` adds a nested model's ``tier`` input and turns a failure of
    onnxruntime into a :class:`~nefl_zoo.manifest.ManifestError` of one line naming the file
    and the entry. An entry of a nested export runs like a file of its own.

    Args:
        session: the file's session.
        index: the tier's index, the value of the ``tier`` input (``None``: a file holding
            one tier).
        source: the file, named in errors.
        label: the entry's label, named in errors.
    """

    def __init__(self, session: ort.InferenceSession, index: int | None, source: str = "the model", label: str = "?"):
        self.session, self.index, self.source, self.label = session, index, source, label
        self._tier = None if index is None else np.array(index, np.int64)

    def run(self, output_names: Sequence[str] | None, feed: Mapping[str, np.ndarray], *args: Any) -> list[np.ndarray]:
        """``InferenceSession.run`` with the tier input added to ``feed``.

        Args:
            output_names: the outputs wanted (``None``: all).
            feed: the inputs, by name, without ``tier``.
            *args: passed on to ``InferenceSession.run``.

        Returns:
            The outputs.

        Raises:
            ManifestError: onnxruntime failed running the entry (one line naming it).
            MemoryError: onnxruntime could not allocate memory for it.
        """
        if self._tier is not None:
            feed = {**feed, TIER_INPUT: self._tier}
        try:
            return self.session.run(output_names, feed, *args)
        except Exception as exc:  # onnxruntime raises its own pybind exception types
            raise self.failure(exc) from None

    def failure(self, exc: BaseException) -> Exception:
        """The one-line error for onnxruntime's failure ``exc`` running this entry.

        Args:
            exc: what onnxruntime raised.

        Returns:
            A ``MemoryError`` when it could not allocate (which the CLI explains), else a
            :class:`~nefl_zoo.manifest.ManifestError` naming the file and the entry.
        """
        from ..manifest import ManifestError
        from .session import first_line

        where = f"tier {self.label}" + ("" if self.index is None else f" (index {self.index})")
        if "allocat" in str(exc).lower():
            return MemoryError(f"{self.source}: {where}: onnxruntime could not allocate memory ({first_line(exc)})")
        return ManifestError(self.source, "", f"{where}: onnxruntime failed running it ({first_line(exc)})")

    def get_inputs(self) -> list:
        """The session's inputs but the tier input.

        Returns:
            onnxruntime's descriptions of the inputs.
        """
        return [i for i in self.session.get_inputs() if i.name != TIER_INPUT]

    def __getattr__(self, name: str) -> Any:  # the rest of the InferenceSession interface
        if name == "session":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.session, name)


def nested_metadata(session: ort.InferenceSession) -> dict:
    """The tier table a nested model carries in its ``metadata_props``; ``ValueError`` when
    the model has none or it is not the table's JSON."""
    text = session.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
    if text is None:
        raise ValueError(f"no {METADATA_KEY} entry in the model's metadata_props: not a nested model")
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{METADATA_KEY}: not JSON ({exc.msg})") from None
    if not isinstance(table, dict) or table.get("format") != METADATA_FORMAT or not isinstance(table.get("tiers"), list):
        raise ValueError(f"{METADATA_KEY}: expected the {METADATA_FORMAT} tier table")
    return table
