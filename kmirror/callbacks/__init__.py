"""Callbacks for data-parallel training: files are written once, by the chief, never half-written.

| callback | what |
|---|---|
| `ChiefCheckpoint` | Keras' ModelCheckpoint, chief-only and atomic |
| `ChiefTensorBoard` | Keras' TensorBoard, chief-only, plus samples/s, step time, replicas |
| `BackupAndRestore` | resume after a crash where the last backup was taken, inside an epoch too |
| `chief_only` | run any callback (or class of them) on the chief alone: one that writes |

Plain Keras callbacks work as they are: the logs they see are global values, identical in every
process, so `EarlyStopping` stops every process at the same epoch. In a job of several processes
Keras' own `ModelCheckpoint`, `TensorBoard` and `CSVLogger` write once, from the chief
(docs/callbacks.md); Keras' `BackupAndRestore` runs as this package's; Ray Train's
`ReportCheckpointCallback` reports its checkpoint from the chief alone; the callbacks of MLflow and
Weights & Biases (and MLflow's autologging) run on the chief alone: a job logs one run. A NaN or
infinite loss stops every process at the same step with `kmirror.errors.NonFiniteLoss`. With a
`BackupAndRestore`, `SIGTERM` to any process stops every process before the same step, backed up
there, with exit code `EXIT_PREEMPTED` (75; docs/cluster.md, "Preemption").

Example:

```python
import kmirror, keras, numpy as np
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
x, y = np.random.rand(64, 8), np.random.rand(64, 1)
model = kmirror.wrap(model)
model.fit(x, y, batch_size=16, epochs=2, validation_split=0.25, callbacks=[
    kmirror.callbacks.ChiefCheckpoint("best.keras", save_best_only=True),
    kmirror.callbacks.ChiefTensorBoard("logs"),
    kmirror.callbacks.BackupAndRestore("backup"),
])
```
"""

from kmirror._core.callbacks.backup import BackupAndRestore
from kmirror._core.callbacks.checkpoint import ChiefCheckpoint
from kmirror._core.callbacks.keras_own import chief_only
from kmirror._core.callbacks.preemption import EXIT_PREEMPTED
from kmirror._core.callbacks.tensorboard import ChiefTensorBoard

__all__ = [
    "ChiefCheckpoint",
    "ChiefTensorBoard",
    "BackupAndRestore",
    "chief_only",
    "EXIT_PREEMPTED",
]
