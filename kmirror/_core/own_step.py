"""A model's own `train_step`, `test_step` or `predict_step`, run data-parallel.

Each replica runs the model's own step, unchanged, on its rows of the global batch: the user's
`GradientTape`, `compute_loss`, `optimizer.apply_gradients` (one optimizer or several) and metric
updates. Three things make the replicas' steps add up to the single-device step:

- **Losses** are those of the replica's rows: Keras losses and means over the rows come out as
  the replica's mean (`_core.keras_hooks`), so the replica's gradient times its share of the
  rows is its part of the single-device gradient.
- **`apply_gradients`** of every optimizer the model holds first weighs the replica's gradients
  by its share of the rows and sums them over the replicas (`Reducer.reduce_in_replica`, the same
  reducer as kmirror's own step), then applies the sum on each replica, as one device would.
- **Metrics** the step updates hold, on every replica, the state one device's update on the
  global batch gives. A metric whose state adds up over rows (`_core.metric_states.adds_up`:
  Keras' accuracies, AUC, Precision, ...) updated with per-row values (labels, predictions,
  weights) adds the sum over replicas of what each replica's rows add: one all-reduce of its
  state, no prediction gathered. Any other update gets global values: a scalar (a loss) becomes
  the mean over the global batch (the share-weighted sum over replicas), a scalar
  `sample_weight` (a row count) the sum over replicas, and per-row tensors every replica's rows
  joined in row order. So the step's returned logs are the global values.

What a step must do for this to hold is in docs/concepts.md ("A model's own train_step").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from kmirror._core import draws, keras_hooks, metric_states, mirroring, sparse_gradients
from kmirror._core.feed import placement
from kmirror._core.layer_state import LayerState, after
from kmirror.reducers.base import Reducer

__all__ = [
    "overridden",
    "build_optimizers",
    "train",
    "evaluate",
    "predict",
]

_STEPS = ("train_step", "test_step", "predict_step")


def overridden(model: keras.Model) -> set[str]:
    """Which of the Keras steps `model`'s class overrides."""
    return {name for name in _STEPS if getattr(type(model), name) is not getattr(keras.Model, name)}


@contextlib.contextmanager
def _hooked(model: keras.Model):
    """While the model's own step runs on the replicas: its optimizers' `apply` and its metrics'
    `update_state` are replaced, on the objects, by methods that reduce or globalise inside a
    replica (and do what the class does elsewhere); the objects are as they were afterwards."""
    replaced = [(o, "apply", _reducing_apply) for o in mirroring.optimizers(model)]
    replaced += [(m, "update_state", _globalising_update) for m in model.metrics]
    with keras_hooks.methods_replaced(replaced):
        yield


def _reducing_apply(optimizer, grads, trainable_variables=None):
    """`optimizer.apply` that, inside a replica's own step, applies the sum over the replicas of
    their parts of the gradient."""
    apply = type(optimizer).apply
    rows = keras_hooks.current()
    if rows is None or rows.reduce_gradients is None:
        return apply(optimizer, grads, trainable_variables)
    if trainable_variables is not None:  # read once: it may be an iterator
        trainable_variables = list(trainable_variables)
    if not optimizer.built:
        # Keras builds an optimizer on its first update. Its variables are made outside the
        # step's graph, mirrored like the model's: once, in cross-replica context.
        def build(_):
            with tf.init_scope(), rows.variable_scope():
                optimizer.build(trainable_variables)

        tf.distribute.get_replica_context().merge_call(build)
    parts = [None if g is None else _part(g, rows) for g in grads]
    shared = sparse_gradients.shared_lookups(parts, rows.data, trainable_variables)
    sent, lookups = sparse_gradients.apart(parts, shared)
    try:
        summed = sparse_gradients.together(rows.reduce_gradients(sent), lookups)
    except RuntimeError as error:
        if "merge_call" not in str(error):
            raise
        raise ValueError(
            "kmirror: the model's own train_step calls apply_gradients inside a condition or loop "
            "of the step (tf.cond, tf.while_loop, or Python if/for on tensors under autograph) "
            "or inside a nested tf.function; the sum of the gradients over the replicas cannot "
            "run there. Call apply_gradients at the top level of train_step; to skip an update "
            "conditionally, multiply the gradients by 0 or 1 instead."
        ) from None
    return apply(optimizer, summed, trainable_variables)


def build_optimizers(model: keras.Model, reducer: Reducer, data) -> None:
    """Builds the optimizers the model's own train_step builds on its first update.

    Keras builds an optimizer when it first applies gradients, with the variables it is given.
    Inside Keras' traced train function its own (single-device) strategy is active and refuses
    mirrored variables, so the step is traced once beforehand, before `fit` traces it, and never
    run: each optimizer builds during that trace, at its first `apply_gradients`.
    """
    if all(optimizer.built for optimizer in mirroring.optimizers(model)):
        return
    probe = tf.function(lambda batch: _run(model.train_step, model, reducer, batch, True))
    probe.get_concrete_function(data)


def _part(gradient, rows: keras_hooks.Rows):
    """The replica's gradient weighed by its share of the rows (nothing without rows)."""
    if isinstance(gradient, tf.IndexedSlices):
        share = rows.share(gradient.values.dtype)
        weighted = tf.IndexedSlices(gradient.values * share, gradient.indices, gradient.dense_shape)
    else:
        gradient = tf.convert_to_tensor(gradient)
        weighted = gradient * rows.share(gradient.dtype)
    return rows.only_with_rows(weighted)


_updating = threading.local()


def _globalising_update(metric, *args, **kwargs):
    """`metric.update_state` that, inside a replica's own step, updates with global values."""
    update_state = type(metric).update_state
    rows = keras_hooks.current()
    if rows is None or rows.all_gather is None or getattr(_updating, "active", False):
        return update_state(metric, *args, **kwargs)
    _updating.active = True  # a metric that updates inner metrics passes them global values
    try:
        if metric_states.adds_up(metric) and _per_row((args, kwargs)):
            added = metric_states.contribution(metric, *args, **kwargs)
            metric_states.add(metric, rows.all_sum(added))
            return None
        args = [_global(value, rows, count=False) for value in args]
        kwargs = {
            name: _global(value, rows, count=name == "sample_weight")
            for name, value in kwargs.items()
        }
        return update_state(metric, *args, **kwargs)
    finally:
        _updating.active = False


def _per_row(values) -> bool:
    """Whether every tensor among `values` holds one value per row (none is a scalar)."""
    leaves = [v for v in tf.nest.flatten(values) if v is not None and not isinstance(v, str | bool)]
    return bool(leaves) and all(tf.convert_to_tensor(v).shape.rank != 0 for v in leaves)


def _global(value, rows: keras_hooks.Rows, count: bool):
    """The global counterpart of a value a replica passes to a metric."""

    def one(leaf):
        if leaf is None or isinstance(leaf, str | bool):
            return leaf
        tensor = tf.convert_to_tensor(leaf)
        if tensor.shape.rank != 0:
            return rows.all_gather(tensor)  # per-row values: every replica's rows, in row order
        if count:
            return rows.all_sum(tensor)
        if not tensor.dtype.is_floating:
            tensor = tf.cast(tensor, tf.float32)
        part = tensor * rows.share(tensor.dtype)  # a mean over the replica's rows
        return rows.all_sum(rows.only_with_rows(part))

    return tf.nest.map_structure(one, value)


def _run(
    method: Callable,
    model: keras.Model,
    reducer: Reducer,
    data,
    global_statistics: bool,
    place=None,
):
    """`method(rows)` on every replica; the first local replica's result (all are equal).
    `data` is the global batch, or this process's rows of it at `place` (`placement.split`)."""
    shards = placement.split(reducer, data, place)
    globalised = [v for metric in model.metrics for v in metric.variables]
    state = LayerState(model, reducer, global_statistics, left=globalised)

    def local(shard):
        rows_data, start, total = shard
        start, total = placement.placed(reducer, rows_data, start, total, place)
        rows = keras_hooks.Rows(
            start=start,
            count=placement.batch_size(rows_data),
            total=total,
            all_sum=reducer.all_sum,
            global_statistics=global_statistics,
            reduce_gradients=reducer.reduce_in_replica,
            all_gather=reducer.all_gather,
            variable_scope=reducer.scope,
            data=rows_data,
        )
        before = state.before()
        with keras_hooks.replica(rows), state.recording():
            result = method(rows_data)
        return after(state.combine(before), result)

    with _hooked(model), draws.watched():
        return reducer.run(local, args=(shards,))


def _first(reducer: Reducer, per_replica) -> Any:
    return tf.nest.map_structure(lambda v: reducer.local_values(v)[0], per_replica)


def train(model: keras.Model, reducer: Reducer, data, global_statistics: bool = True, place=None):
    """The model's own train_step on every replica; its logs (global values)."""
    return _first(reducer, _run(model.train_step, model, reducer, data, global_statistics, place))


def evaluate(model: keras.Model, reducer: Reducer, data, place=None):
    """The model's own test_step on every replica; its logs (global values)."""
    return _first(reducer, _run(model.test_step, model, reducer, data, False, place))


def predict(model: keras.Model, reducer: Reducer, data, place=None):
    """The model's own predict_step on every replica, the outputs joined in row order."""
    return reducer.concat(_run(model.predict_step, model, reducer, data, False, place))
