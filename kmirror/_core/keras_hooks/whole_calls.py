"""A layer call whose reduction over the rows is not a sum runs whole, on every replica.

A reduction over the rows of a layer call that is not a sum or a mean over all of them (a
standard deviation over groups of rows, as a GAN discriminator's minibatch standard deviation;
a maximum, a sort or a top-k over the rows) cannot be computed from each replica's share of
them (`reductions`). The layer whose call makes it (the innermost one running, not counting
those a loop's body or a branch calls: the one around them) then runs again, on the whole batch,
on every replica:

- its inputs that hold the call's rows (in axis 0) are every replica's rows, joined in row order:
  each replica's rows placed at their rows of the batch, summed over the replicas. Going
  backward, a replica's rows get the sum over the replicas of their gradient;
- its other inputs (weights, data the model holds, a statistic) are taken as they are;
- within it, reductions are TensorFlow's own, over the whole batch, as on one device;
- of its outputs, each replica takes its rows where they hold the rows in axis 0 (a replica
  without rows: one row of the batch, where it computed on one row not its own): what follows in
  its pass has its rows' shape. An output holding none of them (a statistic of the whole batch)
  is one device's value, taken whole; one holding them in another axis is refused.

A replica's loss then reads its rows of one device's output, and the weights' gradients summed
over the replicas are one device's. The layer's first, partial call is left unused in the graph;
what it wrote to Keras variables (a seed generator's state, moving statistics) is undone before
the whole call (`writes.attempt`), and a Keras mask of its inputs and outputs goes with the rows.
Where the rows sit in another axis of an input, the call cannot be joined: refused with the
reduction's message.
"""

from __future__ import annotations

import dataclasses
from typing import NoReturn

import tensorflow as tf
from keras.src import backend

from kmirror._core.global_batch import computed_rows, rows_first
from kmirror._core.keras_hooks import reductions
from kmirror._core.keras_hooks.replica import replica as replica_rows
from kmirror._core.keras_hooks.row_axes import RowAxes
from kmirror._core.keras_hooks.rows import Rows

__all__ = ["run"]


def run(layer, args, kwargs, call, what: str, refused: str):
    """`call(args, kwargs)` (`layer`'s call, which `what` over its rows) on the whole batch,
    this replica's rows of its outputs returned. Where an input or an output of it holds the
    rows in another axis than the first, the call around it runs whole instead
    (`_ask_enclosing`)."""
    rows, seeds = reductions.rows(), []

    def joined(leaf):
        if not tf.is_tensor(leaf) or isinstance(leaf, tf.Variable):
            return leaf
        held = reductions.held(leaf)
        if not held:  # not computed from the rows, or holding none of them
            return leaf
        if held != {0}:
            _ask_enclosing(
                layer,
                f"{what}, on an input holding the rows in axes {sorted(held)}",
                f"{refused} kmirror cannot run the call on the whole batch either: its input "
                f"holds the rows in axes {sorted(held)}, not in axis 0. Give the layer its rows "
                "in the first axis (transpose inside its call), or compute the reduction in the "
                "model's own train_step, outside the layer's call, on the whole batch.",
            )
        whole = _joined(leaf, rows, refused)
        seeds.append(whole)
        mask = backend.get_keras_mask(leaf)
        if mask is not None and reductions.held(mask) == {0}:
            backend.set_keras_mask(whole, _joined(mask, rows, refused))
        return whole

    with reductions.paused():  # kmirror's own slices and sums of the rows
        whole_args, whole_kwargs = tf.nest.map_structure(joined, (args, kwargs))
    with reductions.outside(), replica_rows(dataclasses.replace(rows, whole=True)):
        outputs = call(whole_args, whole_kwargs)
    axes = RowAxes(seeds)  # where the whole call's tensors hold the rows of the batch
    with reductions.paused():
        taken = tf.nest.map_structure(
            lambda out: _taken(out, axes.of(out), rows, layer, what, refused), outputs
        )
    for output, whole in zip(tf.nest.flatten(taken), tf.nest.flatten(outputs)):
        if output is not whole:
            reductions.taken(output)  # in axis 0, however kmirror's collectives joined them
    return taken


def _ask_enclosing(layer, what: str, refused: str) -> NoReturn:
    """`layer`'s call cannot run on the whole batch (the rows are not in axis 0 of an input or an
    output of it): the call around it asks to, where there is one (its inputs hold the rows in
    axis 0); else a ValueError, `refused`."""
    running = reductions.running()
    index = next((i for i, call in enumerate(running) if call is layer), None)
    if not index:
        raise ValueError(refused) from None
    reductions.ask_whole(
        f"calls layer '{layer.name}' ({type(layer).__name__}), which {what}", running[index - 1]
    )


def _computed(rows: Rows):
    """(first row, rows) of the batch this replica computes on: its own, or one row where it
    has none (`Rows.padded`)."""
    start, count = tf.cast(rows.start, tf.int32), tf.cast(rows.count, tf.int32)
    if not rows.padded:
        return start, count
    return computed_rows(start, count, tf.cast(rows.total, tf.int32))


def _joined(tensor, rows: Rows, refused):
    """Every replica's rows of `tensor` (this replica's rows of the call), in row order."""
    count, total = tf.cast(rows.count, tf.int32), tf.cast(rows.total, tf.int32)
    start = tf.cast(rows.start, tf.int32)
    _, computed = _computed(rows)
    checked = tf.debugging.assert_equal(
        tf.shape(tensor)[0],
        computed,
        message=f"{refused} kmirror ran the call on the whole batch, but an input of it does not "
        "hold one row per row of the call in axis 0",
    )
    with tf.control_dependencies([checked]):
        own = tensor[:count]
    rank = tensor.shape.rank
    padding = tf.concat([[[start, total - start - count]], tf.zeros([rank - 1, 2], tf.int32)], 0)
    placed = tf.pad(own, padding)
    floating = placed.dtype.is_floating or placed.dtype.is_complex
    summed = rows.all_sum(placed if floating else tf.cast(placed, tf.float64))
    summed = summed if floating else tf.cast(summed, tensor.dtype)
    known = tf.get_static_value(rows.total)  # the batch's row count, where the trace knows it
    summed.set_shape([None if known is None else int(known), *tensor.shape[1:]])
    return summed


def _taken(output, held, rows: Rows, layer, what: str, refused: str):
    """This replica's rows of a whole call's `output` (and of its mask) where it holds the rows
    in axis 0; all of it where it holds none (a statistic of the whole batch, a weight's value):
    one device's value (`global_batch.rows_first`)."""
    first = rows_first(held, output) if tf.is_tensor(output) else False
    if first is False:
        return output
    if first is None:
        _ask_enclosing(
            layer,
            f"{what}, and returns the rows in axes {sorted(held)}",
            f"{refused} kmirror ran the call on the whole batch, but an output of it holds the "
            f"rows in axes {sorted(held)}, not in axis 0: a replica cannot take its rows of it. "
            "Return the rows in the first axis (transpose inside the call).",
        )
    first, computed = _computed(rows)
    # Each replica takes its rows by their place: an output of as many entries as the batch's
    # rows (an op no rule follows may make others: then no replica can take its rows of it).
    counted = tf.debugging.assert_equal(
        tf.shape(output)[0],
        tf.cast(rows.total, tf.int32),
        message=f"{refused} kmirror ran the call on the whole batch, but an output of it does "
        "not hold one entry per row of the batch in axis 0",
    )
    with tf.control_dependencies([counted]):
        taken = output[first : first + computed]
    mask = backend.get_keras_mask(output)
    if mask is not None and mask.shape.rank:
        backend.set_keras_mask(taken, mask[first : first + computed])
    return taken


def eager(layer, args, kwargs, call, rows: Rows):
    """In eager mode (`run_eagerly=True`), `call(args, kwargs)` (the model's call in kmirror's
    step) on the whole batch, this replica's rows of its outputs returned.

    No graph says what an eager call computes over its rows, so no rule can split it: every
    replica computes one device's call on the whole batch (every input of the model's call holds
    the rows in axis 0), and takes its rows of each output with the batch's row count in axis 0;
    an output of another count (a statistic of the batch) is taken whole. Exact, at the cost of
    each replica computing the model's forward and backward pass on every row."""
    refused = f"kmirror: in eager mode layer '{layer.name}' ({type(layer).__name__}) runs whole."

    def joined(leaf):
        if not tf.is_tensor(leaf) or isinstance(leaf, tf.Variable) or not leaf.shape.rank:
            return leaf
        whole = _joined(leaf, rows, refused)
        mask = backend.get_keras_mask(leaf)
        if mask is not None and mask.shape.rank:
            backend.set_keras_mask(whole, _joined(mask, rows, refused))
        return whole

    whole_args, whole_kwargs = tf.nest.map_structure(joined, (args, kwargs))
    with replica_rows(dataclasses.replace(rows, whole=True)):
        outputs = call(whole_args, whole_kwargs)
    total = int(rows.total)
    first, computed = _computed(rows)

    def taken(output):
        if not tf.is_tensor(output) or not output.shape.rank or output.shape[0] != total:
            return output
        mine = output[first : first + computed]
        mask = backend.get_keras_mask(output)
        if mask is not None and mask.shape.rank:
            backend.set_keras_mask(mine, mask[first : first + computed])
        return mine

    return tf.nest.map_structure(taken, outputs)
