"""The whole batch's sum or mean over the rows of a layer call, from a replica's rows
(`reductions`): one sum over the replicas going forward, one going backward."""

from __future__ import annotations

import tensorflow as tf

from kmirror._core.keras_hooks.elementwise import BROADCAST
from kmirror._core.keras_hooks.rows import Rows

__all__ = ["whole_batch"]


def whole_batch(op_type, tensor, axes: list, keepdims: bool, rows: Rows, local_sum):
    """The sum (or mean) over `axes` of the whole batch's `tensor`, from this replica's rows.

    The sum over the replicas of the replica's sum (and its count, for a mean) going forward;
    going backward, the sum over the replicas of the value's gradient, spread over the replica's
    rows. Written as one custom gradient: TensorFlow's own gradients of the sums would add tens
    of ops per reduction, hundreds of reductions in a deep model's step; and with as few ops as
    it can (each costs about 0.2 ms to trace; BatchNormalization makes two of these per call)."""
    tensor = tf.convert_to_tensor(tensor)
    dtype = tensor.dtype
    work = tensor if dtype.is_floating or dtype.is_complex else tf.cast(tensor, tf.float64)
    local = local_sum(work, axes, keep_dims=True)
    sums = rows.sums_only or (lambda values: [rows.all_sum(v) for v in values])
    has_rows = rows.has_rows(work.dtype) if rows.padded else None

    def summed(parts):  # their gradient is `whole`'s, not the sums'
        if has_rows is not None:  # a replica without rows computed on a row not its own
            parts = [tf.math.multiply_no_nan(part, has_rows) for part in parts]
        return sums(parts)

    if op_type != "Mean":
        totals = summed([local])
    else:  # the count summed once per tensor and axes (a variance's mean of squares: the mean's)
        key = ("count", _shaped_as(work).ref(), tuple(axes), work.dtype)
        counted = rows.made(key)
        if counted is None:
            totals = summed([local, _count(work, local)])
            rows.once(key, lambda: totals[1])
        else:
            totals = summed([local]) + [counted]

    @tf.custom_gradient
    def whole(work, total, *counted):  # each an input: TensorFlow walks back to them, no further
        value = total / counted[0] if counted else total

        def gradient(upstream):
            spread = rows.all_sum(upstream)
            if counted:
                spread = spread / counted[0]
            spread = tf.broadcast_to(spread, tf.shape(work))
            if rows.padded:
                spread = tf.math.multiply_no_nan(spread, has_rows)
            return (spread, None) + (None,) * len(counted)

        return value, gradient

    value = whole(work, *totals)
    value.set_shape(local.shape)  # the replica's sum's, its dimensions kept (a sum may not say)
    if not keepdims:
        value = tf.squeeze(value, axes)
    return value if value.dtype == dtype else tf.cast(value, dtype)


def _shaped_as(tensor):
    """The tensor `tensor` is computed from element by element, in its shape (`tensor` itself if
    none): its count of values along any axes is `tensor`'s. An op computing each element from
    its inputs' (`elementwise.BROADCAST`, but `BroadcastTo`, whose shape is a value) has the
    shape of an input every other input broadcasts into without changing it."""
    while True:
        op, inputs = tensor.op, list(tensor.op.inputs)
        if op.type != "Identity" and (op.type not in BROADCAST or op.type == "BroadcastTo"):
            return tensor
        kept = [a for a in inputs if all(_into(a, b) for b in inputs if b is not a)]
        if not kept:
            return tensor
        tensor = kept[0]


def _into(whole, other) -> bool:
    """Whether `other` broadcast against `whole` leaves `whole`'s shape (its dimensions 1, or
    known and equal to `whole`'s)."""
    if other.shape.rank is None or whole.shape.rank is None or other.shape.rank > whole.shape.rank:
        return False
    pairs = zip(reversed(other.shape.as_list()), reversed(whole.shape.as_list()))
    return all(o == 1 or (o is not None and o == w) for o, w in pairs)


def _count(work, local):
    """How many of `work`'s values each of `local` (its sum, kept dimensions) sums."""
    count = tf.cast(tf.size(work), work.dtype)
    summed = local.shape.num_elements()
    if summed is None:
        return count / tf.cast(tf.size(local), work.dtype)
    return count if summed == 1 else count / summed
