"""A replica's place in the global batch while its part of a step runs (`Rows`), and how it
sums a value with the other replicas'."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import tensorflow as tf

__all__ = ["Rows"]


@dataclass
class Rows:
    """This replica's place in the global batch, and how it sums a value with the others."""

    start: tf.Tensor  # first row of this replica in the global batch
    count: tf.Tensor  # rows of this replica (may be 0)
    total: tf.Tensor  # rows of the global batch
    all_sum: Callable[[tf.Tensor], tf.Tensor]  # sum over every replica (replica context)
    global_statistics: bool = True  # BatchNormalization over the global batch
    #: The step computes on the whole batch here (a model's own step, outside its layer calls):
    #: Keras decides losses, statistics and draws as on one device.
    whole: bool = False
    #: Where the replica has no rows, its layers computed on one row of the batch instead (in
    #: a model's own step): only the first `count` rows are its own.
    padded: bool = False
    #: The sums over every replica of tensors of one dtype, with no gradient of their own (None:
    #: each `all_sum`'s).
    sums_only: Callable[[list], list] | None = None
    _made: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def has_rows(self, dtype) -> tf.Tensor:
        """1 where this replica has rows, else 0, in `dtype` (made once per graph)."""
        return self.once(dtype, lambda: tf.cast(self.count > 0, dtype))

    def once(self, key, make: Callable):
        """`make()`, made once per graph and `key` for this replica (its value reused after)."""
        key = (tf.compat.v1.get_default_graph(), key)
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def made(self, key):
        """What `once` made for `key` in this graph, or None."""
        return self._made.get((tf.compat.v1.get_default_graph(), key))

    def share(self, dtype) -> tf.Tensor:
        """This replica's fraction of the global batch's rows."""
        return tf.math.divide_no_nan(tf.cast(self.count, dtype), tf.cast(self.total, dtype))

    def only_with_rows(self, values):
        """`values` (any nest of tensors, `tf.IndexedSlices` or None) where this replica has
        rows, zeros where it has none: a replica without rows contributes nothing, whatever the
        kernels it ran returned for an empty batch (TensorFlow's CPU kernel of the depthwise
        convolution's filter gradient returns uninitialised memory there: 6.9e-310, 8.7e+247,
        NaN; checked on TensorFlow 2.19 and 2.21, `tests/test_empty_rows.py`).

        A product that is 0 wherever its factor is 0, even with NaN or infinity: `tf.where` on
        the scalar condition, the same values, made a Horovod job whose global batch had a static
        row (batch_size=1, 2 processes) wait forever at its first step (TensorFlow 2.21)."""

        def kept(tensor):
            return tf.math.multiply_no_nan(tensor, self.has_rows(tensor.dtype))

        def one(value):
            if value is None:
                return None
            if isinstance(value, tf.IndexedSlices):
                return tf.IndexedSlices(kept(value.values), value.indices, value.dense_shape)
            return kept(tf.convert_to_tensor(value))

        return tf.nest.map_structure(one, values)
