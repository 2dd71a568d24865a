"""FedGH (Yi et al., ACM MM 2023): heterogeneous feature extractors and one global header
trained on the server from the clients' local averaged representations (LARs).

Each client keeps its own feature extractor (a slim zoo submodel of its largest allowed tier,
without its classifier, plus a linear representation layer to the common width ``d_R``) as
per-client state: it never leaves the client. A round: the client replaces its header with
the global one, trains extractor and header locally, then uploads per class it holds the mean
representation of its training samples (LAR) and the class label. The server trains the global
header on the LARs with its own SGD (one step per LAR in client order, the paper's default, or
one mini-batch per client) and sends it out. Evaluation is the authors': every client's locally
trained model (its extractor and the header it trained locally, kept as client state) on the
client's own held-out test split (``data.local_split``), averaged over the clients of each
extractor type; the client's extractor with the current global header is reported too, as
``global_header/TIER``.
"""

from __future__ import annotations

from typing import Literal, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ...slim import CompiledSpec, compile_spec
from ..strategy.base import Aggregate, ClientInfo, Instruction, MethodInfo, MethodSettings, Reply, Run, State, Strategy
from ..strategy.local_model import LocalModel
from ..strategy.registry import register_method
from ..training.batches import ordered_batches
from ..training.client import evaluate, learning_rate
from ..training.device import placement
from .common import fit_reply, largest, level_sizes, mean_accuracy_per_level, require_parts, sample_clients, train_config

HEADER = ("header.weight", "header.bias")
GLOBAL_HEADER = "global_header"


class FedGHSettings(MethodSettings):
    """``method_args`` of ``fedgh``."""

    rep_dim: int = Field(500, ge=1, description="d_R: width of every extractor's representation (the paper's 500)")
    server_lr: float | None = Field(0.01, gt=0, description="learning rate of the global header: fixed, the paper's 0.01 by "
                                    "default; null: the round's local learning rate (its schedule)")
    server_batch: Literal["lar", "client"] = Field("lar", description="lar: one SGD step per LAR in client order; client: one mini-batch per client")


class Extractor(nn.Module):
    """A slim zoo submodel without its classifier, then ``relu(linear)`` to ``rep_dim``."""

    def __init__(self, net: nn.Module, rep_dim: int):
        super().__init__()
        parent, _, name = net.default_cfg["classifier"].rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, name, nn.Identity())  # its classifier is the header's job
        self.net = net
        self.proj = nn.Linear(net.num_features, rep_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.net.forward_head(self.net.forward_features(x), pre_logits=True)
        return F.relu(self.proj(features))


class _PersonalModel(LocalModel):
    """A client's extractor followed by the (global) header; it reports the extractor's state."""

    def __init__(self, extractor: Extractor, header: nn.Linear):
        super().__init__()
        self.extractor, self.header = extractor, header

    def forward(self, x):
        return self.header(self.extractor(x))

    def loss(self, x, y):
        logits = self(x)
        return F.cross_entropy(logits, y), logits

    def state(self):
        return {k: v.detach().clone() for k, v in self.extractor.state_dict().items()}


@register_method("fedgh", label="FedGH", settings=FedGHSettings)
class FedGH(Strategy):
    """FedGH: personalised heterogeneous extractors, one global header trained on the server."""

    def __init__(self, run: Run, settings: FedGHSettings | None = None):
        super().__init__(run, settings)
        self.compiled: CompiledSpec = compile_spec(run.spec)
        with torch.device("meta"):
            require_parts(self.compiled.create_global_model(), "fedgh", run.spec.model)
        self.level_size = level_sizes(self.compiled)
        self.num_classes = self.compiled.num_classes
        tiers = tuple(self.compiled.tiers)
        header = (self.settings.rep_dim + 1) * self.num_classes
        self.info = MethodInfo(run.spec, self.compiled.input_size, self.num_classes, tiers, tiers, dict.fromkeys(tiers, header),
                               worst_case=min(tiers, key=self.level_size.__getitem__))

    # -- models ---------------------------------------------------------------------------
    def extractor_tier(self, client: ClientInfo) -> str:
        """A client's extractor: its largest allowed tier (fixed over rounds)."""
        return largest(client.levels, self.level_size)

    def extractor(self, tier: str, cid: int, client_state: Mapping[str, torch.Tensor]) -> Extractor:
        """The client's extractor from its state; a client's first one is seeded by run and client."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(np.random.SeedSequence([self.run.seed, cid]).generate_state(1)[0]))
            extractor = Extractor(self.compiled[tier].build(), self.settings.rep_dim)
        if client_state:
            extractor.load_state_dict({k: v for k, v in client_state.items() if k not in HEADER})
        return extractor

    def header(self, arrays: Mapping[str, torch.Tensor]) -> nn.Linear:
        header = nn.Linear(self.settings.rep_dim, self.num_classes)
        header.load_state_dict({k.removeprefix("header."): arrays[k] for k in HEADER})
        return header

    # -- server hooks ---------------------------------------------------------------------
    def init_global_state(self) -> State:
        header = nn.Linear(self.settings.rep_dim, self.num_classes)
        return {f"header.{k}": v.detach().clone() for k, v in header.state_dict().items()}

    def _instruction(self, server_round: int, global_state, client: ClientInfo) -> Instruction:
        config = train_config(self.run, server_round, client.cid)
        return Instruction({k: global_state[k].clone() for k in HEADER}, config, self.extractor_tier(client))

    def configure_train(self, server_round: int, global_state, clients: list[ClientInfo]) -> dict[int, Instruction]:
        return {c.cid: self._instruction(server_round, global_state, c) for c in sample_clients(self.run, server_round, clients)}

    def _check(self, reply: Reply) -> str | None:
        if reply.error is not None:
            return reply.error
        if set(reply.arrays) != {"lar", "lar_classes"}:
            return f"expected tensors lar and lar_classes, got {sorted(reply.arrays)}"
        lar, classes = reply.arrays["lar"], reply.arrays["lar_classes"]
        if lar.ndim != 2 or lar.shape[1] != self.settings.rep_dim or classes.shape != (lar.shape[0],):
            return f"lar shape {tuple(lar.shape)} and classes {tuple(classes.shape)} do not match (N, {self.settings.rep_dim}) and (N,)"
        if classes.dtype != torch.int64 or len(classes.unique()) != len(classes) or not bool(((classes >= 0) & (classes < self.num_classes)).all()):
            return "lar_classes must be distinct class indices"
        if not bool(torch.isfinite(lar).all()):
            return "lar contains NaN or Inf"
        return None

    def aggregate_train(self, server_round: int, global_state, replies: Mapping[int, Reply]) -> Aggregate:
        device = placement().device  # the header trains where the clients do; the state stays on the CPU
        header = self.header(global_state).to(device)
        lr = self.settings.server_lr if self.settings.server_lr is not None else learning_rate(self.run.train, server_round - 1, self.run.rounds)
        optimizer = torch.optim.SGD(header.parameters(), lr=lr)
        accepted, rejected = 0, []
        for cid, reply in replies.items():
            reason = self._check(reply)
            if reason is not None:
                rejected.append((cid, reason))
                continue
            lar, classes = reply.arrays["lar"].to(device), reply.arrays["lar_classes"].to(device)
            batches = [(lar[i : i + 1], classes[i : i + 1]) for i in range(len(classes))] if self.settings.server_batch == "lar" else [(lar, classes)]
            for x, y in batches:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(header(x), y).backward()
                optimizer.step()
            accepted += 1
        state = dict(global_state)
        state.update({f"header.{k}": v.detach().cpu().clone() for k, v in header.state_dict().items()})
        return Aggregate(state, accepted, rejected)

    def evaluate(self, server_round: int, global_state, data) -> dict[str, float]:
        return {}  # personalised models are evaluated on the clients

    def configure_evaluate(self, server_round: int, global_state, clients: list[ClientInfo]) -> dict[int, Instruction]:
        return {c.cid: self._instruction(server_round, global_state, c) for c in clients}

    def aggregate_evaluate(self, server_round: int, replies: Mapping[int, Reply]) -> dict[str, float]:
        """Per extractor type, the mean accuracy of the clients' own models, and (``global_header/TIER``)
        of their extractors with the global header."""
        out = mean_accuracy_per_level(replies, self.info.levels)
        out.update({f"{GLOBAL_HEADER}/{t}": a for t, a in mean_accuracy_per_level(replies, self.info.levels, "accuracy_global").items()})
        return out

    # -- client hooks ---------------------------------------------------------------------
    def train(self, instruction: Instruction, data, client_state: State) -> Reply:
        model = _PersonalModel(self.extractor(instruction.level, int(instruction.config["client"]), client_state), self.header(instruction.arrays))
        reply = fit_reply(model, data, instruction)
        client_state.clear()
        client_state.update(reply.arrays)  # the extractor stays on the client ...
        client_state.update({f"header.{k}": v.detach().clone() for k, v in model.header.state_dict().items()})  # ... with its local header
        lar, classes = local_averaged_representations(model.extractor, data, int(instruction.config["seed"]), int(instruction.config["batch_size"]))
        reply.arrays = {"lar": lar, "lar_classes": classes}
        return reply

    def evaluate_client(self, instruction: Instruction, data, client_state: State) -> Reply:
        """The client's locally trained model (its extractor and local header; a client that never
        trained: its initial extractor and the global header) as ``accuracy``, and its extractor
        with the global header as ``accuracy_global``."""
        extractor = self.extractor(instruction.level, int(instruction.config["client"]), client_state)
        local = self.header(client_state if HEADER[0] in client_state else instruction.arrays)
        accuracy = evaluate(_PersonalModel(extractor, local), data, self.run.eval.batch_size)
        accuracy_global = evaluate(_PersonalModel(extractor, self.header(instruction.arrays)), data, self.run.eval.batch_size)
        return Reply({}, {"accuracy": accuracy, "accuracy_global": accuracy_global}, num_samples=len(data), level=instruction.level)


@torch.no_grad()
def local_averaged_representations(extractor: nn.Module, data, seed: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class present in ``data``, the mean representation of its samples (extractor in eval
    mode; randomness of the data's transforms seeded by ``seed``): ``(LARs (S, d_R), classes (S,))``."""
    extractor.eval()
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for x, y in ordered_batches(data, batch_size, placement().device):
            reps = extractor(x)
            for label in y.unique().tolist():
                mask = y == label
                sums[label] = sums.get(label, 0) + reps[mask].sum(0)
                counts[label] = counts.get(label, 0) + int(mask.sum())
    classes = sorted(sums)
    lar = torch.stack([sums[c] / counts[c] for c in classes]).cpu()
    return lar, torch.tensor(classes, dtype=torch.int64)
