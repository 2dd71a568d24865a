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
    """One tier of a nested model's session: ``run`` feeds the tier's ``index`` with the images.

    It has the part of ``onnxruntime.InferenceSession``'s interface that the runtime uses, so
    an entry of a nested export runs like a file of its own.

    Args:
        session: the nested file's session.
        index: the tier's index, the value of the ``tier`` input.
    """

    def __init__(self, session: ort.InferenceSession, index: int):
        self.session, self.index = session, index
        self._tier = np.array(index, np.int64)

    def run(self, output_names: Sequence[str] | None, feed: Mapping[str, np.ndarray], *args: Any) -> list[np.ndarray]:
        """``InferenceSession.run`` with the tier input added to ``feed``.

        Args:
            output_names: the outputs wanted (``None``: all).
            feed: the inputs, by name, without ``tier``.
            *args: passed on to ``InferenceSession.run``.

        Returns:
            The outputs.
        """
        return self.session.run(output_names, {**feed, TIER_INPUT: self._tier}, *args)

    def get_inputs(self) -> list:
        """The session's inputs but the tier input.

        Returns:
            onnxruntime's descriptions of the inputs.
        """
        return [i for i in self.session.get_inputs() if i.name != TIER_INPUT]

    def get_outputs(self) -> list:
        """The session's outputs.

        Returns:
            onnxruntime's descriptions of the outputs.
        """
        return self.session.get_outputs()

    def get_providers(self) -> list[str]:
        """The session's execution providers.

        Returns:
            Their names, in order of preference.
        """
        return self.session.get_providers()


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
