"""The data-parallel step: split the global batch, compute local gradients, reduce once, apply.

Replica `r` of `n` takes rows `[r*B//n, (r+1)*B//n)` of the global batch (or, when a process
holds only its rows of it, its share of those, knowing where they sit: `_core.feed.placement`) and
computes its part of the single-device loss of the global batch: Keras' losses divide by the
global batch's normalisers (rows, sample weights, unmasked entries), BatchNormalization uses the
global batch's statistics and random layers take the replica's rows of the draw one device would
make (`_core.keras_hooks`). The parts add up to the single-device loss, whatever B and n are, and
so do their gradients.

The reducer sums the gradients at one point, `Reducer.reduce_gradients`, and every replica then
applies the sum with its own copy of the optimizer, as one device would: clipping, gradient
accumulation, EMA and loss scaling see the global gradient. With gradient accumulation the sum is
taken once per update, from the accumulated local gradients.

A step whose global loss is not finite stops before any variable is updated, in every process
(they all see the same loss). The step returns the global loss and what the model's logs need:
for Keras' built-in metrics, the sum over replicas of what each replica's rows add to their
states (`_core.metric_states`); for other metrics and per-output losses, the predictions of
the whole batch, gathered in row order (`_core.logged`). The model updates its Keras metrics
once per global batch, exactly as on one device. State a layer writes during a replica's pass (a
metric updated in its `call`, a running sum) is combined over the replicas as the weight declares
(`_core.layer_state`).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from kmirror import errors
from kmirror._core import accumulation, draws, keras_hooks, sparse_gradients
from kmirror._core.feed.placement import batch_size, one_row_at_least, own_rows, placed, split
from kmirror._core.layer_state import LayerState, after
from kmirror._core.logged import Logged, Outcome
from kmirror.reducers.base import Reducer

__all__ = ["train", "evaluate", "predict", "one_call_per_step"]


def _call(model: keras.Model, x, training: bool):
    return model(x, training=training) if keras_hooks.calls_with_training(model) else model(x)


def _rows(
    reducer: Reducer, local, start, total, global_statistics: bool, jit_compile: bool = False
) -> keras_hooks.Rows:
    return keras_hooks.Rows(
        start=start,
        count=batch_size(local),
        total=total,
        all_sum=_no_sums_under_xla if jit_compile else reducer.all_sum,
        sums_only=_no_sums_under_xla if jit_compile else reducer.replica_sums,
        global_statistics=global_statistics,
        padded=True,  # `one_row_at_least`
    )


def _no_sums_under_xla(value):
    raise ValueError(
        "kmirror: this model needs a sum over the replicas inside each replica's forward pass "
        "(a loss over masked outputs, reduction='mean_with_sample_weight' with sample weights, "
        "a layer's sum or mean over the rows of its call, or its call run on the whole batch), "
        "which XLA cannot compile here. Compile with jit_compile=False."
    )


def _loss_part(model, x, y, y_pred, sample_weight, rows, training):
    """This replica's part of the global batch's loss: the parts sum to the single-device loss."""
    loss = keras_hooks.compute_loss(model, x, y, y_pred, sample_weight, training=training)
    return rows.only_with_rows(loss * rows.share(loss.dtype))  # a mean over no rows is NaN


def train(
    model: keras.Model,
    reducer: Reducer,
    data: Any,
    jit_compile: bool = False,
    global_statistics: bool = True,
    logged: Logged | None = None,
    place: Any = None,
) -> Outcome:
    """One training step on a global batch; returns what `logged` asks for the logs.

    Args:
        model: the replica model (its variables mirrored by `reducer`).
        reducer: sums the gradients.
        data: the global batch, `(x, y, sample_weight)` or shorter; or this process's rows of
            it, with `place` saying where they sit (`split`).
        jit_compile: compile each replica's forward and backward pass with XLA. The reduction and
            the update always run outside XLA, so the chosen reducer is the one that runs.
        global_statistics: BatchNormalization uses the global batch's statistics.
        logged: what the model's logs need of the step (default: the gathered predictions).
        place: None for a global batch, else where this process's rows sit (`split`).
    """
    logged = (logged or Logged()).holding(place)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    shards = split(reducer, (x, y, sample_weight), place)
    variables = model.trainable_variables
    optimizer = model.optimizer

    # Which gradients are of lookups shared by the rows (`_core.sparse_gradients`): decided
    # where the gradients are traced, the same for every replica.
    shared = []

    def gradients(x, y, sample_weight, start, total):
        rows = _rows(reducer, x, start, total, global_statistics, jit_compile)
        x, y, sample_weight = one_row_at_least((x, y, sample_weight), rows.count)
        with keras_hooks.replica(rows), tf.GradientTape() as tape:
            y_pred = _call(model, x, training=True)
            loss = _loss_part(model, x, y, y_pred, sample_weight, rows, training=True)
            scaled = optimizer.scale_loss(loss)
        grads = rows.only_with_rows(tape.gradient(scaled, variables))
        if not optimizer.gradient_accumulation_steps:  # accumulated gradients are summed dense
            shared[:] = sparse_gradients.shared_lookups(grads, (x, y, sample_weight), variables)
        outputs = own_rows((y_pred, keras_hooks.masks_of(y_pred)), rows.count)
        return loss, outputs, grads

    if jit_compile:
        gradients = tf.function(gradients, jit_compile=True, reduce_retracing=True, autograph=False)

    state = _layer_state(model, reducer, global_statistics)

    def local_step(local):
        (x, y, sample_weight), start, total = local
        start, total = placed(reducer, x, start, total, place)
        before = state.before()
        with state.recording(batch_size(x) > 0):
            loss, outputs, grads = gradients(x, y, sample_weight, start, total)
        # The gradients are summed, and the weights updated, after the checks of the state.
        checks = state.combine(before)
        loss, grads = after(checks, (loss, grads))
        grads, lookups = sparse_gradients.apart(grads, shared or [False] * len(grads))
        return logged.local(loss, y, outputs, sample_weight, total), (grads, lookups)

    with draws.watched():
        local, (grads, lookups) = reducer.run(local_step, args=(shards,))
    outcome = logged.combine(reducer, local)
    # The global loss is the same in every process: all stop at the same step, before updating.
    finite = _finite(outcome)
    grads = _reduce(reducer, optimizer, grads, variables)

    def apply(grads, lookups):
        # As Keras' own train_step calls it: an optimizer's override of apply_gradients runs.
        with tf.control_dependencies([finite]):
            grads = sparse_gradients.together(grads, lookups)
            optimizer.apply_gradients(zip(grads, variables))

    reducer.run(apply, args=(grads, lookups))
    return outcome._replace(loss=finite)


def _finite(outcome: Outcome) -> tf.Tensor:
    """The global loss, after a check that it is finite (its message carries the batch's rows:
    `errors.NonFiniteWatch` tells the user whether replicas had none)."""
    finite = tf.reduce_all(tf.math.is_finite(outcome.loss))
    check = tf.debugging.Assert(finite, [errors.NON_FINITE, errors.ROWS, outcome.rows])
    with tf.control_dependencies([check]):
        return tf.identity(outcome.loss)


def _layer_state(model: keras.Model, reducer: Reducer, global_statistics: bool) -> LayerState:
    """The state the replicas write (`_core.layer_state`). The user's model's compiled loss
    tracker and metrics are left: the logs come from the wrapped model's own (`_core.logged`),
    and Keras resets them before it reads them (its per-output loss trackers are updated by the
    loss in each replica)."""
    loss = keras_hooks.compiled_loss(model)
    compiled = [keras_hooks.loss_tracker(model), keras_hooks.compiled_metrics(model)]
    compiled += getattr(loss, "metrics", [])
    unread = [v for metric in compiled if metric is not None for v in metric.variables]
    return LayerState(model, reducer, global_statistics, left=unread)


def _reduce(reducer: Reducer, optimizer, grads: list, variables: list) -> list:
    """The summed gradients each replica's optimizer applies (the one reduction point)."""
    if not optimizer.gradient_accumulation_steps:
        return reducer.reduce_gradients(grads)
    return accumulation.accumulated(reducer, optimizer, grads, variables)


def evaluate(
    model: keras.Model,
    reducer: Reducer,
    data: Any,
    logged: Logged | None = None,
    place: Any = None,
) -> Outcome:
    """One evaluation step on a global batch (or this process's rows of it, at `place`)."""
    logged = (logged or Logged()).holding(place)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    shards = split(reducer, (x, y, sample_weight), place)
    state = _layer_state(model, reducer, global_statistics=False)

    def local_step(local):
        (x, y, sample_weight), start, total = local
        start, total = placed(reducer, x, start, total, place)
        # A layer's reduction over the rows of its call is the whole batch's here too.
        rows = _rows(reducer, x, start, total, global_statistics=True)
        own = (x, y, sample_weight)
        padded = one_row_at_least(own, rows.count)
        before = state.before()
        with keras_hooks.replica(rows), state.recording(rows.count > 0):
            y_pred = _call(model, padded[0], training=False)
            loss = _loss_part(model, *padded[:2], y_pred, padded[2], rows, training=False)
        loss = after(state.combine(before), loss)
        outputs = own_rows((y_pred, keras_hooks.masks_of(y_pred)), rows.count)
        return logged.local(loss, y, outputs, sample_weight, total)

    return logged.combine(reducer, reducer.run(local_step, args=(shards,)))


def predict(model: keras.Model, reducer: Reducer, data: Any):
    """Predictions for a global batch, each replica computing its rows, gathered in row order."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    shards = split(reducer, x)
    state = _layer_state(model, reducer, global_statistics=False)

    def local_step(local):
        x, start, total = local
        # A layer's reduction over the rows of its call is the whole batch's here too.
        rows = _rows(reducer, x, start, total, global_statistics=True)
        before = state.before()
        with keras_hooks.replica(rows), state.recording(rows.count > 0):
            y_pred = _call(model, one_row_at_least(x, rows.count), training=False)
        return after(state.combine(before), own_rows(y_pred, rows.count))

    return reducer.concat(reducer.run(local_step, args=(shards,)))


def one_call_per_step(step_fn, count: int, run_eagerly: bool, retrying=lambda f: f):
    """A Keras step function running up to `count` steps, each its own call of the traced step.

    Takes the place of Keras' loop over `steps_per_execution` steps inside one graph, for reducers
    whose collectives cannot run in that loop. Like Keras' function, it returns the last step's
    logs and raises StopIteration when the iterator had no batch left; `retrying` wraps one step.
    """
    step_fn = tf.autograph.experimental.do_not_convert(step_fn)  # as Keras runs one: as written
    one_step = retrying(step_fn if run_eagerly else tf.function(step_fn, reduce_retracing=True))

    def function(iterator):
        outputs = None
        for _, data in zip(range(count), iterator):
            outputs = one_step(data)
        if outputs is None:
            raise StopIteration
        return outputs

    return function
