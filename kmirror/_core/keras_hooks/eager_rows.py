"""A reduction over what may be the rows of a layer call, in eager mode: a warning.

In a traced step kmirror reads from the graph which axes of a tensor hold the rows of a layer
call (`row_axes`), and makes a reduction over them the whole batch's (`reductions`). In eager mode
(`run_eagerly=True`) a tensor does not say where it comes from: each replica reduces over its own
rows, which is not one device's value when the layer computes its outputs or a loss from it
(BatchNormalization's statistics, a batch mean concatenated to each row). A reduction whose axes
take axis 0 of a tensor with as many rows as the call's inputs may be such a reduction: kmirror
warns, once per layer and reduction, naming both and the fix.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import tensorflow as tf

__all__ = ["row_count", "warn_if_over_rows"]

_warned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> what it took
_lock = threading.Lock()


def row_count(seeds) -> int | None:
    """The rows of a call on a replica's rows, in eager mode: its first input's (None when
    traced, or when no input has rows)."""
    for seed in seeds:
        if isinstance(seed, tf.Tensor) and not hasattr(seed, "op") and seed.shape.rank:
            return seed.shape[0]
    return None


def warn_if_over_rows(layer, what: str, tensor, axes: set | None, rows: int | None) -> None:
    """Warns once per layer and reduction if `tensor` (eager) may hold the call's `rows` in axis 0
    and the reduction takes `what` over `axes` (None: every axis), axis 0 among them."""
    rank = tensor.shape.rank
    if rows is None or not rank or tensor.shape[0] != rows or (axes is not None and 0 not in axes):
        return
    with _lock:
        if what in _warned.setdefault(layer, set()):
            return
        _warned[layer].add(what)
    warnings.warn(
        f"kmirror: in eager mode (run_eagerly=True) kmirror cannot tell whether layer "
        f"'{layer.name}' ({type(layer).__name__}) takes {what} over the rows of the batch (axis 0 "
        "of a tensor with as many rows as its call): each replica computes it from its own rows, "
        "so what the layer computes from it is not one device's value (what it writes to a "
        "weight is combined as the weight's aggregation says). Compile with run_eagerly=False "
        "(the default) for one device's value.",
        stacklevel=3,
    )
