"""The run directory, below training (which writes it) and export (which reads its weights):
:class:`~.store.RunStore` owns its files and checkpoints (:mod:`.store`), which are read back
verified (:mod:`.checkpoint`)."""

from .checkpoint import Checkpoint, CheckpointError, read_checkpoint, saved_config
from .store import RunExistsError, RunStore

__all__ = ["Checkpoint", "CheckpointError", "RunExistsError", "RunStore", "read_checkpoint", "saved_config"]
