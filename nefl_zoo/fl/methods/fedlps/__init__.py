"""FedLPS (Jia et al., AAAI 2024): multi-task FL with a shared frozen encoder and task
predictors pruned channel-wise per client, aggregated with the backbone's help.

The backbone is the run spec's full zoo model (``method_args.pretrained`` weights, else the
run seed's random initialisation, the same tensors NeFL starts from). The model contract cuts
it; what counts as a layer is a residual block (``residual_blocks()``):

* the **encoder** is ``forward_stem`` plus the first ``ceil(encoder_fraction * N)`` of the N
  blocks. It is frozen (eval mode, no gradients), never sent, and computed once per batch for
  all tasks;
* a **predictor** per task is the remaining blocks (named as in the backbone, e.g.
  ``layer2.0.conv1.weight``), the backbone's parameter-free ``forward_norm`` /
  ``forward_head(pre_logits=True)`` and a task head ``Linear(num_features, task classes)``.

Tasks are label maps of the dataset's labels (:data:`TASKS`: ``class``, ``parity``, ``mod3``,
``ge5``); every client trains every task on all its images (loss: the sum of the tasks'
cross-entropies, so each predictor gets its own task's gradient).

**Pruning.** A client's resource level is its largest allowed tier of the run spec; the level
gives its pruning ratio rho. In its first round the client ranks, in every predictor block,
the output filters of each branch convolution but the last (a basic block's ``conv1``) by L1
norm and keeps the ``C - round(rho * C)`` largest (the following norm and the next
convolution's input follow). These are the block's **inner** channels: the residual stream
(block outputs, shortcuts, the head's input) keeps all its channels, so pruned blocks still
add up. The kept indices (the mask) are per-client state and are reused every round. Kept
channels are not a prefix, so the client's physically smaller predictor maps into the global
one through :class:`~nefl_zoo.slim.SliceEntry` index tensors.

**A round.** The server sends every task's full predictor; the client cuts its pruned
predictors out with its mask, trains them and returns them with the mask. The server rebuilds
each full predictor by filling the pruned entries from the backbone predictor (the backbone's
blocks, fixed), then averages per task weighted by the client's sample count for that task.
Evaluation: encoder + each task's global (unpruned) predictor on the test set, one accuracy per
task, under the BN treatments of ``eval.bn`` like every method. BN running statistics are
averaged like every other tensor, but statistics gathered in pruned predictors do not fit the
full one (digits, pre-trained backbone: class accuracy 95% with recomputed statistics, 40% with
the averaged ones), so FedLPS configs set ``eval.bn: recompute`` (the predictors' statistics
recomputed on ``eval.bn_batches`` training batches, through the frozen encoder).

The subpackage by job: :mod:`.tasks` (label maps), :mod:`.networks` (encoder, predictors, the
multi-task model, the backbone), :mod:`.pruning` (L1 masks and the pruned predictors' slice
maps), :mod:`.method` (the strategy), :mod:`.costs` (parameters and MACs per level) and
:mod:`.pretrain` (a backbone for ``method_args.pretrained``).
"""


from .costs import LevelCost
from .method import FedLPS, FedLPSSettings, weighted_average
from .networks import Encoder, MultiTask, Predictor, evaluate_tasks, load_backbone
from .pretrain import pretrain_backbone
from .pruning import PrunableBlock, l1_channels, mask_key, prunable_block
from .tasks import TASKS, Task

__all__ = ["Encoder", "FedLPS", "FedLPSSettings", "LevelCost", "MultiTask", "Predictor", "PrunableBlock", "TASKS", "Task",
           "evaluate_tasks", "l1_channels", "load_backbone", "mask_key", "prunable_block", "pretrain_backbone", "weighted_average"]
