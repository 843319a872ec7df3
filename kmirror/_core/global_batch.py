"""A layer call inside a model's own step: the replica's rows in, the whole batch's output out.

In a model's own step every replica holds the whole global batch, and everything the step
computes outside its models' layers (losses, logs, metric arguments, draws) is one device's value.
A layer call made by the step runs on the replica's rows of its inputs (`Split.rows`) and gives
the output of the whole batch (`Split.joined`):

- forward: replica `i` of `n` takes rows `[i*B//n, (i+1)*B//n)` of the call's first input
  that is rows of the batch, of `B` rows, and the same rows of each such input of as many rows;
  an input of another row count (a row broadcast to every row) is taken whole (`rows_or_whole`),
  and so is one that is not rows of the batch, whatever its row count (`whole`: a graph or a
  table the model holds); the replicas' outputs are joined in replica order (the row order);
- backward: a joined output's gradient is this replica's rows of the gradient coming back, times
  `n`; an input's gradient is every replica's rows of it, joined, divided by `n`. Each is the
  other's gradient, so a gradient of a gradient (a gradient penalty) is split and joined the same
  way.

So every gradient of a value that is not a weight is one device's on every replica, and a weight's
gradient from the calls is `n` times the part its replica's rows give. What the step computes
from a weight outside the calls (a regulariser) gives the weight its whole gradient on every
replica: the sum over the replicas, divided by `n` (`_core.own_step`), is one device's gradient.

A call whose input is another call's joined output computes on the rows the replica computed
(`rows_computed`): the same rows, as both calls split the same number of rows alike, with no join
and no copy of the whole batch going forward or backward (a GAN's `discriminator(generator(z))`).

A replica without rows in a call computes on one row of the batch instead (TensorFlow's kernels
for an empty batch may return uninitialised memory: `tests/test_empty_rows.py`). That row is
left out of the joined output, and its gradient coming back is 0: it changes no weight's sum.

Example:

```python
split = Split.of(x, index, count, gather, all_sum)   # in replica context
y = split.joined(layer(split.rows(x)))      # y: the whole batch's output, as on one device
y = split.joined(layer(split.rows(x), split.rows_or_whole(prototypes)))
z = split.rows_computed(layer(split.rows(x)))  # = split.rows(y): no join needed
```
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tensorflow as tf

__all__ = ["Split", "computed_rows", "any_count", "rows_first"]


@dataclass(frozen=True)
class Split:
    """Where this replica's rows of a call's batch of `total` rows sit."""

    start: tf.Tensor  # this replica's first row
    count: tf.Tensor  # its rows (may be 0)
    total: tf.Tensor  # the call's rows
    #: The rows it computes on: its own, or one row of the batch where it has none.
    first: tf.Tensor
    computed: tf.Tensor
    gather: Callable[[tf.Tensor], tf.Tensor]  # every replica's rows joined, in replica order
    all_sum: Callable[[tf.Tensor], tf.Tensor]  # the sum over every replica
    #: The replicas: a weight's gradient from a call is this many times its rows' part.
    replicas: int
    #: The call's row count where the traced step knows it (one device's `x.shape[0]`).
    known_total: int | None = None

    @classmethod
    def of(cls, tensor, index, replicas: int, gather: Callable, all_sum: Callable) -> Split:
        """Replica `index` of `replicas`' place in the rows of `tensor`."""
        total = tf.shape(tensor)[0]
        index = tf.cast(index, total.dtype)
        start, stop = total * index // replicas, total * (index + 1) // replicas
        count = stop - start
        first, computed = computed_rows(start, count, total)
        known = tensor.shape[0] if tensor.shape.rank else None
        return cls(start, count, total, first, computed, gather, all_sum, replicas, known)

    def rows(self, tensor):
        """The rows of `tensor` this replica computes on (their count unknown: `any_count`)."""
        if not _differentiable(tensor):
            return any_count(tensor[self.first : self.first + self.computed])
        return any_count(self._rows(tensor, dummy=True))

    def joined(self, tensor):
        """Every replica's rows of `tensor` (computed from `rows`), joined in row order."""
        if not _differentiable(tensor):
            return self._known(self.gather(tensor[: self.count]))
        total = self._known(self.gather(tf.stop_gradient(tensor[: self.count])))

        # The join is computed outside the custom gradient: TensorFlow walks the graph from a
        # custom gradient's outputs back to its inputs, and a join's inputs are every replica's.
        @tf.custom_gradient
        def join(tensor, total):
            return tf.identity(total), lambda upstream: (
                self._rows(self._times(upstream, 1), False),
                None,
            )

        return join(tensor, total)

    def _known(self, joined):
        """`joined`, the call's rows, with the row count the traced step knows for the batch
        (a batch of a static size: one device's trace reads it as a number)."""
        if self.known_total is not None and joined.shape.rank and not tf.executing_eagerly():
            joined.set_shape([self.known_total, *joined.shape[1:]])
        return joined

    def rows_or_whole(self, tensor):
        """A call's other input: this replica's rows of it where it has the call's rows (`rows`),
        else the whole of it, which is not rows of the batch (a row broadcast to every row, a set
        of class prototypes) and which each replica's rows use whole, as one device's do. Going
        backward, the whole input's gradient is the sum of every replica's (divided by `n`, as an
        input's gradient is, see `_rows`)."""
        tensor = tf.convert_to_tensor(tensor)
        return self._rows_or_whole(tensor, tf.equal(tf.shape(tensor)[0], self.total))

    def whole(self, tensor):
        """A call's input that is not rows of the batch (the model's own: a graph, a table), of
        any row count: every replica's rows use it whole, as one device's do; going backward its
        gradient is the sum of every replica's, divided by `n`."""
        tensor = tf.convert_to_tensor(tensor)
        if not _differentiable(tensor):
            return tensor

        @tf.custom_gradient
        def whole(tensor):
            def gradient(upstream):
                return self._times(self.all_sum(tf.convert_to_tensor(upstream)), -1)

            return tf.identity(tensor), gradient

        return whole(tensor)

    def _rows_or_whole(self, tensor, alike):
        total = tf.shape(tensor)[0]
        every = tf.range(total)
        taken = tf.cond(
            alike, lambda: tf.range(self.first, self.first + self.computed), lambda: every
        )
        if not _differentiable(tensor):
            return tf.gather(tensor, taken)
        # The rows whose gradient is this replica's to give: its own, or every one of the whole.
        given = tf.cond(alike, lambda: tf.range(self.start, self.start + self.count), lambda: every)

        @tf.custom_gradient
        def rows(tensor):
            def gradient(upstream):
                upstream = tf.convert_to_tensor(upstream)[: tf.size(given)]
                shape = tf.shape(tensor, out_type=given.dtype)
                placed = tf.scatter_nd(tf.expand_dims(given, 1), upstream, shape)
                return self._times(self.all_sum(placed), -1)

            return tf.gather(tensor, taken), gradient

        return rows(tensor)

    def rows_computed(self, computed):
        """This replica's rows of `joined(computed)`, which are `computed` itself: a call whose
        input is another call's joined output takes the rows the replica computed, without
        joining them and taking them apart again (forward and backward). Its gradient is the
        gradient coming back for its own rows (a row of zeros where the replica computed on a row
        not its own)."""
        if not _differentiable(computed):
            return computed

        @tf.custom_gradient
        def own(tensor):
            def gradient(upstream):
                upstream = tf.convert_to_tensor(upstream)
                padding = [[0, self.computed - self.count]] + [[0, 0]] * (upstream.shape.rank - 1)
                return tf.pad(upstream[: self.count], padding)

            return tf.identity(tensor), gradient

        return own(computed)

    def _rows(self, tensor, dummy: bool):
        """This replica's rows of the whole batch's `tensor`. Where it has no rows: one row of
        the batch (`dummy`: the forward input), or a row of zeros (a gradient coming back)."""

        @tf.custom_gradient
        def rows(tensor):
            tensor = tf.convert_to_tensor(tensor)
            if dummy:
                # A copy, not a view of the whole batch's buffer: the layers keep their inputs
                # for the backward pass, and the batch's other rows need not stay alive with it.
                taken = tf.gather(tensor, tf.range(self.first, self.first + self.computed))
            else:
                own = tensor[self.start : self.start + self.count]
                padding = [[0, self.computed - self.count]] + [[0, 0]] * (tensor.shape.rank - 1)
                taken = tf.pad(own, padding)
            return tf.identity(taken), lambda upstream: self._times(self.joined(upstream), -1)

        return rows(tensor)

    def _times(self, tensor, power: int):
        """`tensor` times the replica count (power 1) or divided by it (power -1)."""
        tensor = tf.convert_to_tensor(tensor)
        factor = tf.cast(self.replicas, tensor.dtype)
        return tensor * factor if power > 0 else tensor / factor


def computed_rows(start, count, total):
    """(first row, rows) of a batch of `total` rows that a replica with `count` rows from
    `start` computes on: its own, or one row of the batch where it has none."""
    computed = tf.maximum(count, tf.minimum(total, 1))
    return tf.minimum(start, tf.maximum(total - computed, 0)), computed


def any_count(tensor):
    """`tensor`, a replica's rows, with its row count unknown to the traced graph. A batch of a
    size the trace knows (a dataset's `drop_remainder`, arrays of whole batches) would give the
    replica's rows a known count, and a layer reading it (`ops.shape(x)[0]`, `x.shape[0]`)
    would take the replica's count for the batch's as a Python number, which no op shows."""
    shape = tensor.shape
    if tf.executing_eagerly() or not shape.rank or shape[0] is None:
        return tensor
    unknown = tf.TensorShape([None]).concatenate(shape[1:])
    return tf.raw_ops.PlaceholderWithDefault(input=tensor, shape=unknown)


def rows_first(held, tensor) -> bool | None:
    """Whether `tensor`, which a layer call on the replica's rows left, holds them in axis 0
    (True) or none of them (False: a statistic of the rows, a weight's value), from where the
    call's graph says it holds them (`held`: axes, empty, or None where not computed from them);
    None where they cannot be taken so (another axis, the replica's count). Where the graph's
    rules lose the rows (empty `held`), a first dimension not known in the traced graph, as a
    replica's rows' is (`any_count`), says they are there: a statistic has its dimensions known."""
    shape = tensor.shape
    unknown = shape.rank is None or (shape.rank > 0 and shape[0] is None)
    if held == {0} or (held is not None and not held and unknown):
        return True
    return None if held else False


def _differentiable(tensor) -> bool:
    return tensor.dtype.is_floating or tensor.dtype.is_complex
