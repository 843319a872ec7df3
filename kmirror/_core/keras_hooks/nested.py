"""Where a tensor of a function graph nested in a layer call comes from.

A layer's call can build function graphs of its own: a loop's body (`tf.while_loop`, Keras'
recurrent layers), a branch of a condition (`tf.cond`), a `tf.function` it calls. Such a graph
reads the enclosing graph's tensors through placeholders: one it captures says which tensor it
stands for (`captured`); a loop's variable inside the body does not say which value it carries
(the loop's initial value, or what the last iteration computed).

A replica's rows of the batch have no known count in the traced step (`global_batch.any_count`),
so a loop's variable with an unknown first dimension is taken to hold the call's rows in axis 0
(`loop_rows`): an op over it that combines rows then runs the call on the whole batch, which is
one device's value whatever the variable carries. No collective can run inside a nested graph
(TensorFlow refuses a replica's `merge_call` there): a sum over the rows in it runs the call on
the whole batch too (`inside`).
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["captured", "loop_rows", "inside"]


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
