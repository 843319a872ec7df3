"""A reduction over what may be the rows of a layer call, or an op combining them, in eager mode:
a warning.

In a traced step kmirror reads from the graph which axes of a tensor hold the rows of a layer
call (`row_axes`), makes a reduction over them the whole batch's (`reductions`) and runs a call
whose ops combine them whole (`mixing`, `other_ops`). In eager mode (`run_eagerly=True`) a tensor
does not say where it comes from: each replica reduces over or combines its own rows, which is
not one device's value when the layer computes its outputs or a loss from it (BatchNormalization's
statistics, a batch mean concatenated to each row, attention over the batch). A reduction
whose axes take axis 0 of a tensor with as many rows as the call's inputs may be such a
reduction; an op that `mixing`'s rules find combines the rows of the call's inputs themselves
(`Inputs`: known as inputs, not by their shape, which a weight or a shape may share) is
one. kmirror warns, once per layer and operation, naming both and the fix. What is computed from
the inputs in eager mode has no graph to say where its rows are, and ops no rule names are not
seen (there is no graph to watch them being made): those stay silent.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import tensorflow as tf

__all__ = ["Inputs", "inputs", "warn_if_over_rows", "warn_combining"]

_warned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> what it took
_lock = threading.Lock()


class Inputs:
    """In eager mode, the tensors of a call on a replica's rows known to be rows: the call's
    inputs holding rows, and the inputs of the layers called inside it with as many rows (a
    layer's input in a model's forward pass; a weight or a shape never is one)."""

    def __init__(self, tensors: list) -> None:
        self.rows = tensors[0].shape[0]
        self._known = {}
        self.add(tensors)

    def add(self, tensors) -> None:
        for t in tensors:
            if _eager(t) and self.counted(t):
                self._known[id(t)] = t  # kept: its id is not reused while the call runs

    def counted(self, tensor) -> bool:
        """Whether `tensor` has as many rows as the call in its axis 0."""
        return bool(tensor.shape.rank) and tensor.shape[0] == self.rows

    def held(self, tensor) -> frozenset | None:
        """Axis 0 where `tensor` is one of them."""
        return frozenset({0}) if self._known.get(id(tensor)) is tensor else None


def inputs(seeds) -> Inputs | None:
    """The rows of a call's inputs (`seeds`) in eager mode (None when traced, or when no input
    has rows)."""
    found = [s for s in seeds if _eager(s) and s.shape.rank]
    return Inputs(found) if found else None


def _eager(tensor) -> bool:
    return isinstance(tensor, tf.Tensor) and not hasattr(tensor, "op")


def warn_if_over_rows(layer, what: str, tensor, axes: set | None, known: Inputs | None) -> None:
    """Warns once per layer and reduction if `tensor` (eager) may hold the rows of the call's
    inputs (`known`) in axis 0 and the reduction takes `what` over `axes` (None: every axis),
    axis 0 among them."""
    if known is None or not known.counted(tensor) or (axes is not None and 0 not in axes):
        return
    _warn_once(
        layer,
        what,
        f"kmirror cannot tell whether layer {_named(layer)} takes {what} over the rows of the "
        "batch (axis 0 of a tensor with as many rows as its call)",
    )


def warn_combining(layer, what: str) -> None:
    """Warns once per layer and `what` (a rule's description of an op over the call's inputs)."""
    _warn_once(layer, what, f"layer {_named(layer)} {what}")


def _named(layer) -> str:
    return f"'{layer.name}' ({type(layer).__name__})"


def _warn_once(layer, key: str, said: str) -> None:
    with _lock:
        if key in _warned.setdefault(layer, set()):
            return
        _warned[layer].add(key)
    warnings.warn(
        f"kmirror: in eager mode (run_eagerly=True) {said}: each replica computes it from its own "
        "rows, so what the layer computes from it is not one device's value (what it writes to "
        "a weight is combined as the weight's aggregation says). Compile with run_eagerly=False "
        "(the default) for one device's value.",
        stacklevel=4,
    )
