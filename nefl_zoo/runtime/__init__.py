"""Run exported tiers with onnxruntime and pick the (tier, precision) that fits a device budget.

Depends only on numpy, onnxruntime, pydantic and the standard library (never torch)::

    rt = TierRuntime("exports/resnet20/manifest.json")
    choice = rt.select(latency_ms=5.0)  # Selection(tier="g0.6", precision="int8", ...)
    logits = rt.run(images)  # runs the selected entry ("auto")
    logits = rt.run(images, tier="g1.0")  # or any tier's FP32 file by its name,
    logits = rt.run(images, tier="g1.0:int8")  # or any entry by its label

    rt = TierRuntime("exports/resnet20", policy=Deadline(ms=5, percentile=95))
    logits = rt.run(images, tier="adaptive")  # the entry the policy chooses, timed

Sessions stay cached.

Every file (of any precision and format) is read once into memory (:func:`read_tier`): its
path must stay inside the manifest's folder (no ``..``, no symlink out of it), its bytes are
checked against the manifest's sha256, and those same bytes, never the path again, are handed
to onnxruntime (:func:`session_from_bytes`), so a file swapped after the check is never run; a
model that keeps any tensor in external data is refused (:func:`check_self_contained`). A
nested export's one file per precision serves all its entries, each by its ``tier`` input
(:mod:`.nested`). A
session's input and output shapes are checked against the manifest's ``input.shape`` and
``output.num_classes`` when it is created. ``python -m nefl_zoo.runtime bench PACKAGE``
measures every entry's latency on the device (:mod:`.latency`).

Modules: ``session`` (hash-checked bytes and sessions), ``tiers`` (:class:`TierRuntime`),
``nested`` (one file holding every tier), ``wire`` (the protobuf walk that refuses external
data), ``arrays`` (a safetensors header, for the Flower records),
``adaptive`` (the deadline policy), ``latency`` (tables measured on the device).
"""

from .adaptive import AdaptivePolicy, Candidate, Deadline
from .latency import LatencyTable, load_latency_table, measure_latency_table
from .nested import TierSession
from .session import CPU_PROVIDER, MAX_TIER_BYTES, check_self_contained, create_session, read_tier, session_from_bytes
from .tiers import NoTierFits, Selection, TierRuntime, run_in_chunks

__all__ = [
    "CPU_PROVIDER",
    "MAX_TIER_BYTES",
    "AdaptivePolicy",
    "Candidate",
    "Deadline",
    "LatencyTable",
    "NoTierFits",
    "Selection",
    "TierSession",
    "TierRuntime",
    "check_self_contained",
    "create_session",
    "load_latency_table",
    "measure_latency_table",
    "read_tier",
    "run_in_chunks",
    "session_from_bytes",
]
