"""kmirror's own errors (bad input raises ValueError or TypeError, as Keras does).

Example:

```python
import kmirror, keras, numpy as np
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model = kmirror.wrap(model)
try:
    model.fit(np.random.rand(32, 8), np.random.rand(32, 1), epochs=1)
except kmirror.errors.PeerLost as lost:     # another process of the job stopped
    print(lost)                             # it says how to relaunch
```
"""

from __future__ import annotations

import contextlib
import re

import keras
import tensorflow as tf

__all__ = [
    "PeerLost",
    "NonFiniteLoss",
    "reason",
    "NonFiniteWatch",
    "NON_FINITE",
    "ROWS",
    "DIVERGED",
    "state_checked",
    "steps_taken",
]

#: The marker of the training step's check that the global loss is finite; the check's message
#: carries the global batch's rows after `ROWS`.
NON_FINITE = "kmirror: the global loss is not finite"
ROWS = "rows of the global batch:"
#: The marker of a step's check that the replicas wrote a weight declared
#: `aggregation="none"` alike (`_core.layer_state`).
DIVERGED = "kmirror: the replicas wrote different values to the layer weight"


class PeerLost(RuntimeError):
    """Another process of a multi-process job stopped, so this one cannot go on.

    Relaunch every process; with `kmirror.callbacks.BackupAndRestore` training resumes from the
    chief's last backup.
    """


class NonFiniteLoss(FloatingPointError):
    """The training loss of a global batch became NaN or infinite; every process stopped there.

    Every process sees the same global loss, so all stop at the same step, before it updates any
    variable: the model holds the weights and optimizer state of the last finite step.
    """


class NonFiniteWatch(keras.callbacks.Callback):
    """Where training is, for the message of `NonFiniteLoss` (epoch hooks only: Keras still
    dispatches the batch hooks without waiting for the step's logs)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.first_step = epoch, steps_taken(self.model)

    def describe_non_finite(self, error: BaseException) -> str:
        """What the step's failed check (`error`) says, for the user: where training stopped,
        and, where the batch left replicas without rows, that they added nothing."""
        batch = steps_taken(self.model) - self.first_step + 1  # the failed step updated nothing
        where = f"at epoch {self.epoch + 1}, batch {batch}"
        found = re.search(re.escape(ROWS) + r"\D*(\d+)", str(error))
        rows, replicas = int(found.group(1)) if found else None, self.model.num_replicas
        stopped = "every process stopped at this step"
        if rows is not None and rows < replicas:
            return (
                f"kmirror: the training loss became NaN or infinite {where}, a batch of {rows} "
                f"row(s) on {replicas} replicas; {stopped}. The {replicas - rows} replica(s) "
                "without rows added nothing to the step (kmirror discards what a replica without "
                "rows computes), so the value came from this batch's rows or the weights. If those "
                "rows are finite and one device trains on the same data, this is a kmirror bug: "
                "report it. Meanwhile, a batch size that leaves no final batch smaller than the "
                "replica count avoids it (or drop the final batch: tf.data's "
                f"batch(..., drop_remainder=True)). {_KEPT}"
            )
        return (
            f"kmirror: the training loss became NaN or infinite {where}; {stopped}. Look for NaN "
            "or infinite values in the data (numpy: np.isfinite(x).all()), lower the learning "
            "rate, or clip gradients (e.g. optimizer=keras.optimizers.SGD(..., clipnorm=1.0)), "
            f"then train again from the last checkpoint. {_KEPT}"
        )


_KEPT = "The model holds the weights of the last step before this one (this step updated nothing)."


@contextlib.contextmanager
def state_checked():
    """The context a step runs in: a layer weight the replicas wrote differently raises a
    ValueError that names the weight and the fix (the step's check fails in TensorFlow)."""
    try:
        yield
    except tf.errors.InvalidArgumentError as error:
        found = re.search(re.escape(DIVERGED) + r"[^\]\n]*", str(error))
        if found is None:
            raise
        # TensorFlow prints the check's message as a string literal: its quotes come escaped.
        raise ValueError(found.group(0).replace("\\'", "'")) from None


def steps_taken(model) -> int:
    """The steps `model`'s optimizer has taken, as a Python int."""
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


_TELLING = ("connection", "collective", "timed out", "unavailable", "reset", "closed", "shut down")


def reason(error: BaseException) -> str:
    """The line of a low-level (TensorFlow, gRPC, Gloo) error message that says what happened."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = [line for line in lines if any(word in line.lower() for word in _TELLING)]
    return (telling or lines or [type(error).__name__])[0][:300]
