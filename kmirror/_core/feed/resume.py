"""Where a relaunched `fit` resumes: every process agrees on the chief's backup.

The chief reads its newest intact backup of the `kmirror.callbacks.BackupAndRestore` among the
callbacks (other processes' folders are not read: no shared filesystem is needed); every process
learns its position through the reducer's job (`Job.gather_counts`), and the state of Python's
`random` module the resumed epoch draws its batch order from through `Job.broadcast`. The weights
follow in the callback's `on_train_begin` (`MirroredModel.take_chief_state`).

Example:

```python
position = resume.agree(reducer, fit_arguments)   # None: training starts from the beginning
```
"""

from __future__ import annotations

import random
import warnings

import keras
import tensorflow as tf

from kmirror._core.callbacks.backup import BackupAndRestore, Position
from kmirror._core.feed import feeding, py_datasets
from kmirror.reducers.base import Reducer

__all__ = ["agree", "skippable"]

# The words of the state of Python's random module (version 3: 624 words and a position).
_WORDS = 625


def agree(reducer: Reducer, arguments: dict) -> Position | None:
    """The position every process resumes from (None: no backup, or no `BackupAndRestore`).
    Inside an epoch only for input whose batches can be skipped (`skippable`)."""
    callbacks = arguments.get("callbacks") or []
    backup = next((c for c in callbacks if isinstance(c, BackupAndRestore)), None)
    if backup is None:
        return None
    found, error = None, None
    if reducer.job.is_chief:
        try:
            found = backup.latest()
        except ValueError as problem:
            error = problem
    # Other processes offer values below any the chief can, so the largest is the chief's.
    mine = (-3, 0) if error else (found.position if found else (-1, 0))
    epoch = max(reducer.job.gather_counts(mine[0] if reducer.job.is_chief else -4))
    step = max(reducer.job.gather_counts(mine[1] if reducer.job.is_chief else -1))
    if error is not None:
        raise error
    if epoch == -3:
        raise ValueError(
            "kmirror.callbacks.BackupAndRestore: the chief's backup cannot be resumed; its "
            "error names the fix."
        )
    if epoch < 0:
        backup.resume_from(None, None)
        return None
    if step and not skippable(arguments):
        warnings.warn(
            f"kmirror: training resumes at the start of epoch {epoch + 1}, whose first "
            f"{step} batch(es) were trained before the interruption: only numpy arrays, "
            "tf.data datasets and PyDatasets of known length, without steps_per_epoch, "
            "resume inside an epoch.",
            stacklevel=3,
        )
        step = 0
    _take_chief_python_random(reducer, found.python_random if found else None)
    position = Position(epoch, step)
    backup.resume_from(position, *((found.weights, found.reached) if found else (None, None)))
    return position


def skippable(arguments: dict) -> bool:
    """Whether `fit`'s input can start inside an epoch: numpy arrays, `tf.data` datasets and
    PyDatasets of known length, without `steps_per_epoch`."""
    if arguments.get("steps_per_epoch"):
        return False
    x = arguments.get("x")
    if isinstance(x, tf.data.Dataset) or py_datasets.readable(x, None):
        return True
    return feeding.is_arrays(x, arguments.get("y"), arguments.get("sample_weight"))


def _take_chief_python_random(reducer: Reducer, words: list[int] | None) -> None:
    """Every process takes the state of Python's `random` module the chief's backup holds (the
    chief's own state when it holds none): the resumed epoch draws its batch order from it, as
    the uninterrupted run did."""
    if reducer.job.is_chief and words is None:
        words = list(random.getstate()[1])
    if reducer.job.num_processes > 1:
        shared = keras.Variable(words or [0] * _WORDS, dtype="int64", trainable=False)
        reducer.job.broadcast([shared])
        words = [int(w) for w in keras.ops.convert_to_numpy(shared)]
    random.setstate((3, tuple(words), None))
