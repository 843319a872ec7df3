"""`MirroredModel.explain`: what a step of a wrapped model does where, for one batch.

The step is traced once, as Keras traces it, on the first batch of the data given; nothing runs,
no weight changes. While it traces, kmirror records which layer calls run on each replica's rows,
which run on the whole batch on every replica and why, and which reductions over the rows became
sums over the replicas (`keras_hooks.explaining`).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from kmirror._core import keras_hooks, python_draws

__all__ = ["explain", "STEPS"]

#: The step of each kind, by the name `explain` takes.
STEPS = {"train": "train_step", "test": "test_step", "predict": "predict_step"}


def explain(model, build, x, y, sample_weight, batch_size: int, step: str):
    """The `keras_hooks.Explanation` of `model`'s (a `MirroredModel`) `step` on the first
    `batch_size` rows of `x` (`y`, `sample_weight`); `build(data, step_name)` builds what the
    step needs first, as before a first step."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {sorted(STEPS)}; got {step!r}.")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}.")

    def first(values):
        return tf.nest.map_structure(
            lambda a: tf.convert_to_tensor(np.asarray(a)[:batch_size]), values
        )

    if step == "predict":
        data = (first(x),)
    else:
        data = keras.utils.pack_x_y_sample_weight(
            first(x),
            None if y is None else first(y),
            None if sample_weight is None else first(sample_weight),
        )
    name = STEPS[step]
    build(data, name)
    with keras_hooks.explaining() as explanation, python_draws.unchanged():  # never run
        traced = tf.autograph.experimental.do_not_convert(getattr(model, name))  # as Keras traces
        tf.function(traced, autograph=False).get_concrete_function(data)
    return explanation
