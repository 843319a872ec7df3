"""The data-parallel step: split the global batch, compute local gradients, reduce once, apply.

Replica `r` of `n` takes rows `[r*B//n, (r+1)*B//n)` of the global batch (or, when a process holds
only its rows of it, `kmirror.data`, its share of those, knowing where they sit) and computes its
part of the single-device loss of the global batch: Keras' losses divide by the global batch's
normalisers (rows, sample weights, unmasked entries), BatchNormalization uses the global batch's
statistics and random layers take the replica's rows of the draw one device would
make (`kmirror.keras_hooks`). The parts add up to the single-device loss, whatever B and n are, and
so do their gradients.

The reducer sums the gradients at one point, `Reducer.reduce_gradients`, and every replica then
applies the sum with its own copy of the optimizer, as one device would: clipping, gradient
accumulation, EMA and loss scaling see the global gradient. With gradient accumulation the sum is
taken once per update, from the accumulated local gradients.

The step returns the global loss and what the model's logs need: for Keras' built-in metrics, the
sum over replicas of what each replica's rows add to their states (`kmirror.metric_states`); for
other metrics and per-output losses, the predictions of the whole batch, gathered in row order. The
model updates its Keras metrics once per global batch, exactly as on one device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import tensorflow as tf

from kmirror import data as data_lib
from kmirror import keras_hooks, metric_states
from kmirror.reducers.base import Reducer

__all__ = [
    "shard",
    "split",
    "batch_size",
    "train",
    "evaluate",
    "predict",
    "Logged",
    "Outcome",
    "located",
    "placed",
    "global_rows",
    "one_call_per_step",
]


def batch_size(data: Any) -> tf.Tensor:
    """The number of rows of a (nested) batch, from its first tensor."""
    first = next(t for t in tf.nest.flatten(data) if t is not None)
    return tf.shape(first)[0]


def shard(data: Any, index: int, count: int) -> Any:
    """Rows `[index*B//count, (index+1)*B//count)` of every tensor in `data`."""
    start, stop = data_lib.bounds(batch_size(data), index, count)
    return tf.nest.map_structure(lambda t: None if t is None else t[start:stop], data)


def split(reducer: Reducer, data: Any, place: Any = None) -> Any:
    """Per replica: (its rows of `data`, the index of its first row in the global batch, the
    global batch's rows).

    `place` says what `data` is (`kmirror.data.unpack`): None, the global batch (every process
    holds it whole); a tensor `[first row, global rows]`, this process's rows of the global batch;
    `COUNTED`, this process's rows of a global batch made of every process's rows (the replica
    finds its place with `located`); per-replica values, each replica's rows already on its
    device (`kmirror.data.on_devices`).
    """
    if place is None:
        total = batch_size(data)

        def rows_of(index, count):
            start, _ = data_lib.bounds(total, index, count)
            return shard(data, index, count), start, total

        # tf.nest keeps None leaves (absent y or sample_weight) as they are.
        return reducer.distribute(rows_of)
    if isinstance(place, tf.distribute.DistributedValues):  # already on the replicas' devices
        return reducer.run(_with_place, args=(data, place))
    rows = batch_size(data)
    counted = place is data_lib.COUNTED
    first, total = (0, -1) if counted else tf.unstack(tf.cast(place, rows.dtype))

    def local_rows(index, count):
        start, _ = data_lib.bounds(rows, index, count)
        return shard(data, index, count), first + start, total

    return reducer.distribute_local(local_rows)


def _with_place(rows, place) -> tuple:
    place = tf.cast(place, tf.int32)  # its shape is relaxed to (None,) by tf.distribute
    return rows, place[0], place[1]


def located(reducer: Reducer, rows) -> tuple:
    """In replica context, for a batch of `COUNTED` place: `(the replica's first row, the global
    batch's rows)`, from every replica's row count (gathered in replica order)."""
    counts = reducer.all_gather(tf.reshape(tf.cast(rows, tf.int32), [1]))
    before = tf.range(tf.shape(counts)[0]) < tf.cast(reducer.replica_index(), tf.int32)
    return tf.reduce_sum(tf.where(before, counts, 0)), tf.reduce_sum(counts)


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
        global_statistics=global_statistics,
    )


def _no_sums_under_xla(value):
    raise ValueError(
        "kmirror: this model's loss needs a sum over the replicas inside each replica's forward "
        "pass (a loss over masked outputs, or reduction='mean_with_sample_weight' with sample "
        "weights), which XLA cannot compile here. Compile with jit_compile=False."
    )


def _loss_part(model, x, y, y_pred, sample_weight, rows, training):
    """This replica's part of the global batch's loss: the parts sum to the single-device loss."""
    loss = keras_hooks.compute_loss(model, x, y, y_pred, sample_weight, training=training)
    # A replica without rows adds nothing (a mean over no rows would be NaN).
    return tf.where(rows.count > 0, loss * rows.share(loss.dtype), tf.zeros_like(loss))


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

    def gradients(x, y, sample_weight, start, total):
        rows = _rows(reducer, x, start, total, global_statistics, jit_compile)
        with keras_hooks.replica(rows), tf.GradientTape() as tape:
            y_pred = _call(model, x, training=True)
            loss = _loss_part(model, x, y, y_pred, sample_weight, rows, training=True)
            scaled = optimizer.scale_loss(loss)
        return loss, (y_pred, keras_hooks.masks_of(y_pred)), tape.gradient(scaled, variables)

    if jit_compile:
        gradients = tf.function(gradients, jit_compile=True, reduce_retracing=True)

    def local_step(local):
        (x, y, sample_weight), start, total = local
        start, total = placed(reducer, x, start, total, place)
        loss, outputs, grads = gradients(x, y, sample_weight, start, total)
        return logged.local(loss, y, outputs, sample_weight, total), grads

    local, grads = reducer.run(local_step, args=(shards,))
    grads = _reduce(reducer, optimizer, grads, variables)
    reducer.run(lambda grads: optimizer.apply(grads, variables), args=(grads,))
    return logged.combine(reducer, local)


def global_rows(reducer: Reducer, data: Any, place: Any = None) -> tf.Tensor:
    """The rows of the global batch of which `data` holds all (place None) or its process's."""
    if place is None:
        return batch_size(data)
    if isinstance(place, tf.distribute.DistributedValues):
        return tf.cast(reducer.local_values(place)[0][1], tf.int32)
    if place is not data_lib.COUNTED:
        return tf.cast(place[1], tf.int32)
    shards = split(reducer, data, place)
    return reducer.sum(reducer.run(lambda shard: batch_size(shard[0]), args=(shards,)))


def placed(reducer: Reducer, x, start, total, place) -> tuple:
    """In replica context: the replica's first row and the global batch's rows."""
    return located(reducer, batch_size(x)) if place is data_lib.COUNTED else (start, total)


class Outcome(NamedTuple):
    """What a step hands back for the logs."""

    #: The loss of the global batch.
    loss: tf.Tensor
    #: The rows of the global batch.
    rows: tf.Tensor
    #: The predictions of the global batch, gathered in row order, or None.
    y_pred: Any = None
    #: The replicas' summed contributions to the metric states (`kmirror.metric_states`), or None.
    metric_sum: tf.Tensor | None = None
    #: `(y, sample_weight)` of the global batch, gathered with the predictions when each process
    #: holds only its rows; None otherwise (the batch has them).
    targets: Any = None


class Logged:
    """What a step hands back for the model's logs: the global loss, and

    with `metrics` (compiled metrics whose states add up, `kmirror.metric_states`), each replica's
    contribution to their states, summed over the replicas in the same all-reduce as the loss;
    with `gather`, the whole batch's predictions, gathered in row order (for metrics and
    per-output losses that need them), and its targets when each process holds only its rows.
    """

    def __init__(
        self,
        metrics: keras.metrics.Metric | None = None,
        gather: bool = True,
        gather_nested: bool = False,
    ):
        self.metrics = metrics
        self.gather = gather
        #: Also gather when the model has several outputs (their compiled losses are logged).
        self.gather_nested = gather_nested
        #: The batch holds this process's rows only: gather the targets with the predictions.
        self.local_rows = False

    @classmethod
    def of(cls, metrics: keras.metrics.Metric | None, compiled_loss: bool) -> Logged:
        """What a model with these compiled metrics (and a compiled loss or not) logs from."""
        if metrics is not None and not metric_states.adds_up(metrics):
            return cls(gather=True)
        states = metrics if metrics is not None and metrics.variables else None
        return cls(metrics=states, gather=False, gather_nested=compiled_loss)

    def holding(self, place) -> Logged:
        """This, for a batch at `place` (`split`)."""
        self.local_rows = place is not None
        return self

    def local(self, loss, y, outputs, sample_weight, total) -> tuple:
        """In replica context: what this replica contributes (its loss part among them)."""
        y_pred, masks = outputs
        self.gather = self.gather or (self.gather_nested and tf.nest.is_nested(y_pred))
        self.loss_dtype = loss.dtype
        found = (total,)
        if self.gather:
            found += (outputs, (y, sample_weight)) if self.local_rows else (outputs,)
        if self.metrics is None:
            return (*found, loss)
        # The loss part travels with the metric contributions: one sum for both.
        y_pred = keras_hooks.with_masks(y_pred, masks)
        contribution = metric_states.contribution(
            self.metrics, y, y_pred, sample_weight=sample_weight
        )
        return (*found, tf.concat([tf.reshape(tf.cast(loss, tf.float64), [1]), contribution], 0))

    def combine(self, reducer: Reducer, local: tuple) -> Outcome:
        """The `Outcome` of the replicas' values."""
        local = iter(local)
        rows = reducer.local_values(next(local))[0]
        y_pred = _gathered(reducer, next(local)) if self.gather else None
        targets = reducer.concat(next(local)) if self.gather and self.local_rows else None
        total = reducer.sum(next(local))
        if self.metrics is None:
            return Outcome(total, rows, y_pred, None, targets)
        return Outcome(tf.cast(total[0], self.loss_dtype), rows, y_pred, total[1:], targets)


def _gathered(reducer: Reducer, outputs):
    """The replicas' (predictions, masks) joined into the whole batch's predictions."""
    y_pred, masks = outputs
    return keras_hooks.with_masks(reducer.concat(y_pred), reducer.concat(masks))


def _reduce(reducer: Reducer, optimizer, grads: list, variables: list) -> list:
    """The summed gradients each replica's optimizer applies (the one reduction point)."""
    if not optimizer.gradient_accumulation_steps:
        return reducer.reduce_gradients(grads)
    return _accumulated(reducer, optimizer, grads, variables)


def _accumulated(reducer: Reducer, optimizer, grads: list, variables: list) -> list:
    """Gradient accumulation with one reduction per update.

    Keras' optimizer adds each micro-step's gradient to its accumulators and, every k-th step,
    applies (gradient + accumulators) / k. Here the accumulators hold the replica's LOCAL sums; on
    the update step the replica's accumulators are emptied and the optimizer is handed the sum
    over replicas of (gradient + accumulators): the global accumulated gradient, reduced once.
    """
    update, accumulators = keras_hooks.accumulation(optimizer, variables)

    def with_accumulators(grads):
        dense = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        return [None if g is None else g + acc.value for g, acc in zip(dense, accumulators)]

    local = reducer.run(with_accumulators, args=(grads,))
    present = [i for i, g in enumerate(grads) if g is not None]

    def summed():
        reduced = reducer.reduce_gradients([local[i] for i in present])
        return [reducer.local_values(g) for g in reduced]

    def unsummed():
        return [tuple(_zeros_beside(t) for t in reducer.local_values(local[i])) for i in present]

    flat = tf.cond(update, summed, unsummed)
    totals = [None] * len(grads)
    for i, values in zip(present, flat):
        totals[i] = reducer.from_local_values(values)

    def choose(grads, totals):
        chosen = []
        for g, total, acc in zip(grads, totals, accumulators):
            if g is None:
                chosen.append(None)
                continue
            acc.assign(tf.where(update, tf.zeros_like(acc.value), acc.value))
            chosen.append(tf.where(update, total, tf.convert_to_tensor(g)))
        return chosen

    return reducer.run(choose, args=(grads, totals))


def _zeros_beside(tensor):
    with tf.device(tensor.device):
        return tf.zeros_like(tensor)


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

    def local_step(local):
        (x, y, sample_weight), start, total = local
        start, total = placed(reducer, x, start, total, place)
        rows = _rows(reducer, x, start, total, global_statistics=False)
        with keras_hooks.replica(rows):
            y_pred = _call(model, x, training=False)
            loss = _loss_part(model, x, y, y_pred, sample_weight, rows, training=False)
        outputs = (y_pred, keras_hooks.masks_of(y_pred))
        return logged.local(loss, y, outputs, sample_weight, total)

    return logged.combine(reducer, reducer.run(local_step, args=(shards,)))


def predict(model: keras.Model, reducer: Reducer, data: Any):
    """Predictions for a global batch, each replica computing its rows, gathered in row order."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    shards = split(reducer, x)
    y_pred = reducer.run(lambda local: _call(model, local[0], training=False), args=(shards,))
    return reducer.concat(y_pred)


def one_call_per_step(step_fn, count: int, run_eagerly: bool):
    """A Keras step function running up to `count` steps, each its own call of the traced step.

    Takes the place of Keras' loop over `steps_per_execution` steps inside one graph, for reducers
    whose collectives cannot run in that loop. Like Keras' function, it returns the last step's
    logs and raises StopIteration when the iterator had no batch left.
    """
    one_step = step_fn if run_eagerly else tf.function(step_fn, reduce_retracing=True)

    def function(iterator):
        outputs = None
        for _, data in zip(range(count), iterator):
            outputs = one_step(data)
        if outputs is None:
            raise StopIteration
        return outputs

    return function
