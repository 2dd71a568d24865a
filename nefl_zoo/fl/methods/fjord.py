"""FjORD in two variants (``method_args.variant``).

``original`` (Horvath et al., NeurIPS 2021): Ordered Dropout over nested widths (every batch a
width p <= the client's p_max), BN per width, self-distillation from p_max, replies averaged by
sample counts. ``nefl``: the FjORD baseline of the NeFL authors' code: one width per client and
round (drawn like NeFL's submodels), BN per width, cross-entropy only, step sizes fixed at 1,
replies averaged 1 per client; on a width-only spec this is NeFL-W with fixed steps (N/L).
"""

from __future__ import annotations

from typing import Literal, Mapping

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from ...slim import CompiledSpec, SliceEntry, compile_spec, tier_key
from ..strategy.base import MethodSettings, Run
from ..strategy.local_model import LocalModel, load_entries
from ..strategy.registry import register_method
from .common import Nested, largest, module_macs, width_spec


def _positions(index) -> torch.Tensor:
    return torch.arange(index.start or 0, index.stop) if isinstance(index, slice) else index


def nested_entry(inner: SliceEntry, outer: SliceEntry, key: str) -> SliceEntry:
    """Where ``inner``'s region of a global tensor lies inside ``outer``'s region of it.

    Both entries index the same global tensor; the result indexes the tensor that ``outer``
    gathers, so a narrower submodel's tensors are views of a wider submodel's.
    """
    if not inner.index:
        return SliceEntry(key, (), inner.shape, inner.kind, inner.consistent)
    dims = []
    for i, o in zip(inner.index, outer.index):
        ip, op = _positions(i), _positions(o)
        lookup = torch.full((int(max(ip.max(), op.max())) + 1,), -1, dtype=torch.long)
        lookup[op] = torch.arange(len(op))
        rel = lookup[ip]
        if bool((rel < 0).any()):
            raise ValueError(f"{key}: the narrower region is not inside the wider one")
        dims.append(slice(0, len(rel)) if torch.equal(rel, torch.arange(len(rel))) else rel)
    return SliceEntry(key, tuple(dims), inner.shape, inner.kind, inner.consistent)


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, alpha: float, temperature: float) -> torch.Tensor:
    """FjORD's self-distillation loss of a narrower width:
    ``(1 - alpha) * CE(student, y) + alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))``
    (batch mean; ``teacher`` is taken as a constant)."""
    t = temperature
    soft = F.softmax(teacher.detach() / t, 1)
    kl = F.kl_div(F.log_softmax(student / t, 1), soft, reduction="batchmean")
    return (1 - alpha) * F.cross_entropy(student, y) + alpha * t * t * kl


class _OrderedDropoutLocal(LocalModel):
    """The client's widest submodel plus, per narrower width, its own norms and step sizes.

    Every batch samples one width p uniformly among the client's widths (every width up to its
    maximum, the maximum last); a narrower width runs its slim module with the shared weights
    taken as views of the widest module's (the first ceil(pK) units), so its gradients land in
    the widest module's tensors. With self-distillation the widest width also takes a
    cross-entropy step on every batch, and a sampled narrower width is trained towards its
    soft labels (:func:`distillation_loss`), in one SGD step.
    """

    def __init__(self, compiled: CompiledSpec, widths: list[str], state: Mapping[str, torch.Tensor], settings: "FjORDSettings"):
        super().__init__()
        top = widths[-1]
        self.net = compiled[top].build()
        load_entries(self.net, {k: v for k, v in state.items() if k in compiled[top].slice_map})
        narrower = widths[:-1]
        self.widths = [*narrower, top]
        self.narrow = nn.ModuleList()
        self.views: list[dict[str, SliceEntry]] = []
        top_map = compiled[top].slice_map
        for tier in narrower:
            sub = compiled[tier].build()
            own = {k: state[tier_key(k, tier)] for k, e in compiled[tier].slice_map.items() if not e.consistent}
            views = {k: nested_entry(e, top_map[k], k) for k, e in compiled[tier].slice_map.items() if e.consistent}
            load_entries(sub, own, unused=views)
            for name, p in sub.named_parameters():
                if name in views:
                    p.requires_grad_(False)  # replaced by views of the widest module's tensors
            self.narrow.append(sub)
            self.views.append(views)
        self.settings = settings

    def sample_width(self) -> int:
        """The index in :attr:`widths` of this batch's width, uniform (torch's RNG)."""
        return int(torch.randint(len(self.widths), ()))

    def width_forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Logits of width ``widths[i]``."""
        if i == len(self.widths) - 1:
            return self.net(x)
        top = dict(self.net.named_parameters()) | dict(self.net.named_buffers())
        shared = {k: e.gather(top[k]) for k, e in self.views[i].items()}
        return torch.func.functional_call(self.narrow[i], shared, (x,))

    def forward(self, x):
        return self.net(x)

    def loss(self, x, y):
        i = self.sample_width()
        if not self.settings.distil:
            logits = self.width_forward(i, x)
            return F.cross_entropy(logits, y), logits
        teacher = self.net(x)
        loss = F.cross_entropy(teacher, y)
        if i == len(self.widths) - 1:
            return loss, teacher
        logits = self.width_forward(i, x)
        return loss + distillation_loss(logits, teacher, y, self.settings.kd_alpha, self.settings.kd_temperature), logits

    def state(self):
        out = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
        for tier, sub, views in zip(self.widths[:-1], self.narrow, self.views):
            out.update({tier_key(k, tier): v.detach().clone() for k, v in sub.state_dict().items() if k not in views})
        return out


class FjORDSettings(MethodSettings):
    """``method_args`` of ``fjord``."""

    variant: Literal["original", "nefl"] = Field(
        "original", description="original: FjORD's paper (ordered dropout per batch, distillation, sample weights); "
        "nefl: the NeFL authors' baseline (one width per client-round, cross-entropy, client weights)")
    kd: bool | None = Field(None, description="self-distillation from the client's widest submodel (none: on for "
                            "variant original, off for nefl, which has none)")
    kd_alpha: float = Field(1.0, ge=0, le=1, description="weight of the distillation term against cross-entropy")
    kd_temperature: float = Field(1.0, gt=0, description="softmax temperature of the distillation")

    @model_validator(mode="after")
    def _variant(self) -> "FjORDSettings":
        if self.variant == "nefl" and self.kd:
            raise ValueError("kd: variant nefl (the NeFL authors' FjORD) has no distillation")
        return self

    @property
    def distil(self) -> bool:
        """Whether clients self-distil (``kd``, or the variant's default)."""
        return self.kd if self.kd is not None else self.variant == "original"


@register_method("fjord", label="FjORD", settings=FjORDSettings)
class FjORD(Nested):
    """FjORD (Horvath et al.), variant ``original``: a client's maximum width p_max is the largest
    its environment allows; every local batch trains a width p <= p_max drawn uniformly from the
    run's widths (every tier no larger than p_max, allowed or not), with separate BN per width;
    the widest width self-distils into the sampled one (FjORD's alpha = T = 1; ``kd: false``
    turns it off); replies averaged by sample counts. Variant ``nefl``: the NeFL authors' FjORD,
    one width per client and round, cross-entropy, fixed steps, 1 per client."""

    def __init__(self, run: Run, settings: FjORDSettings | None = None):
        settings = settings if settings is not None else FjORDSettings()
        compiled = compile_spec(width_spec(run.spec, ["steps", "norm"]))
        if settings.variant == "nefl":
            super().__init__(run, settings, compiled=compiled)
            return

        def widths(top: str) -> list[str]:
            """The widths a client of ``top`` trains: every resource level no larger, ``top`` last."""
            sizes = self.level_size
            return [*(t for t in compiled.tiers if sizes[t] <= sizes[top] and t != top), top]

        def entries(top: str) -> Mapping[str, SliceEntry]:
            """The widest tier's tensors and every narrower width's own norms."""
            out: dict[str, SliceEntry] = dict(compiled[top].slice_map)
            for tier in widths(top)[:-1]:
                out.update({tier_key(k, tier): e for k, e in compiled[tier].slice_map.items() if not e.consistent})
            return out

        super().__init__(run, settings, compiled=compiled, assign=lambda levels, rng: largest(levels, self.level_size), entries=entries,
                         client_model=lambda top, arrays: _OrderedDropoutLocal(compiled, widths(top), arrays, self.settings),
                         weighting="samples", train_macs=lambda top: ordered_dropout_macs(compiled, widths(top), self.settings.distil))


def ordered_dropout_macs(compiled: CompiledSpec, widths: list[str], distil: bool) -> float:
    """Expected forward MACs per training image of a client training ``widths`` (widest last): a
    uniformly drawn width, plus with distillation the widest width's forward on every batch (a
    drawn widest width runs once)."""
    macs = [module_macs(compiled[w].build(), compiled.input_size) for w in widths]
    if not distil:
        return sum(macs) / len(macs)
    return macs[-1] + sum(macs[:-1]) / len(macs)
