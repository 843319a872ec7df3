"""A function a model's own step maps over the rows of its batch, on the replica's rows.

`tf.vectorized_map(fn, elems)` (and `keras.ops.vectorized_map`, which calls it) computes each
row's result from that row of `elems` alone: TensorFlow traces `fn` once and makes every row's
ops from it, with no value passed from one row to another. Where the step maps such a function
over rows of its batch (`elems` computed from it: `provenance`), each replica maps it over its own
rows only (`global_batch.Split.rows`), and the results are joined in row order
(`Split.joined`), as a layer call's outputs are: the per-row work (each row's gradient in
differentially private training) is split over the replicas, and what the step computes from
the results is one device's value on every replica. Inside the function the step computes as
one device (`own_thread.per_row`): its layer calls run whole, a gradient its tape takes is that
row's. Going backward through the joined results, the gradients are the replica's rows' (`n`
times, summed over the replicas where the step asks for a gradient of its weights), as they are
through a layer call.

A map whose function writes state held outside it (a variable, a metric) with a value computed
from its row runs whole on every replica too (`_written_per_row`): TensorFlow runs such a write
once, with the first row's value, so split, each replica would write its own first row's. A write
of the same value for every row (a seed generator's advance, for dropout in the function) keeps
the map split. A map over values that are not rows of the batch (the model's own), and any map in
eager mode, inside a layer call or inside a function of the step's, runs as TensorFlow runs it:
whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import tensorflow as tf

from kmirror._core import python_draws
from kmirror._core.global_batch import Split
from kmirror._core.keras_hooks import explaining
from kmirror._core.keras_hooks.own_thread import (
    current_step,
    in_function,
    inside_layer_call,
    per_row,
)

__all__ = ["install"]

#: The ops that read a variable: the only ops taking state held outside a function that a
#: function mapped over rows may give a value of its row and still be split.
_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape"})

_original: dict[str, Callable] = {}
_install_lock = threading.Lock()


def install() -> None:
    """Makes `tf.vectorized_map` map over the replica's rows in a model's own step (elsewhere,
    and on other threads, it is TensorFlow's own)."""
    with _install_lock:
        if not _original:
            _original["vectorized_map"] = tf.vectorized_map
            tf.vectorized_map = _vectorized_map


@tf.autograph.experimental.do_not_convert
def _vectorized_map(fn, elems, *args, **kwargs):
    original = _original["vectorized_map"]
    own = current_step()
    if own is None or inside_layer_call() or in_function() is not None:
        return original(fn, elems, *args, **kwargs)
    tensors = [tf.convert_to_tensor(t) for t in tf.nest.flatten(elems)]
    if not tensors or not all(own.provenance.of_batch(t) for t in tensors):
        return original(fn, elems, *args, **kwargs)
    name = getattr(fn, "__name__", type(fn).__name__)
    written = _written_per_row(fn, elems, tensors)
    if written is not None:
        explaining.mapped_whole(
            name,
            f"its function writes state held outside it ({written}) with a value of its row, "
            "which TensorFlow writes once, with the first row's",
        )
        return original(fn, elems, *args, **kwargs)
    split = Split.of(tensors[0], own.index, own.replicas, own.all_gather, own.all_sum)
    explaining.mapped(name)
    own.split_calls += 1
    rows = tf.nest.pack_sequence_as(elems, [split.rows(t) for t in tensors])
    return tf.nest.map_structure(split.joined, original(fn, rows, *args, **kwargs))


def _written_per_row(fn, elems, tensors: list) -> str | None:
    """The type of the first op through which `fn`, traced for one row of `elems` (in a function
    looked at, never run), gives state held outside it (a captured resource: a variable) a
    value that depends on the row, other than by reading it; None if there is none. An op that
    runs functions of its own (a loop, a condition, a call) with such state and the row's
    values is taken to write it."""
    specs = [tf.TensorSpec(t.shape[1:], t.dtype) for t in tensors]

    def one_row(*row):
        return fn(tf.nest.pack_sequence_as(elems, list(row)))

    with per_row(), explaining.unrecorded(), python_draws.unchanged():  # looked at, never run
        graph = tf.function(one_row, autograph=False).get_concrete_function(*specs).graph
    of_row = {id(t) for t in graph.inputs[: len(specs)]}
    for op in graph.get_operations():
        if not any(id(t) in of_row for t in op.inputs):
            continue
        held = [t for t in op.inputs if t.dtype == tf.resource and t.op.type == "Placeholder"]
        if held and op.type not in _READS and op.op_def.is_stateful:
            return op.type
        of_row.update(id(t) for t in op.outputs)
    return None
