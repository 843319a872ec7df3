"""Keras' own file-writing callbacks in a job of several processes: written once, by the chief.

The callback list a user already has goes to a wrapped model's `fit` unchanged. In a job of
several processes (Horovod ranks, `ring` workers) every process runs the callbacks, so Keras' own
callbacks that write files would write each file once per process: twice the event files in a
TensorBoard folder, and two writers racing on one checkpoint on a shared filesystem. For the
length of a `fit`, `evaluate` or `predict` call:

- `ModelCheckpoint` runs on every process (the logs are global, so each decides alike which epoch
  is best) and saves from the chief only, under a temporary name renamed into place, as
  `kmirror.callbacks.ChiefCheckpoint` does (a subclass that saves in its own way runs on the
  chief only);
- `TensorBoard` and `CSVLogger`, which decide nothing, run on the chief only;
- the Keras callbacks of experiment trackers, MLflow's (`mlflow.keras.MlflowCallback`, the one
  `mlflow.tensorflow.autolog()` adds) and Weights & Biases' (`WandbMetricsLogger`,
  `WandbModelCheckpoint`, any callback whose class comes from the `mlflow` or `wandb` packages),
  run on the chief only: a job logs one run. Autologging is held off in the other processes
  (`_core.callbacks.trackers`);
- a callback, or a class of callbacks, given to `chief_only` runs on the chief only;
- Keras' `BackupAndRestore` is replaced, for a wrapped model's `fit`, by
  `kmirror.callbacks.BackupAndRestore` made with its arguments (`stand_ins`): the chief backs up,
  and a relaunch resumes inside the interrupted epoch exactly, on any number of processes. The
  Keras object is not run, but its fields read as Keras' own would (`_current_epoch`,
  `_last_batch_seen`, and the paths of the latest and previous backups: kmirror's files). A
  subclass of it, whose hooks kmirror would not run, is refused with an error naming kmirror's.

Ray Train's `ReportCheckpointCallback` reports a checkpoint from the chief only
(`_core.callbacks.ray_train`).

kmirror's own callbacks (unless given to `chief_only`), and every other callback
(`EarlyStopping`, `ReduceLROnPlateau`, ...: the same decisions on every process), run as given.
Within one process every callback runs as given.

Example:

```python
with written_once(callbacks, reducer.job) as chosen:
    keras.Model.fit(model, x, y, callbacks=chosen)
```
"""

from __future__ import annotations

import contextlib
import weakref

import keras

from kmirror._core import keras_hooks
from kmirror._core.callbacks import ray_train, trackers
from kmirror._core.callbacks.backup import BackupAndRestore
from kmirror._core.callbacks.checkpoint import ChiefCheckpoint
from kmirror._core.callbacks.tensorboard import ChiefTensorBoard

__all__ = ["check", "chief_only", "stand_ins", "written_once"]

_OWN = (ChiefCheckpoint, ChiefTensorBoard, BackupAndRestore)
#: Run by the chief only. A `ModelCheckpoint` whose class saves in its own way is too.
_CHIEF_ONLY = (
    keras.callbacks.TensorBoard,
    keras.callbacks.CSVLogger,
    keras.callbacks.ModelCheckpoint,
)


#: The top-level packages of experiment trackers whose Keras callbacks run on the chief only.
_TRACKERS = ("mlflow", "wandb")
#: The callbacks, and classes of callbacks, given to `chief_only`.
_MARKED = weakref.WeakSet()


#: Callbacks that change training, which every process must run alike: never chief-only.
_DECIDING = (
    keras.callbacks.BackupAndRestore,
    BackupAndRestore,
    keras.callbacks.EarlyStopping,
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.LearningRateScheduler,
    keras.callbacks.TerminateOnNaN,
)


def chief_only(callback):
    """Runs `callback` (a Keras callback, or a class of them) on the chief alone in a job of
    several processes, and returns it: for a callback that writes (a tracker's, a file, a
    message), which every process would otherwise run with the same logs. Such a callback must
    not change training (stop it, change the learning rate) nor train, evaluate or predict: every
    process of a job takes part in each step. Keras' callbacks that do are refused.

    Example:

    ```python
    model.fit(x, y, callbacks=[kmirror.callbacks.chief_only(MyLogger("runs"))])
    ```
    """
    if not (
        isinstance(callback, keras.callbacks.Callback)
        or (isinstance(callback, type) and issubclass(callback, keras.callbacks.Callback))
    ):
        raise TypeError(
            f"kmirror.callbacks.chief_only takes a keras.callbacks.Callback or a subclass of it; "
            f"got {callback!r}."
        )
    kind = callback if isinstance(callback, type) else type(callback)
    if issubclass(kind, _DECIDING):
        raise ValueError(
            f"kmirror.callbacks.chief_only: {kind.__name__} changes training, so every process "
            "must run it (it decides alike everywhere from the same global logs, and kmirror "
            "writes its files from the chief alone already): pass it to fit as it is."
        )
    _MARKED.add(callback)
    return callback


def _given_to_chief(callback) -> bool:
    """Whether `callback` was given to `chief_only` (itself or a class it is of), or is an
    experiment tracker's."""
    if callback in _MARKED:
        return True
    return any(
        kind in _MARKED or kind.__module__.partition(".")[0] in _TRACKERS
        for kind in type(callback).__mro__
    )


#: Each of Keras' own `BackupAndRestore` objects given to a `fit`, and kmirror's in its place
#: (the same one at every `fit` it is given to).
_STOOD_IN = weakref.WeakKeyDictionary()


def stand_ins(callbacks):
    """`callbacks` (a list, or None) with Keras' own `BackupAndRestore` replaced by kmirror's,
    made with its arguments."""
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    chosen = []
    for callback in callbacks:
        if type(callback) is keras.callbacks.BackupAndRestore:
            if callback not in _STOOD_IN:
                _STOOD_IN[callback] = _StandIn(callback)
            callback = _STOOD_IN[callback]
        chosen.append(callback)
    return chosen


class _StandIn(BackupAndRestore):
    """kmirror's BackupAndRestore made with the arguments of Keras' `keras_own`, keeping that
    object's fields as Keras' hooks would set them (read by whoever holds Keras' object; checked
    on Keras 3.12 to 3.15): `_current_epoch` the epochs done, `_last_batch_seen` the last batch
    of the epoch (0 after it), and `_weights_path`, `_training_metadata_path` and their
    `_prev_` forms the chief's files of the latest and previous backups."""

    def __init__(self, keras_own: keras.callbacks.BackupAndRestore) -> None:
        super().__init__(
            keras_own.backup_dir,
            save_freq=keras_own.save_freq,
            double_checkpoint=keras_own.double_checkpoint,
            delete_checkpoint=keras_own.delete_checkpoint,
        )
        self._keras_own = weakref.ref(keras_own)  # Keras' object keys `_STOOD_IN`

    def _show(self, **fields) -> None:
        keras_own = self._keras_own()
        if keras_own is None:
            return
        for name, value in fields.items():
            setattr(keras_own, name, value)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self._every is not None:
            self._show(_last_batch_seen=self._position.step - 1)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._show(_current_epoch=epoch + 1, _last_batch_seen=0)

    def _write_index(self, position, written: dict, inside_epoch: bool) -> None:
        super()._write_index(position, written, inside_epoch)
        previous = self._written.get("previous", {}).get("weights")
        self._show(
            _weights_path=str(self.backup_dir / written["weights"]),
            _training_metadata_path=str(self._index),
            **(
                {
                    "_prev_weights_path": str(self.backup_dir / previous),
                    "_prev_training_metadata_path": str(self._index),
                }
                if previous
                else {}
            ),
        )


def check(callbacks) -> None:
    """Raises a ValueError naming kmirror's callback for a Keras callback kmirror cannot run: a
    subclass of Keras' `BackupAndRestore` (Keras' own is replaced, see `stand_ins`)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for callback in callbacks or []:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            raise ValueError(
                f"{type(callback).__name__}, a subclass of keras.callbacks.BackupAndRestore, "
                "cannot resume a kmirror model: its hooks restart the interrupted epoch on each "
                "process. Use kmirror.callbacks.BackupAndRestore(backup_dir, save_freq=...) "
                "(Keras' arguments; subclass it if you need to), or Keras' own "
                "BackupAndRestore, which kmirror replaces by it."
            )


@contextlib.contextmanager
def written_once(callbacks, job):
    """The callbacks this process hands Keras, Keras' own writing once in the job (`job`: the
    reducer's `kmirror.reducers.Job`); a checkpoint saving from the chief only meanwhile."""
    if isinstance(callbacks, keras.callbacks.CallbackList) or job.num_processes == 1:
        check(callbacks)  # a CallbackList: fit's own, handed to its validation's evaluate
        yield callbacks
        return
    callbacks = list(callbacks or [])
    check(callbacks)
    chosen, hooked = [], []
    for callback in callbacks:
        if not job.is_chief and _given_to_chief(callback):
            continue
        if isinstance(callback, _OWN):
            chosen.append(callback)
        elif keras_hooks.saves_as_keras(callback):
            hooked.append(callback)
            chosen.append(callback)
        elif not isinstance(callback, _CHIEF_ONLY) or job.is_chief:
            chosen.append(callback)
    with (
        keras_hooks.checkpoints_written_by(hooked, ChiefCheckpoint._write_checkpoint),
        ray_train.chief_checkpoints(chosen, job.is_chief),
        trackers.autologging_on_chief_only(job.is_chief),
    ):
        yield chosen
