"""The sections of a run config that a method sees in its :class:`~.base.Run`: local training
(``train:``) and evaluation (``eval:``), the same for every method.

Settings that only one method reads are that method's own pydantic model (``method_args``), not
fields here; the run config (:mod:`nefl_zoo.fl.config`) assembles these with the other sections.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ...userfiles import Strict


class TrainConfig(Strict):
    """Local training of every client (the same for every method)."""

    local_epochs: int = Field(5, ge=1)
    batch_size: int = Field(32, ge=1)
    min_batch: int = Field(2, ge=1, description="an epoch's last batch with fewer samples is dropped or merged "
                           "(last_batch); 2: BatchNorm cannot train on one sample")
    last_batch: Literal["drop", "merge"] = Field(
        "drop", description="a last batch below min_batch: drop it (its samples come back in the next epoch's "
        "shuffle) or merge it into the batch before it")
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    schedule: Literal["step", "cosine", "constant"] = Field(
        "step", description="step: x0.1 at T/2 and 3T/4 (the paper's); cosine: with warm-up"
    )
    warmup_rounds: int = Field(0, ge=0, description="linear warm-up rounds (schedule: cosine)")
    grad_clip: float | None = Field(None, gt=0, description="max gradient norm, none = off")
    weighting: Literal["clients", "samples"] | None = Field(
        None, description="aggregation weights: per client (1 each) or per sample (n_k); none = the method's "
        "own paper's (NeFL, HeteroFL, DepthFL: clients; FedAvg, FedProx, FedAvgM, FjORD: samples)"
    )
    device: str = Field(
        "auto",
        description="where clients train and models are evaluated: auto (the accelerator when present), cpu, cuda, cuda:N "
        "or mps; the global state, aggregation and checkpoints stay on the CPU",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="autocast of local training and evaluation (fp16 with a gradient scaler)"
    )
    parallel_clients: int = Field(
        1, ge=1, description="clients of one submodel trained together (torch.func.vmap over stacked weights); 1: one at a time"
    )
    compile: bool = Field(
        False, description="compile each submodel's training step with torch.compile, once per submodel structure, reused "
        "by every client and round (its first step's seconds: compile_s in the round record); needs a C++ compiler on the CPU")
    memory_format: Literal["contiguous", "channels_last"] = Field(
        "contiguous", description="layout of images and convolution weights in local training (channels_last: NHWC)")

    @model_validator(mode="after")
    def _min_batch_within_a_batch(self) -> "TrainConfig":
        if self.min_batch > self.batch_size:
            raise ValueError(f"min_batch {self.min_batch} is above batch_size {self.batch_size}, so every batch would "
                             f"be dropped; use a min_batch of at most {self.batch_size} (1 keeps every batch)")
        return self

    @model_validator(mode="after")
    def _compile_one_client_at_a_time(self) -> "TrainConfig":
        if self.compile and self.parallel_clients > 1:
            raise ValueError(f"compile trains one client at a time, but parallel_clients is {self.parallel_clients} (clients "
                             "batched under vmap); set parallel_clients: 1 or compile: false")
        return self

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v):
            raise ValueError(f"expected auto, cpu, cuda, cuda:N or mps, got {v!r}")
        return v


class EvalConfig(Strict):
    """When and how the server evaluates.

    ``bn`` decides the BatchNorm statistics of the reported accuracies (:mod:`nefl_zoo.fl.training.bn`):
    ``running`` (as averaged from the clients) or ``recompute`` (reset and recomputed per
    submodel on ``bn_batches`` training batches without augmentation, the same batches for every
    method); ``bn_both`` also evaluates the other treatment, logged as ``TREATMENT/SUBMODEL``.
    HeteroFL trains with static BN, so it always recomputes.
    """

    every: int = Field(5, ge=1, description="evaluate every N rounds (and after the last)")
    batch_size: int = Field(256, ge=1)
    bn: Literal["running", "recompute"] = Field("running", description="BN statistics at evaluation")
    bn_batches: int = Field(20, ge=1, description="training batches (train.batch_size) for bn: recompute")
    bn_both: bool = Field(False, description="evaluate both BN treatments at every evaluation")
    per_client: bool = Field(
        False, description="score each client's model on the client's own test split (data.local_split) "
        "and report the mean per submodel, instead of the global test set"
    )
    device_classes: bool = Field(
        False, description="also score each device class (devices:) on its clients' own test splits (data.local_split), "
        "on the tier each client runs and on the full model, and count its updates per round"
    )
