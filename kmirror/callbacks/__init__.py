"""Callbacks for data-parallel training: files are written once, by the chief, never half-written.

| callback | what |
|---|---|
| `ChiefCheckpoint` | Keras' ModelCheckpoint, chief-only and atomic |
| `ChiefTensorBoard` | Keras' TensorBoard, chief-only, plus samples/s, step time, replicas |
| `BackupAndRestore` | resume after a crash from the last completed epoch |

Plain Keras callbacks work as they are: the logs they see are global values, identical in every
process, so `EarlyStopping` stops every process at the same epoch and `TerminateOnNaN` stops all.
"""

from kmirror.callbacks.backup import BackupAndRestore
from kmirror.callbacks.checkpoint import ChiefCheckpoint
from kmirror.callbacks.tensorboard import ChiefTensorBoard

__all__ = ["ChiefCheckpoint", "ChiefTensorBoard", "BackupAndRestore"]
