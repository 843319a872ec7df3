"""BackupAndRestore: resume after a crash where training stopped, to the uninterrupted result."""

from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path

import keras

from kmirror._core import cluster, keras_hooks
from kmirror._core.callbacks.backup_folder import (
    INDEX,
    Backup,
    Position,
    files,
    latest,
    read_reached,
    write_reached,
)
from kmirror._core.files import atomic_path, check_writable, digest

__all__ = ["BackupAndRestore", "Position", "Backup"]


class BackupAndRestore(keras.callbacks.Callback):
    """Backs training up as it goes; after a crash, the relaunched script resumes where it was.

    Keras' `BackupAndRestore`, with the same arguments, for data-parallel training: the chief
    writes the backup (weights, optimizer state, and how far training got) into `backup_dir`; on
    the next `fit`, every process resumes from the chief's backup, which the chief sends to the
    others (their own folders may be empty: no shared filesystem is needed). With `save_freq`
    a number of batches, a `kmirror.wrap` model resumes inside the interrupted epoch: it skips the
    batches already trained and draws the others as the uninterrupted run does, and ends with its
    weights and optimizer state (Keras restarts the interrupted epoch). The batches are skipped
    exactly for numpy arrays, `tf.data` (a seeded `shuffle` too) and PyDatasets of known length
    (shuffled too); other input restarts the epoch, with a warning (docs/callbacks.md).

    A backup is a weights file and a small `backup.json` naming it with a checksum, each written
    under a temporary name and renamed into place, so a crash at any moment leaves a complete
    backup. State a wrapped model's steps write that the model does not hold (a seed generator
    or a `tf.Variable` on another object: no weights file holds it) is written beside it, in a
    `.reached.npz` file, and resumed too. The backup is deleted when training ends normally
    (unless `delete_checkpoint=False`). On `SIGTERM` a wrapped model's `fit` backs up where
    training stands and exits (`_core.callbacks.preemption`).

    Example:

    ```python
    backup = kmirror.callbacks.BackupAndRestore("/tmp/backup", save_freq=100)
    model.fit(x, y, epochs=20, callbacks=[backup])
    # ... the process is killed in epoch 7; run the same script again: it resumes there.
    ```

    Args:
        backup_dir: a folder for the backup, used by this training run alone.
        save_freq: "epoch" (back up at the end of every epoch), a number of batches between
            backups, or False (no backups written; an existing one is still restored).
        double_checkpoint: keep the previous backup too, and resume from it when the latest one
            is missing or corrupt (twice the disk space).
        delete_checkpoint: remove the backup when training ends normally.
    """

    def __init__(
        self, backup_dir, save_freq="epoch", double_checkpoint=False, delete_checkpoint=True
    ) -> None:
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore needs a backup_dir, e.g. '/tmp/backup'.")
        periodic = isinstance(save_freq, int) and not isinstance(save_freq, bool)
        if not (save_freq == "epoch" or save_freq is False or (periodic and save_freq >= 1)):
            raise ValueError(
                f"BackupAndRestore: save_freq must be 'epoch', a number of batches >= 1, or False "
                f"(no backups); got {save_freq!r}."
            )
        self.backup_dir = Path(backup_dir)
        self.save_freq = save_freq
        self._every = save_freq if periodic else None  # batches between backups
        self.double_checkpoint = bool(double_checkpoint)
        self.delete_checkpoint = bool(delete_checkpoint)
        self._index = self.backup_dir / INDEX
        #: Set by a kmirror model's fit: the position every process resumes from, and the files
        #: (the weights, the state the steps reached).
        self._agreed: tuple[Position, Path | None, Path | None] | None = None
        self._position = Position(0, 0)
        self._first_step = 0  # batches of the current epoch trained before this fit
        self._since_backup = 0
        self._backed_up: Position | None = None
        self._written: dict = {}  # the index entry in the folder (the chief's)
        #: Where training ended: the epoch after the last one whose end was reached.
        self._ended_at = Position(0, 0)
        #: Set by kmirror's preemption watch for one fit: it decides, at the end of training,
        #: whether the backup is removed (`remove`) or kept for a relaunch (`back_up_end`).
        self.end_decided_elsewhere = False

    # -- what a relaunch resumes from ----------------------------------------------------------
    def latest(self) -> Backup | None:
        """The newest intact backup in `backup_dir` (the previous one when the latest is corrupt
        and `double_checkpoint` kept it); None when there is none."""
        return latest(self.backup_dir, self.double_checkpoint)

    def resume_from(
        self, position: Position | None, weights: Path | None, reached: Path | None = None
    ) -> None:
        """Called by a kmirror model's `fit` before training, on every process: the chief's
        position (None: no backup), and this process's files to load (the chief's only)."""
        self._agreed = None if position is None else (position, weights, reached)

    # -- Keras' callback hooks -----------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model = self.model
        if cluster.is_chief(model):
            check_writable(self.backup_dir, "backups")
            self._written = json.loads(self._index.read_text()) if self._index.exists() else {}
        agreed, self._agreed = self._agreed, None
        if agreed is None and not hasattr(model, "take_chief_state"):
            agreed = self._for_plain_model()
        self._since_backup, self._backed_up, self._first_step = 0, None, 0
        self._ended_at = Position(0, 0)
        if agreed is None:
            return
        position, weights, reached = agreed
        if model.optimizer is not None and not model.optimizer.built:
            raise ValueError("BackupAndRestore needs a built model; call it on a batch first.")
        if weights is not None:
            model.load_weights(weights)
        if reached is not None:
            model.restore_reached_state(read_reached(reached))
        if hasattr(model, "take_chief_state"):
            model.take_chief_state()  # every process: the chief's loaded state
        keras_hooks.resume_at_epoch(model, position.epoch)
        self._position = position
        self._first_step = position.step
        self._backed_up = position
        self._ended_at = Position(position.epoch, 0)

    def _for_plain_model(self):
        """A model kmirror does not train resumes at the start of the interrupted epoch."""
        found = self.latest()
        if found is None:
            return None
        position, weights = found.position, found.weights
        if position.step:
            warnings.warn(
                f"kmirror: this model is not a kmirror.wrap model: training restarts epoch "
                f"{position.epoch + 1} from its first batch, as Keras' BackupAndRestore does.",
                stacklevel=2,
            )
        return Position(position.epoch, 0), weights, None

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._position.epoch:
            self._first_step = 0
        self._position = Position(epoch, self._first_step)

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the last batch of the call (several with steps_per_execution).
        step = self._first_step + batch + 1
        self._since_backup += step - self._position.step
        self._position = Position(self._position.epoch, step)
        if self._every is not None and self._since_backup >= self._every:
            self._back_up(self._position)

    def on_epoch_end(self, epoch, logs=None):
        done = self._ended_at = Position(epoch + 1, 0)
        if self.save_freq == "epoch":
            self._back_up(done, inside_epoch=False)
        elif self._every and self._backed_up == self._position and cluster.is_chief(self.model):
            # The last backup holds the whole epoch: resume at the next one.
            self._write_index(done, self._written, False)
        self._first_step = 0

    def on_train_end(self, logs=None):
        if not self.end_decided_elsewhere:
            self.remove()

    def remove(self) -> None:
        """Removes the backup, as training that ended normally does (the chief; unless
        `delete_checkpoint=False`)."""
        if self.delete_checkpoint and cluster.is_chief(self.model) and self._index.exists():
            self._index.unlink()
            for file in files(self.backup_dir):
                file.unlink(missing_ok=True)
            if not any(self.backup_dir.iterdir()):
                os.rmdir(self.backup_dir)

    # -- writing -------------------------------------------------------------------------------
    def back_up_now(self) -> Position:
        """Backs up where training stands, between two batches (the chief writes); returns
        the position."""
        self._back_up(self._position)
        return self._position

    def back_up_end(self) -> Position:
        """Backs up the end of training (the chief writes): a relaunch resumes there, with no
        batch left to train, and goes on with the script after `fit`. Returns the position."""
        self._back_up(self._ended_at, inside_epoch=False)
        return self._ended_at

    def _back_up(self, position: Position, inside_epoch: bool = True) -> None:
        self._since_backup = 0
        self._backed_up = position
        if not cluster.is_chief(self.model):
            return
        name = f"epoch{position.epoch:05d}-step{position.step:07d}"
        with atomic_path(self.backup_dir / f"{name}.weights.h5") as partial:
            self.model.save_weights(partial, overwrite=True)
        written = {"weights": f"{name}.weights.h5"}
        written["sha256"] = digest(self.backup_dir / written["weights"])
        reached = getattr(self.model, "reached_state", list)()
        written.update(write_reached(self.backup_dir, name, reached) if reached else {})
        self._write_index(position, written, inside_epoch)

    def _write_index(self, position, written: dict, inside_epoch: bool) -> None:
        """Names the backup's files (`written`: its weights file, the state the steps reached,
        and their checksums) at `position`."""
        before = self._written
        weights = written["weights"]
        names = ("weights", "sha256", "reached", "reached_sha256")
        entry = {"epoch": position.epoch, "step": position.step}
        entry.update({k: written[k] for k in names if k in written})
        entry["python_random"] = self._python_random(inside_epoch)
        previous = before if before.get("weights") != weights else before.get("previous")
        if self.double_checkpoint and previous:
            entry["previous"] = {k: v for k, v in previous.items() if k != "previous"}
        with atomic_path(self._index) as partial, open(partial, "w") as f:
            json.dump(entry, f)
        self._written = entry
        kept = {entry.get(k) for k in ("weights", "reached")}
        kept |= {entry.get("previous", {}).get(k) for k in ("weights", "reached")}
        for old in files(self.backup_dir):
            if old.name not in kept:
                old.unlink(missing_ok=True)

    def _python_random(self, inside_epoch: bool) -> list[int]:
        """The state of Python's `random` module the resumed epoch draws its batch order from:
        the one the current epoch drew from (a `PyDataset`'s order, see `_core.feed.py_datasets`)
        inside an epoch, the current one between epochs."""
        drawn = None
        if inside_epoch:
            drawn = getattr(self.model, "batch_order_drawn_from", lambda: None)()
        _, words, _ = drawn or random.getstate()
        return list(words)
