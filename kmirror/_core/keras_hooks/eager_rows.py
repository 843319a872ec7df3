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
seen (there is no graph to watch them being made): so the call on a replica's rows (the model in
kmirror's step, each call a model's own step makes) is named in a warning too, once
(`warn_unchecked`): kmirror cannot check what it computes across the rows beyond what it names.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import tensorflow as tf

__all__ = ["Inputs", "inputs", "warn_if_over_rows", "warn_combining", "warn_unchecked"]
__all__ += ["warn_split"]

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


def inputs(seeds, layer, part) -> Inputs | None:
    """The rows of `layer`'s call's inputs (`seeds`) in eager mode, on the replica's `part` of
    the batch's rows (None when traced, or when no input has rows)."""
    found = [s for s in seeds if _eager(s) and s.shape.rank]
    if not found:
        return None
    warn_unchecked(layer, part)
    return Inputs(found)


def _eager(tensor) -> bool:
    return isinstance(tensor, tf.Tensor) and not hasattr(tensor, "op")


_NOT_ONE_DEVICES = (
    "Each replica computes it from its own rows, so what the layer computes from it is not one "
    "device's value (what it writes to a weight is combined as the weight's aggregation says). "
)


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


def warn_unchecked(layer, rows) -> None:
    """Warns once per layer called on a replica's part of the batch's rows (`rows`: `count` of
    `total`) in eager mode: the model in kmirror's step, each call a model's own step makes."""
    if "its call" in _warned.get(layer, ()) or int(rows.count) == int(rows.total):
        return  # named already, or the replica holds every row (read only until it is named)
    _warn_once(
        layer,
        "its call",
        f"kmirror cannot check what {_named(layer)} computes across the rows of its call beyond "
        "what it names (an op over values the call computes from its inputs, such as rows "
        "regrouped by a reshape or moved from the first axis, or an op kmirror has no rule "
        "for); where it does, each replica computes it from its own rows",
        "If its layers compute each row on their own, nothing differs. ",
    )


def warn_split(layer, count: int | None, batch: set) -> None:
    """Warns once per layer a model's own step calls in eager mode on `count` rows (its first
    input with rows) that no tensor of the step's batch has (`batch`: their row counts)."""
    if count is None or not batch or count in batch:
        return
    _warn_once(
        layer,
        "its rows",
        f"kmirror takes the rows of a call a step makes from its first input with rows: layer "
        f"{_named(layer)} is called on {count} rows where the step's batch has "
        f"{' or '.join(map(str, sorted(batch)))}, and each replica computes it on its part of "
        "them; if they are not rows of the batch (data the model holds: a graph's nodes, a "
        "table), that is not one device's computation",
        "",
    )


def _named(layer) -> str:
    return f"'{layer.name}' ({type(layer).__name__})"


def _warn_once(layer, key: str, said: str, consequence: str = _NOT_ONE_DEVICES) -> None:
    with _lock:
        if key in _warned.setdefault(layer, set()):
            return
        _warned[layer].add(key)
    warnings.warn(
        f"kmirror: in eager mode (run_eagerly=True) {said}. {consequence}Compile with "
        "run_eagerly=False (the default) for one device's value.",
        stacklevel=4,
    )
