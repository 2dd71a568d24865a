"""FedLPS (Jia et al., AAAI 2024): multi-task FL with a shared frozen encoder and task
predictors pruned channel-wise per client, aggregated with the backbone's help.

The backbone is the run spec's model or ``method_args.backbone`` (ResNets, ShuffleNetV2). Its
weights (``method_args.pretrained``) are, by default (``public``), pre-trained centrally on the
held-out ``data.public_fraction`` that no client holds, when the run first needs them
(:mod:`.pretrain`: ``pretrain_epochs`` from the run seed's initialisation, deterministic from the
seed, so a resume or a Flower node rebuilds the same backbone; a run without a held-out split is
refused); or read from a weights file (e.g. saved by :func:`pretrain_backbone`, the same weights);
or, opted out with ``none`` (YAML null too), the run seed's random initialisation. The backbone's
SHA-256 is the server state (a resume refuses another backbone) and comes with every reply (a
client whose encoder is not the server's is rejected). What counts as a layer is a residual block
(``residual_blocks()``):

* the **encoder** is ``forward_stem`` plus the first ``ceil(encoder_fraction * N)`` of the N
  blocks. It is frozen (eval mode, no gradients), never sent, and computed once per batch for
  all tasks;
* a **predictor** per task is the remaining blocks (named as in the backbone, e.g.
  ``layer2.0.conv1.weight``), the modules of the backbone's ``forward_norm`` (ShuffleNetV2's
  ``conv5``), its parameter-free pooling and a task head ``Linear(features, task classes)``.

**Tasks** (:mod:`.tasks`) are disjoint groups of the dataset's labels covering them all, so
every image belongs to one task: the digits split into 0-4 and 5-9, or several datasets read
from folders as one (``data.dataset: tasks``, :mod:`nefl_zoo.data.multidata`). Each image goes to
its task's predictor; a predictor's loss is the mean cross-entropy of its task's images in the
batch.

**Pruning** (:mod:`.pruning`). A client's resource level is its largest allowed tier of the run
spec; the level gives its pruning ratio rho. In its first round the client keeps, by L1 norm,
``C - round(rho * C)`` channels of every predictor space (block-inner channels and each
predictor stage's residual stream), every layer's inputs following the previous layer's kept
outputs: at rho = 0.8 a ResNet predictor keeps about 4% of its parameters. As in the authors'
code (``mask_from: trained``), that round it trains its full predictors, chooses the masks from
the trained weights and returns their kept entries; ``mask_from: received`` (the paper's
Algorithm 1) chooses them from the received predictors before training. The masks are
per-client state, reused every round, and map the physically smaller predictors into the
global ones through :class:`~nefl_zoo.slim.SliceEntry` index tensors.

**A round.** The server sends every task's full predictor; the client cuts its pruned
predictors out with its masks, trains them and returns them with the masks and its image count
per task (its first round: see above). The server rebuilds each full predictor by filling the
pruned entries from the backbone predictor (fixed), then averages per task weighted by the
clients' images of that task (clients without any skipped). Evaluation: encoder + each task's
global (unpruned) predictor on the task's own test images, under the BN treatments of
``eval.bn`` (``recompute``: each predictor's statistics on its own task's images; FedLPS configs
set it, since statistics averaged from pruned predictors do not fit the full one).

The subpackage by job: :mod:`.tasks`, :mod:`.networks` (encoder, predictors, the multi-task
model, the backbone), :mod:`.pruning` (L1 masks and the pruned predictors' slice maps),
:mod:`.method` (the strategy), :mod:`.costs` (parameters and MACs per level) and
:mod:`.pretrain` (the backbone's pre-training on the held-out split).
"""

from .costs import LevelCost
from .method import FedLPS, FedLPSSettings, weighted_average
from .networks import Encoder, MultiTask, Predictor, evaluate_tasks, load_backbone
from .pretrain import pretrain_backbone
from .pruning import Layer, Pruning, Space, kept, l1_channels, layout, mask_key
from .tasks import DIGIT_GROUPS, TaskSet, TaskSpec

__all__ = ["DIGIT_GROUPS", "Encoder", "FedLPS", "FedLPSSettings", "Layer", "LevelCost", "MultiTask", "Predictor", "Pruning", "Space",
           "TaskSet", "TaskSpec", "evaluate_tasks", "kept", "l1_channels", "layout", "load_backbone", "mask_key", "pretrain_backbone",
           "weighted_average"]
