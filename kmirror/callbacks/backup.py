"""BackupAndRestore: resume training after a crash, from the last completed epoch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import keras

from kmirror import cluster, keras_hooks
from kmirror.files import atomic_path, check_writable

__all__ = ["BackupAndRestore"]


class BackupAndRestore(keras.callbacks.Callback):
    """Backs training up at the end of every epoch; after a crash, the relaunched script resumes.

    The chief writes the backup (weights, optimizer state and the epoch counter) into `backup_dir`;
    on the next `fit`, every process restores it and training continues from the epoch after the
    last completed one, ending with the weights an uninterrupted run would have. A backup is a
    weights file and a small `backup.json` that names it, each written under a temporary name and
    renamed into place, so a crash at any moment leaves a complete, consistent backup. The backup
    is deleted when training ends normally.

    With `shuffle=True`, the order of the samples after a resume differs from the uninterrupted
    run's (Keras draws a new order each epoch from its random state); the model trains on the
    same data but not bit for bit the same way. Shuffle with a `tf.data` pipeline seeded per epoch
    for exact resumption.

    Example:

    ```python
    model.fit(x, y, epochs=20, callbacks=[kmirror.callbacks.BackupAndRestore("/tmp/backup")])
    # ... the process is killed in epoch 7; run the same script again: it resumes at epoch 7.
    ```

    Args:
        backup_dir: a folder for the backup, used by this training run alone.
        save_freq: "epoch" (the only choice: a backup holds completed epochs).
        delete_checkpoint: remove the backup when training ends normally.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint: bool = True) -> None:
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore needs a backup_dir, e.g. '/tmp/backup'.")
        if save_freq != "epoch":
            raise ValueError(
                f"BackupAndRestore backs up completed epochs: save_freq must be 'epoch'; "
                f"got {save_freq!r}."
            )
        self.backup_dir = Path(backup_dir)
        self.delete_checkpoint = delete_checkpoint
        self._index = self.backup_dir / "backup.json"

    def on_train_begin(self, logs=None):
        if cluster.is_chief(self.model):
            check_writable(self.backup_dir, "backups")
        if not self._index.exists():
            return
        state = json.loads(self._index.read_text())
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            raise ValueError("BackupAndRestore needs a built model; call it on a batch first.")
        model.load_weights(self.backup_dir / state["weights"])
        keras_hooks.resume_at_epoch(model, state["epoch"])

    def on_epoch_end(self, epoch, logs=None):
        if not cluster.is_chief(self.model):
            return
        weights = f"epoch-{epoch + 1:05d}.weights.h5"
        with atomic_path(self.backup_dir / weights) as partial:
            self.model.save_weights(partial, overwrite=True)
        with atomic_path(self._index) as partial, open(partial, "w") as f:
            json.dump({"epoch": epoch + 1, "weights": weights}, f)
        for old in self.backup_dir.glob("epoch-*.weights.h5"):
            if old.name != weights:
                old.unlink(missing_ok=True)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and cluster.is_chief(self.model) and self._index.exists():
            self._index.unlink()
            for file in self.backup_dir.glob("epoch-*.weights.h5"):
                file.unlink(missing_ok=True)
            if not any(self.backup_dir.iterdir()):
                os.rmdir(self.backup_dir)
