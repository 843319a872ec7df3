"""The data-parallel step: split the global batch, compute local gradients, reduce, apply.

Every process sees the same global batch. Replica `r` of `n` takes rows `[r*B//n, (r+1)*B//n)`,
computes its loss normalised by the GLOBAL batch (its Keras loss, a mean over its own rows, times
its share of the rows), and the reducer sums the gradients. The sum of the replicas' losses is
then exactly the single-device loss of the global batch, whatever B and n are, and so is its
gradient: batches not divisible by n, uneven final batches and replicas left with no rows at all
give the same update as one device would.

The step returns the global loss and the predictions of the whole batch, gathered in row order,
so that the model updates its Keras metrics once, on the global batch, exactly as on one device.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras.src.losses import loss as keras_loss

from kmirror.reducers.base import Reducer

__all__ = ["shard", "batch_size", "train", "evaluate", "predict"]


def batch_size(data: Any) -> tf.Tensor:
    """The number of rows of a (nested) batch, from its first tensor."""
    first = next(t for t in tf.nest.flatten(data) if t is not None)
    return tf.shape(first)[0]


def shard(data: Any, index: int, count: int) -> Any:
    """Rows `[index*B//count, (index+1)*B//count)` of every tensor in `data`."""
    rows = batch_size(data)
    start = rows * index // count
    stop = rows * (index + 1) // count
    return tf.nest.map_structure(lambda t: None if t is None else t[start:stop], data)


def _split(reducer: Reducer, data: Any) -> Any:
    # tf.nest keeps None leaves (absent y or sample_weight) as they are.
    return reducer.distribute(lambda index, count: shard(data, index, count))


def _share(local: Any, total: tf.Tensor, dtype) -> tf.Tensor:
    """This replica's fraction of the global batch's rows."""
    return tf.cast(batch_size(local), dtype) / tf.cast(total, dtype)


def _global_loss_part(model: keras.Model, x, y, y_pred, sample_weight, total, training: bool):
    """This replica's part of the global batch's loss; the parts sum to the single-device loss.

    Keras divides each replica's loss by the replica count (`scale_loss_for_distribution`),
    which is right only when every replica has the same number of rows. kmirror undoes that and
    weighs the replica's mean loss by its share of the rows instead.
    """
    loss = model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )
    loss = keras_loss.unscale_loss_for_distribution(loss)
    return loss * _share(x, total, loss.dtype)


def _call(model: keras.Model, x, training: bool):
    return model(x, training=training) if model._call_has_training_arg else model(x)


def train(model: keras.Model, reducer: Reducer, data: Any, jit_compile: bool = False):
    """One training step on a global batch. Returns (global loss, predictions of the batch).

    Args:
        model: the replica model (its variables mirrored by `reducer`).
        reducer: sums the gradients.
        data: the global batch, `(x, y, sample_weight)` or shorter.
        jit_compile: compile each replica's forward and backward pass with XLA. The reduction and
            the update always run outside XLA, so the chosen reducer is the one that runs.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    total = batch_size(x)
    shards = _split(reducer, (x, y, sample_weight))
    variables = model.trainable_variables
    optimizer = model.optimizer

    def gradients(x, y, sample_weight, total):
        with tf.GradientTape() as tape:
            y_pred = _call(model, x, training=True)
            loss = _global_loss_part(model, x, y, y_pred, sample_weight, total, training=True)
            scaled = optimizer.scale_loss(loss)
        return loss, y_pred, tape.gradient(scaled, variables)

    if jit_compile:
        gradients = tf.function(gradients, jit_compile=True, reduce_retracing=True)

    def replica_step(local, total):
        loss, y_pred, grads = gradients(*local, total)
        grads = reducer.reduce_gradients(grads)
        optimizer.apply_gradients(zip(grads, variables))
        return loss, y_pred

    loss, y_pred = reducer.run(replica_step, args=(shards, total))
    return reducer.sum(loss), reducer.concat(y_pred)


def evaluate(model: keras.Model, reducer: Reducer, data: Any):
    """One evaluation step on a global batch. Returns (global loss, predictions of the batch)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    total = batch_size(x)
    shards = _split(reducer, (x, y, sample_weight))

    def replica_step(local, total):
        x, y, sample_weight = local
        y_pred = _call(model, x, training=False)
        return _global_loss_part(model, x, y, y_pred, sample_weight, total, training=False), y_pred

    loss, y_pred = reducer.run(replica_step, args=(shards, total))
    return reducer.sum(loss), reducer.concat(y_pred)


def predict(model: keras.Model, reducer: Reducer, data: Any):
    """Predictions for a global batch, each replica computing its rows, gathered in row order."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    y_pred = reducer.run(lambda x: _call(model, x, training=False), args=(_split(reducer, x),))
    return reducer.concat(y_pred)
