"""While a kmirror replica runs: the functions of `keras.src` that decide its part of a step.

For a replica's part to add up to the single-device step, what Keras decides per call is decided
over the GLOBAL batch: a loss' divisor (row count, sum of sample weights, unmasked entries) is the
global one, and Keras' division by the replica count is undone; a random draw is the replica's
rows of one device's draw (a reduction over the rows in a layer: `reductions`); a stateful RNN
does not compare the rows of its call with its states' (`_ExpectedBatchSize`). `replica(rows)`
installs these (once) and makes them act for this thread's calls; elsewhere they are Keras' own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import tensorflow as tf
from keras.src import ops
from keras.src.backend.tensorflow import nn as keras_nn
from keras.src.backend.tensorflow import random as keras_random
from keras.src.layers.rnn.rnn import RNN
from keras.src.losses import loss as keras_loss

from kmirror._core.keras_hooks import reductions
from kmirror._core.keras_hooks.rows import Rows

__all__ = ["current", "replica", "install", "compute_loss"]


_state = threading.local()  # tf.distribute runs each replica in a thread of its own


def current() -> Rows | None:
    """The rows of the replica running on this thread, or None outside a replica."""
    return getattr(_state, "rows", None)


@contextlib.contextmanager
def replica(rows: Rows) -> Iterator[None]:
    """Within this block (on this thread) Keras computes replica `rows`' part of the step."""
    install()
    previous, _state.rows = current(), rows
    try:
        yield
    finally:
        _state.rows = previous


def compute_loss(model, x, y, y_pred, sample_weight, training: bool) -> tf.Tensor:
    """The model's loss for these rows (its own `compute_loss` if it has one)."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


# -- loss normalisers ------------------------------------------------------------------------------
def _reduce_weighted_values(
    values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None
):
    """Keras' reduction, with the divisor of the global batch.

    Returns the replica's exact part of the global loss divided by its share of the rows: the step
    multiplies every loss by that share, which makes a mean over a replica's rows (a user's own
    `ops.mean`, a regulariser) exact too. Values are those of Keras' `reduce_weighted_values`.
    """
    with reductions.paused():  # its sums are the replica's: the step weighs them by its share
        return _replica_part(values, sample_weight, mask, reduction, dtype)


def _replica_part(values, sample_weight, mask, reduction, dtype):
    rows = current()
    reduction = keras_loss.standardize_reduction(reduction)
    if rows is None or rows.whole or reduction == "none" or tuple(values.shape) == ():
        return _ORIGINAL["reduce_weighted_values"](values, sample_weight, mask, reduction, dtype)
    values = ops.convert_to_tensor(values, dtype=dtype)
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    if mask is not None:
        mask = ops.convert_to_tensor(mask, dtype=dtype)
    if rows.padded:  # a replica without rows computed on a row of zeros: not its own
        values, sample_weight, mask = (
            None if t is None or t.shape.rank == 0 else t[: rows.count]
            for t in (values, sample_weight, mask)
        )
    # Plain weights: sample weight times the 0/1 mask (Keras normalises the mask by the replica's
    # own count for the mean reductions; the global count replaces that below).
    weights = keras_loss.apply_mask(sample_weight, mask, dtype=values.dtype, reduction="sum")
    if weights is not None:
        weights = ops.cast(weights, values.dtype)
        values, weights = keras_loss.squeeze_or_expand_to_same_rank(values, weights)
        values = values * weights
    total = ops.sum(values)
    share = rows.share(total.dtype)
    if reduction == "sum":
        return tf.math.divide_no_nan(total, share)
    size = tf.cast(tf.size(values), total.dtype)
    if reduction == "mean_with_sample_weight" and weights is not None:
        divisor = rows.all_sum(tf.stop_gradient(ops.sum(weights)))
    elif mask is not None:
        valid = ops.sum(ops.cast(mask, total.dtype))
        entries = tf.cast(tf.size(mask), total.dtype)
        divisor = rows.all_sum(tf.stop_gradient(tf.math.divide_no_nan(valid * size, entries)))
    else:
        # Every replica's rows have the same shape: the mean over this replica's rows is exact.
        return tf.math.divide_no_nan(total, size)
    return tf.math.divide_no_nan(total, divisor * share)


def _scale_loss_for_distribution(value):
    # kmirror weighs each replica's loss by its share of the rows; Keras' 1/replicas is undone.
    if current() is not None:
        return value
    return _ORIGINAL["scale_loss_for_distribution"](value)


def _unscale_loss_for_distribution(value):
    # The replica's loss is its mean, not 1/replicas of it: nothing to unscale.
    if current() is not None:
        return value
    return _ORIGINAL["unscale_loss_for_distribution"](value)


# -- BatchNormalization ----------------------------------------------------------------------------
def _compute_moments_sync(x, axes, keepdims):
    """A `synchronized=True` BatchNormalization's moments, as one device computes them: its two
    means over the rows are the whole batch's (`reductions`). Keras' own would sum them over the
    replicas a second time."""
    rows = current()
    if rows is None or rows.whole or not rows.global_statistics:
        return _ORIGINAL["_compute_moments_sync"](x, axes, keepdims)
    return keras_nn._compute_moments(x, axes, keepdims)


# -- stateful RNNs -------------------------------------------------------------------------------
class _ExpectedBatchSize:
    """`RNN._expected_batch_size`, the rows of a stateful RNN's states, which its call compares
    with its input's: None in a replica, whose rows are some of the batch's, their count unknown
    to the trace (Keras 3.12 reads it as a tensor, and its comparison as a Python bool fails; 3.15
    reads the static shape and skips it). The states, as many as the batch's rows, make the call
    run whole (`other_ops`). Elsewhere the layer's own value (checked on Keras 3.12.4, 3.15.1)."""

    def __get__(self, layer, owner=None):
        if layer is None or current() is not None:
            return None
        return layer.__dict__.get("_expected_batch_size")

    def __set__(self, layer, value) -> None:
        layer.__dict__["_expected_batch_size"] = value


# -- random draws ----------------------------------------------------------------------------------
def _global_shape(shape, rows: Rows):
    """(the shape of one device's draw, the rows of it this replica takes) for a draw whose first
    dimension is this replica's rows, or k times them as traced (k batches joined, as a GAN's
    generated and real images: one device's draw over k global batches); else (shape, None)."""
    given, shape = shape, tf.convert_to_tensor(shape, dtype_hint=tf.int32)
    if shape.shape.rank != 1 or shape.shape[0] == 0:
        return given, None  # a scalar draw (shape `()`): one value, the same on every replica
    first, count = tf.cast(shape[0], tf.int64), tf.cast(rows.count, tf.int64)
    blocks = tf.where(tf.equal(first, count), tf.constant(1, tf.int64), 0)
    if not tf.executing_eagerly() and tf.get_static_value(shape[0]) is None:
        some = tf.maximum(count, 1)
        blocks = tf.where((count > 0) & tf.equal(first % some, 0), first // some, blocks)
    total, start, ours = tf.cast(rows.total, tf.int64), tf.cast(rows.start, tf.int64), blocks > 0
    # `count` rows from `start` in each of `blocks` batches of `total` rows; else every row.
    taken = tf.range(tf.where(ours, blocks, 1))[:, None] * tf.where(ours, total, 0)
    taken = taken + tf.where(ours, start, 0) + tf.range(tf.where(ours, count, first))[None, :]
    wide = tf.where(ours, blocks * total, first)
    return tf.concat([tf.cast([wide], shape.dtype), shape[1:]], 0), tf.reshape(taken, [-1])


def _rows_of(draw, taken):  # the rows `_global_shape` says this replica takes
    return draw if taken is None else tf.gather(draw, taken)


def _drawing(name: str):
    original = _ORIGINAL[name]

    def draw(shape, *args, **kwargs):
        rows = current()
        if rows is None or rows.whole:
            return original(shape, *args, **kwargs)
        wide, place = _global_shape(shape, rows)
        return _rows_of(original(wide, *args, **kwargs), place)

    draw.__name__ = name
    return draw


def _dropout(inputs, rate, noise_shape=None, seed=None):
    rows = current()
    if rows is None or rows.whole:
        return _ORIGINAL["dropout"](inputs, rate, noise_shape=noise_shape, seed=seed)
    inputs = tf.convert_to_tensor(inputs)
    noise_shape = keras_random._get_concrete_noise_shape(inputs, noise_shape)
    wide, place = _global_shape(noise_shape, rows)
    # The scaled keep-mask one device would draw for the whole batch, this replica's rows of it.
    kept = _ORIGINAL["dropout"](tf.ones(wide, inputs.dtype), rate, seed=seed)
    kept = _rows_of(kept, place)
    return tf.where(tf.not_equal(kept, 0), inputs * kept, tf.zeros_like(inputs))


def _draw_seed(seed):
    """Keras' seed of a draw. A draw with no seed takes Keras' global seed generator's next seed
    once for every replica, in cross-replica context: one device's seed, drawn once."""
    context = tf.distribute.get_replica_context() if seed is None else None
    if context is None or current() is None:
        return _ORIGINAL["draw_seed"](seed)
    return context.merge_call(lambda _: _ORIGINAL["draw_seed"](None))


# -- installing ------------------------------------------------------------------------------------
_RANDOM = ("normal", "uniform", "truncated_normal", "randint")
_ORIGINAL: dict[str, Callable] = {}
_install_lock = threading.Lock()


def install() -> None:
    """Puts kmirror's versions in place (once per process). Outside a replica they call Keras'."""
    with _install_lock:
        if _ORIGINAL:
            return
        targets = [
            (keras_loss, "reduce_weighted_values", _reduce_weighted_values),
            (keras_loss, "scale_loss_for_distribution", _scale_loss_for_distribution),
            (keras_loss, "unscale_loss_for_distribution", _unscale_loss_for_distribution),
            (keras_nn, "_compute_moments_sync", _compute_moments_sync),
            (keras_random, "dropout", _dropout),
            (keras_random, "draw_seed", _draw_seed),
        ]
        for module, name, _ in targets:
            _ORIGINAL[name] = getattr(module, name)
        for name in _RANDOM:
            _ORIGINAL[name] = getattr(keras_random, name)
        for module, name, replacement in targets:
            setattr(module, name, replacement)
        RNN._expected_batch_size = _ExpectedBatchSize()
        for name in _RANDOM:
            setattr(keras_random, name, _drawing(name))
