"""Each model family declares its arguments as a pydantic model, checked before construction.

``create_model`` (and so every spec, config and export) validates the keyword arguments
against the entry point's :class:`ModelArgs` first: an unknown key, a wrong type, a value out
of range (``num_classes: -1``, ``num_heads: 0``, ``img_size: -4``) or arguments that
contradict each other (``embed_dim`` not divisible by ``num_heads``) are a one-line
:class:`ModelArgsError` naming the argument, instead of whatever the constructor makes of
them. The bounds are generous but finite, so that no argument asks for an absurd allocation.
"""

from __future__ import annotations

from typing import Annotated, Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictInt, ValidationError

from ..userfiles import format_validation_error

MAX_CLASSES = 1_000_000
MAX_CHANNELS = 8192
MAX_IMG_SIZE = 4096

Classes = Annotated[StrictInt, Field(ge=1, le=MAX_CLASSES, description="outputs of the classifier")]
Channels = Annotated[StrictInt, Field(ge=1, le=MAX_CHANNELS)]
ImageSize = Annotated[StrictInt, Field(ge=1, le=MAX_IMG_SIZE, description="input height = width")]
WidthRatio = Annotated[float, Strict(), Field(gt=0, le=1, description="width parameter ratio in (0, 1]")]
Step = Annotated[float, Strict(), Field(ge=0, description="initial step size; 0 removes the block")]


class ModelArgsError(ValueError):
    """Model arguments that break the family's declared constraints: ``FIELD: message``.

    Args:
        field: the argument at fault (empty when the problem spans arguments).
        message: what was expected.
    """

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}" if field else message)


class ModelArgs(BaseModel):
    """Base of a family's arguments: unknown keys are errors and numbers must be finite.

    Every family takes ``num_classes``, ``in_chans``, ``gamma_w``, ``channel_multiple`` and
    ``steps``; subclasses add their own (with the entry point's defaults, so that checks
    across arguments see the values the constructor will use).

    Attributes:
        num_classes: the classifier's outputs.
        in_chans: the input's channels.
        gamma_w: the width parameter ratio, in (0, 1].
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    num_classes: Classes = 10
    in_chans: Channels = 3
    gamma_w: WidthRatio = 1.0
    channel_multiple: StrictInt = Field(
        1, ge=1, le=MAX_CHANNELS, description="round scaled widths to a multiple of this (1: the paper's ceil rule)"
    )
    steps: Sequence[Sequence[Step]] | None = Field(None, description="one list per stage, one step per block")


def check_args(args_model: type[ModelArgs], kwargs: dict[str, Any]) -> ModelArgs:
    """``kwargs`` validated by ``args_model``; :class:`ModelArgsError` names the first bad one."""
    try:
        return args_model.model_validate(kwargs)
    except ValidationError as exc:
        known = ", ".join(args_model.model_fields)
        raise format_validation_error(
            "", exc, lambda _source, field, message: ModelArgsError(field, message),
            unknown_key=f"unknown argument (this model takes {known})",
        ) from None


__all__ = [
    "Channels",
    "Classes",
    "ImageSize",
    "MAX_CHANNELS",
    "MAX_CLASSES",
    "MAX_IMG_SIZE",
    "ModelArgs",
    "ModelArgsError",
    "Step",
    "WidthRatio",
    "check_args",
]
