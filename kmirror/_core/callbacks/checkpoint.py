"""ChiefCheckpoint: Keras' ModelCheckpoint, written once by the chief, atomically."""

from __future__ import annotations

import os

from kmirror._core import cluster, keras_hooks
from kmirror._core.files import atomic_path, check_writable

__all__ = ["ChiefCheckpoint"]


class ChiefCheckpoint(keras_hooks.CheckpointOverrides):
    """Saves the model or its weights, from the chief process only, never as a partial file.

    Keras' `ModelCheckpoint`, with the same arguments in the same order, and its semantics (file
    name templates such as `ckpt_{epoch:02d}.keras`,
    `save_best_only`, `save_freq`, `.keras` or `.weights.h5`), for data-parallel training: the
    monitored value is the global (all-replica) value, so every process agrees on which epoch is
    best, but only the chief writes; other processes write nothing. Each file is written under a
    temporary name and renamed into place, so a crash during a save leaves the previous file intact.
    Saved files are plain Keras files: `keras.models.load_model` opens them without kmirror, and
    `kmirror.wrap(keras.models.load_model(path))` continues training with the saved optimizer state.

    Example:

    ```python
    checkpoint = kmirror.callbacks.ChiefCheckpoint("best.keras", save_best_only=True)
    model.fit(x, y, validation_data=(xv, yv), epochs=10, callbacks=[checkpoint])
    ```

    Args:
        filepath: where to save; may contain `{epoch}` and log names as in `ModelCheckpoint`.
        monitor: the log to watch for `save_best_only` ("val_loss", "loss", "val_accuracy", ...).
        verbose: 1 prints a line when a file is written.
        save_best_only: save only when `monitor` improves.
        save_weights_only: save only the weights (`filepath` must end in `.weights.h5`).
        mode: "auto", "min" or "max": whether smaller or larger `monitor` values are better.
        save_freq: "epoch", or a number of batches between saves.
        initial_value_threshold: the value `monitor` must beat for the first save.
    """

    def __init__(
        self,
        filepath,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq="epoch",
        initial_value_threshold=None,
    ) -> None:
        super().__init__(
            filepath,
            monitor=monitor,
            verbose=verbose,
            save_best_only=save_best_only,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
            initial_value_threshold=initial_value_threshold,
        )

    def on_train_begin(self, logs=None):
        # Before the first step, not after an epoch of training.
        folder = os.path.dirname(os.path.abspath(str(self.filepath)))
        if cluster.is_chief(self.model) and "{" not in folder:
            check_writable(folder, "checkpoints")

    def _write_checkpoint(self, epoch, filepath):
        # Every process decided alike (Keras' decision, the best value tracked); the chief writes.
        if not cluster.is_chief(self.model):
            return
        with atomic_path(filepath) as partial:
            if self.save_weights_only:
                self.model.save_weights(partial, overwrite=True)
            else:
                self.model.save(partial, overwrite=True)
        if self.verbose > 0:
            keras_hooks.print_msg(f"\nEpoch {epoch + 1}: saved the model to {filepath}")
