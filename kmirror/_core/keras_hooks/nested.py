"""Where a tensor of a function graph nested in a layer call comes from.

A layer's call can build function graphs of its own: a loop's body (`tf.while_loop`, Keras'
recurrent layers), a branch of a condition (`tf.cond`), a `tf.function` it calls (whose call over
the rows runs the layer's call whole: `other_ops`). Such a graph reads the enclosing graph's
tensors through placeholders: one it captures says which tensor it stands for (`captured`); a
loop's variable inside the body does not say which value it carries (the loop's initial value, or
what the last iteration computed).

A replica's rows of the batch have no known count in the traced step (`global_batch.any_count`),
so a loop's variable with an unknown first dimension is taken to hold the call's rows in axis 0
(`loop_rows`): an op over it that combines rows then runs the call on the whole batch, which is
one device's value whatever the variable carries. No collective can run inside a nested graph
(TensorFlow refuses a replica's `merge_call` there): a sum over the rows in it runs the call on
the whole batch too (`inside`).

What a loop or a condition gives back holds the rows where its body's or a branch's value (or,
for a loop, the value it started from) does (`carried`): a recurrent layer's last state, the
outputs it collects. A loop reads a sequence and collects its outputs through tensor lists
(`tf.TensorArray`): a list holds the rows where the tensor its elements would stack into does,
the list's index in axis 0.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from kmirror._core.tf_hooks import graphs

__all__ = ["captured", "loop_rows", "inside", "CARRIERS", "carried", "LIST_READS"]

_LOOPS = {"While", "StatelessWhile"}
#: The ops reading a tensor list's elements by their index, the stacked tensor's axis 0: of a
#: list over the rows, an element is one row of the batch, taken by its place.
LIST_READS = {"TensorListGetItem", "TensorListGather", "TensorListPopBack"}
#: The ops whose outputs say where they hold the rows through a nested graph or a tensor list.
CARRIERS = _LOOPS | LIST_READS | {"If", "StatelessIf", "TensorListFromTensor", "TensorListStack"}
CARRIERS |= {"TensorListSetItem", "TensorListPushBack", "TensorListScatterV2"}
CARRIERS |= {"TensorListScatterIntoExistingList"}
CARRIERS |= {"Identity", "IdentityN"}  # of a list too, whose shape says nothing of the rows


def captured(placeholder):
    """The tensor of an enclosing graph that `placeholder` captures, else None."""
    for external, internal in getattr(placeholder.graph, "captures", ()):
        if internal is placeholder:
            return external
    return None


def loop_rows(placeholder, graph) -> frozenset | None:
    """For a placeholder of a graph nested in `graph` that captures nothing (a loop's variable in
    its body): axis 0, where its first dimension is unknown as a replica's row count is."""
    shape = placeholder.shape
    if not _nested(placeholder.graph, graph) or not shape.rank or shape[0] is not None:
        return None
    return frozenset({0})


def inside(graph) -> bool:
    """Whether the graph being built is a function graph nested in `graph`."""
    return _nested(tf.compat.v1.get_default_graph(), graph)


def _nested(inner, graph) -> bool:
    current = getattr(inner, "outer_graph", None)
    while current is not None:
        if current is graph:
            return True
        current = getattr(current, "outer_graph", None)
    return False


def carried(tensor, held: list, of: Callable, by_shape: Callable) -> frozenset | None:
    """Where `tensor`, an output of a `CARRIERS` op, holds the rows of the call: `held` says
    where its op's inputs hold them, `of` where a tensor of a nested graph does; `by_shape()`
    where the graphs a loop or a condition ran are not known (an op made from a `GraphDef`)."""
    op = tensor.op
    if op.type.startswith("Identity"):
        return held[tensor.value_index]
    if op.type.startswith("TensorList"):
        return _listed(op.type, tensor.value_index, held)
    index, branches = tensor.value_index, graphs.branch_outputs(op)
    if not branches:
        return by_shape()
    found = [of(outputs[index]) for outputs in branches if index < len(outputs)]
    if op.type in _LOOPS and index < len(held):
        found.append(held[index])  # the value the loop started from, if it never ran
    return _union(found)


def _listed(kind: str, index: int, held: list) -> frozenset | None:
    """A list holds the rows where the tensor its elements stack into would (the list's index in
    axis 0), an element where the list does, less that axis."""
    handle = held[0]
    if kind == "TensorListGetItem" or (kind == "TensorListPopBack" and index == 1):
        if not handle:
            return handle
        return frozenset() if 0 in handle else frozenset(a - 1 for a in handle)  # `LIST_READS`
    if kind in ("TensorListSetItem", "TensorListPushBack"):
        item = held[2 if kind == "TensorListSetItem" else 1]
        return _union([handle, item and frozenset(a + 1 for a in item)])
    if kind == "TensorListScatterIntoExistingList":
        return _union([handle, held[1]])
    return handle  # made from a tensor, stacked, gathered: the stacked tensor's axes


def _union(found: list) -> frozenset | None:
    known = [rows for rows in found if rows is not None]
    return frozenset().union(*known) if known else None
