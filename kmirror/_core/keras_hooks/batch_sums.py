"""The whole batch's sum or mean over the rows of a layer call, from a replica's rows
(`reductions`): one sum over the replicas going forward, one going backward."""

from __future__ import annotations

import tensorflow as tf

from kmirror._core.keras_hooks.rows import Rows

__all__ = ["whole_batch"]


def whole_batch(op_type, tensor, axes: list, keepdims: bool, rows: Rows, local_sum):
    """The sum (or mean) over `axes` of the whole batch's `tensor`, from this replica's rows.

    One packed sum over the replicas (the replica's sum, and its count for a mean) going forward;
    going backward, the sum over the replicas of the value's gradient, spread over the replica's
    rows. Written as one custom gradient: TensorFlow's own gradients of the packing would add
    tens of ops per reduction, hundreds of reductions in a deep model's step."""
    tensor = tf.convert_to_tensor(tensor)
    dtype = tensor.dtype
    work = tensor if dtype.is_floating or dtype.is_complex else tf.cast(tensor, tf.float64)
    local = local_sum(work, axes, keep_dims=True)
    kept = _static_or_dynamic(local)
    final = _without(local.shape, axes) if not keepdims else local.shape.as_list()
    if None in final:  # reshaped as the replica's sum is, then squeezed
        final = None
    packed = tf.reshape(local, [-1])
    if op_type == "Mean":  # the values summed in each: the replica's count
        count = tf.cast(tf.size(work), work.dtype) / tf.cast(tf.size(local), work.dtype)
        packed = tf.concat([packed, [count]], 0)
    if rows.padded:  # a replica without rows computed on a row not its own
        has_rows = rows.has_rows(work.dtype)
        packed = tf.math.multiply_no_nan(packed, has_rows)
    total = (rows.sum_only or rows.all_sum)(packed)  # its gradient is `whole`'s, not the sum's
    counted = ()
    if op_type == "Mean":
        total, count = tf.split(total, [-1, 1])
        counted = (count,)

    @tf.custom_gradient
    def whole(work, total, *counted):  # each an input: TensorFlow walks back to them, no further
        value = total / counted[0] if counted else total
        value = tf.reshape(value, kept if final is None else final)

        def gradient(upstream):
            spread = tf.reshape(rows.all_sum(upstream), kept)
            if counted:
                spread = spread / counted[0]
            spread = tf.broadcast_to(spread, tf.shape(work))
            if rows.padded:
                spread = tf.math.multiply_no_nan(spread, has_rows)
            return (spread, None) + (None,) * len(counted)

        return value, gradient

    value = whole(work, total, *counted)
    if final is None and not keepdims:
        value = tf.squeeze(value, axes)
    value.set_shape(local.shape if keepdims else _without(local.shape, axes))
    return tf.cast(value, dtype)


def _static_or_dynamic(tensor):
    """`tensor`'s shape: a list of ints where it is known, else the tensor of it."""
    return tensor.shape.as_list() if tensor.shape.is_fully_defined() else tf.shape(tensor)


def _without(shape, axes: list):
    return [d for i, d in enumerate(shape) if i not in axes]
