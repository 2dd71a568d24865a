"""The contract every zoo network declares, and the pieces they share.

A nested-ready network is built from a width ratio ``gamma_w`` and per-block step sizes
``steps`` (one list per stage, 0 = block removed). The full model is ``gamma_w=1`` with every
step 1; a submodel is the same class built with smaller arguments, so a submodel's tensors
carry the same names as the global model's and differ only in shape.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
from torch import nn

Steps = Sequence[Sequence[float]]
Index = tuple  # per-dimension ``slice`` or 1-D ``torch.LongTensor``


def count_params(model: nn.Module) -> int:
    """Number of parameters (buffers such as BN running statistics excluded).

    Args:
        model: any module.

    Returns:
        The number of parameter elements.

    Examples:
        >>> import nefl_zoo as nz
        >>> from nefl_zoo.models import count_params
        >>> count_params(nz.create_model("resnet20"))
        272483
    """
    return sum(p.numel() for p in model.parameters())


def scale_width(channels: int, gamma_w: float, multiple: int = 1) -> int:
    """Channels kept of a layer of ``channels`` for a parameter ratio ``gamma_w``.

    ``multiple`` 1 is the NeFL paper's rule, ``ceil(C * sqrt(gamma_w))``. Above 1 the width
    ``C * sqrt(gamma_w)`` is rounded to the nearest multiple of ``multiple`` (at least one
    multiple), raised by one multiple if that is below 90% of it, and capped at ``C`` (timm's and
    MobileNet's ``make_divisible``); ``gamma_w`` 1 keeps all ``C``. Both rules grow with
    ``gamma_w``, so a narrower tier's channels stay a prefix of a wider tier's.

    Args:
        channels: the layer's channels at full width.
        gamma_w: the width parameter ratio, in (0, 1].
        multiple: round to a multiple of this (1: the paper's rule).

    Returns:
        The channels kept.

    Examples:
        >>> from nefl_zoo.models import scale_width
        >>> scale_width(16, 0.25), scale_width(16, 0.5), scale_width(64, 0.5, multiple=8)
        (8, 12, 48)
    """
    exact = channels * math.sqrt(gamma_w)
    if multiple == 1 or gamma_w >= 1:
        return max(1, math.ceil(exact - 1e-9))
    width = max(multiple, int(exact + multiple / 2) // multiple * multiple)
    if width < 0.9 * exact:
        width += multiple
    return min(channels, width)


def resolve_steps(steps: Steps | None, depths: Sequence[int]) -> list[list[float]]:
    """Return ``steps`` as lists of floats, or all ones when ``None``; check their shape."""
    if steps is None:
        return [[1.0] * d for d in depths]
    if len(steps) != len(depths):
        raise ValueError(f"expected {len(depths)} stages of steps, got {len(steps)}")
    out = []
    for i, (stage, d) in enumerate(zip(steps, depths)):
        if len(stage) != d:
            raise ValueError(f"stage {i + 1} has {d} blocks, got {len(stage)} steps")
        out.append([float(s) for s in stage])
    return out


def take_indices(num_stages: int, indices: int | Sequence[int] | None) -> list[int]:
    """Stage indices to return: all for ``None``, the last ``n`` for an int, else ``indices``
    (negative ones count from the end, as in timm)."""
    if indices is None:
        indices = num_stages
    if isinstance(indices, int):
        if not 0 < indices <= num_stages:
            raise ValueError(f"indices: the last {indices} of {num_stages} stages do not exist")
        return list(range(num_stages - indices, num_stages))
    taken = [i + num_stages if i < 0 else i for i in indices]
    if not taken or not all(0 <= i < num_stages for i in taken):
        raise ValueError(f"indices: expected stage indices in 0..{num_stages - 1}, got {list(indices)}")
    return taken


class NestedNet(nn.Module):
    """Base class of the zoo's networks: the contract code around a model relies on.

    ``__init__`` of a subclass sets, for the instance it builds (slim widths for a slim model):

    - ``stage_names`` / ``stage_depths``: module names of the stages and their blocks in the
      FULL architecture. A stage is an ``nn.Sequential`` whose blocks are named by their index
      in the full architecture (removed blocks leave gaps); every block declares
      ``step_names`` (its step parameters) and ``branch_parameters()`` (what disappears
      when the block is removed). A family whose blocks sit in one flat ``nn.Sequential``
      (torchvision's MobileNets) overrides :meth:`stage_blocks` and :meth:`forward_stage`.
      Blocks without a shortcut that could stand in for them are listed by :meth:`fixed_blocks`.
    - ``num_classes``, ``num_features`` (width the classifier reads) and ``feature_info``
      (per stage ``{"module", "num_chs", "reduction"}``).
    - ``default_cfg``: ``classifier`` and ``first_conv`` (module names), ``input_size`` (C, H, W).

    and implements ``forward_stem`` (input -> first stage's input) and ``forward_head``.

    Examples:
        >>> import torch
        >>> import nefl_zoo as nz
        >>> model = nz.create_model("resnet20", num_classes=10)
        >>> model.stage_names, model.stage_depths
        (('layer1', 'layer2', 'layer3'), (3, 3, 3))
        >>> model(torch.zeros(2, 3, 8, 8)).shape
        torch.Size([2, 10])
    """

    stage_names: tuple[str, ...]
    stage_depths: tuple[int, ...]
    num_classes: int
    num_features: int
    feature_info: list[dict]
    default_cfg: dict
    norm_types: tuple[type, ...] = (nn.BatchNorm2d, nn.LayerNorm)
    #: the stem, stages and head run apart (``forward_stem``, ``forward_stage``, ``forward_head``);
    #: False for a network that only runs whole (automatically nested graphs)
    runs_in_parts: bool = True

    def forward_stem(self, x: torch.Tensor) -> torch.Tensor:
        """The stem: the input to the first stage's input (each family implements it).

        Args:
            x: a batch of images, ``(N, C, H, W)``.

        Returns:
            The first stage's input.
        """
        raise NotImplementedError

    def forward_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Applied to the last stage's output to give the features (identity by default).

        Args:
            x: the last stage's output.

        Returns:
            The features.
        """
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool the features and, unless ``pre_logits``, classify them.

        Args:
            x: unpooled features (:meth:`forward_features`).
            pre_logits: stop after pooling.

        Returns:
            The logits, ``(N, num_classes)``, or with ``pre_logits`` the pooled features,
            ``(N, num_features)``.
        """
        raise NotImplementedError

    def stage_blocks(self, stage: int) -> Iterator[tuple[int, nn.Module]]:
        """(index in the full stage, block) of every block of ``stage`` this instance has.

        Args:
            stage: the stage's index.

        Yields:
            ``(index in the full architecture's stage, block)``; removed blocks are skipped.
        """
        for j, block in self.get_submodule(self.stage_names[stage]).named_children():
            yield int(j), block

    def forward_stage(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        """The output of stage ``stage`` (its index) for input ``x``.

        Args:
            stage: the stage's index.
            x: the stage's input.

        Returns:
            The stage's output.
        """
        return self.get_submodule(self.stage_names[stage])(x)

    def fixed_blocks(self) -> set[tuple[int, int]]:
        """(stage, block) of the blocks of the full architecture that cannot be removed (step 0):
        none by default (a ResNet keeps a removed first block's projection shortcut).

        Returns:
            The ``(stage, block)`` pairs of blocks a spec must keep.
        """
        return set()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Unpooled features: stem, every stage, final norm.

        Args:
            x: a batch of images, ``(N, C, H, W)``.

        Returns:
            The features, ``(N, num_features, H', W')`` for a CNN.
        """
        x = self.forward_stem(x)
        for i in range(len(self.stage_names)):
            x = self.forward_stage(i, x)
        return self.forward_norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits: :meth:`forward_features`, then :meth:`forward_head`.

        Args:
            x: a batch of images, ``(N, C, H, W)``.

        Returns:
            The logits, ``(N, num_classes)``.
        """
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | Sequence[int] | None = None,
        stop_early: bool = False,
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """Outputs of the stages in ``indices`` (see :func:`take_indices`), unpooled and before
        the final norm, with the features unless ``intermediates_only``. ``stop_early`` stops
        after the deepest requested stage (the features are then that stage's, normed).

        Args:
            x: a batch of images, ``(N, C, H, W)``.
            indices: the stages: all (``None``), the last ``n`` (an int), or their indices
                (negative ones count from the end).
            stop_early: stop after the deepest requested stage.
            intermediates_only: return the stages' outputs only.

        Returns:
            The stages' outputs, or ``(features, stages' outputs)``.

        Raises:
            ValueError: ``indices`` names stages the model does not have.

        Examples:
            >>> import torch
            >>> import nefl_zoo as nz
            >>> model = nz.create_model("resnet20")
            >>> x = torch.zeros(2, 3, 8, 8)
            >>> outputs = model.forward_intermediates(x, intermediates_only=True)
            >>> [tuple(t.shape) for t in outputs]
            [(2, 16, 8, 8), (2, 32, 4, 4), (2, 64, 2, 2)]
        """
        taken = take_indices(len(self.stage_names), indices)
        last = max(taken) if stop_early else len(self.stage_names) - 1
        x = self.forward_stem(x)
        intermediates = []
        for i in range(last + 1):
            x = self.forward_stage(i, x)
            if i in taken:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        return self.forward_norm(x), intermediates

    def get_classifier(self) -> nn.Module:
        """The classifier, as timm's models give it.

        Returns:
            The module ``default_cfg["classifier"]`` names.
        """
        return self.get_submodule(self.default_cfg["classifier"])

    def residual_blocks(self) -> Iterator[tuple[int, int, nn.Module]]:
        """Every residual block of this instance as (stage, index in the full architecture, module).

        (Not ``blocks()``: timm's ViT names its stage ``blocks``, and the state dict keeps
        timm's names.)

        Yields:
            ``(stage, index in the full architecture, block)`` for every block this
            instance has.
        """
        for s in range(len(self.stage_names)):
            for j, block in self.stage_blocks(s):
                yield s, j, block

    def step_keys(self) -> dict[str, tuple[int, int]]:
        """State-dict key of every step parameter -> (stage, block).

        Returns:
            ``{"layer1.0.step": (0, 0), ...}``.
        """
        names = {module: name for name, module in self.named_modules()}
        return {
            f"{names[block]}.{step}": (s, j)
            for s, j, block in self.residual_blocks()
            for step in block.step_names
        }

    def param_kinds(self) -> dict[str, str]:
        """Kind of every state-dict entry: ``steps``, ``norm`` or ``weight``.

        Returns:
            State-dict key to kind.
        """
        steps = self.step_keys()
        kinds: dict[str, str] = {}
        for mname, module in self.named_modules():
            kind = "norm" if isinstance(module, self.norm_types) else "weight"
            for key, _ in module.named_parameters(mname, recurse=False):
                kinds[key] = "steps" if key in steps else kind
            for key, _ in module.named_buffers(mname, recurse=False):
                kinds[key] = kind
        return kinds

    def slice_index(self, key: str, slim_shape: torch.Size, full_shape: torch.Size) -> Index:
        """Where a submodel tensor of ``slim_shape`` sits in the global tensor ``key``.

        Nested width scaling keeps the first channels of every dimension, so the default is a
        prefix per dimension; models with packed or grouped dimensions override this.

        Args:
            key: the tensor's state-dict key.
            slim_shape: its shape in the submodel.
            full_shape: its shape in the full model.

        Returns:
            Per dimension, a ``slice`` or a 1-D index tensor.
        """
        return tuple(slice(0, n) for n in slim_shape)
