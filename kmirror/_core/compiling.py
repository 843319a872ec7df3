"""What a wrapped model compiles with, taken from the user's compiled model.

The user's model keeps its own compile settings: its optimizer trains, its loss and metrics are
the step's. The wrapped model compiles with the same optimizer, and with copies of the loss and
metrics for the logs (the step updates them once per global batch); a model whose own
`train_step` or `test_step` runs logs with the user's model's metrics instead. The outer step is
never XLA-compiled: `jit_compile` applies to each replica's forward and backward pass.

Example:

```python
arguments, replica_jit_compile = outer(model, own_training=False, sync_batch_norm=True)
with in_floatx_of(model):
    keras.Model.compile(wrapped, **arguments)
```
"""

from __future__ import annotations

import contextlib
import warnings

import keras
import tensorflow as tf

from kmirror._core import keras_hooks
from kmirror._core.building import every_layer

__all__ = ["outer", "in_floatx_of"]


def outer(model: keras.Model, own_training: bool, sync_batch_norm: bool) -> tuple[dict, bool]:
    """The arguments the wrapped model compiles with, and whether each replica's pass is
    compiled with XLA."""
    common = dict(
        optimizer=model.optimizer,
        run_eagerly=model.run_eagerly,
        steps_per_execution=model.steps_per_execution,
        jit_compile=False,
    )
    if own_training:  # the user's model's metrics are the wrapped model's
        return common, False
    replica_jit_compile = bool(model.jit_compile) and not model.run_eagerly
    if replica_jit_compile and sync_batch_norm and _has_batch_norm(model):
        warnings.warn(
            "kmirror: the replicas' forward and backward passes are not compiled with XLA: "
            "BatchNormalization sums its statistics over the replicas inside that pass, which "
            "XLA cannot compile here. Pass sync_batch_norm=False to kmirror.wrap to compile "
            "them (each replica then normalises with its own rows' statistics).",
            stacklevel=4,
        )
        replica_jit_compile = False
    config = keras_hooks.compile_arguments(model)
    arguments = dict(
        common,
        loss=config.get("loss"),
        loss_weights=config.get("loss_weights"),
        metrics=_fresh(config.get("metrics")),
        weighted_metrics=_fresh(config.get("weighted_metrics")),
        auto_scale_loss=False,  # the user's optimizer already scales the loss
    )
    return arguments, replica_jit_compile


@contextlib.contextmanager
def in_floatx_of(model: keras.Model):
    """Keras' float type as it was when `model` was compiled (its loss tracker's), for the
    wrapped model's compile: its logs are kept in that type, as the model's own are."""
    tracker = keras_hooks.loss_tracker(model)
    before = keras.config.floatx()
    keras.config.set_floatx(tracker.dtype if tracker is not None else before)
    try:
        yield
    finally:
        keras.config.set_floatx(before)


def _has_batch_norm(model: keras.Model) -> bool:
    return any(isinstance(layer, keras.layers.BatchNormalization) for layer in every_layer(model))


def _fresh(metrics):
    """Copies of the user's metric objects (with their names): the wrapped model's logs never
    share the state of the user's model's metrics."""

    def copy(metric):
        if isinstance(metric, keras.metrics.Metric):
            return type(metric).from_config(metric.get_config())
        return metric

    return None if metrics is None else tf.nest.map_structure(copy, metrics)
