"""Which Keras variables a replica's step writes; where a model keeps its seed and BN state.

Every write to a Keras variable goes through `Variable.assign` (`assign_add` and `assign_sub`
call it): metrics' `update_state`, BatchNormalization's moving statistics, a seed generator's next
state, a layer's own `self.total.assign_add(...)`. While `recording(into)` is open on a thread,
the variables assigned on that thread are added to `into` (and to `alike` when every replica
writes the same value); elsewhere `assign` is Keras' own.
While `attempt(saved)` is open, each variable's value before its first write is kept, so that a
layer call run again on the whole batch (`whole_calls`) first `undo`es its first attempt's writes.
Checked on Keras 3.15.1 and 3.12.4.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import tensorflow as tf
from keras.src.backend.common.variables import Variable
from keras.src.layers.normalization.batch_normalization import BatchNormalization

from kmirror._core.keras_hooks import reductions, replica

__all__ = ["recording", "attempt", "undo", "seed_states", "moving_statistics"]

_state = threading.local()  # tf.distribute runs each replica in a thread of its own
_original = {}
_install_lock = threading.Lock()


@contextlib.contextmanager
def recording(into: dict, alike: dict | None = None) -> Iterator[None]:
    """Within this block (on this thread) each Keras variable assigned joins `into` (by id), and
    `alike` too when its value is computed from a reduction made the whole batch's (every
    replica writes it alike: `_from_whole_batch`)."""
    _install()
    previous = getattr(_state, "into", None), getattr(_state, "alike", None)
    _state.into, _state.alike = into, alike
    try:
        yield
    finally:
        _state.into, _state.alike = previous


@contextlib.contextmanager
def attempt(saved: dict) -> Iterator[None]:
    """Within this block (on this thread) each Keras variable assigned joins `saved` (by id) with
    its value before the block's first assignment, for a call run again to `undo` them (a seed
    generator's next state, moving statistics: written once, as on one device)."""
    _install()
    attempts = _state.__dict__.setdefault("attempts", [])
    attempts.append(saved)
    try:
        yield
    finally:
        attempts.pop()


def undo(saved: dict) -> None:
    """The variables an `attempt` wrote, assigned back their values from before it."""
    for variable, value in saved.values():
        _original["assign"](variable, value)


def _assign(self, value):
    before = None
    for saved in getattr(_state, "attempts", ()):
        if id(self) not in saved:
            before = tf.identity(self.value) if before is None else before
            saved[id(self)] = (self, before)
    into, alike = getattr(_state, "into", None), getattr(_state, "alike", None)
    if into is not None:
        into.setdefault(id(self), self)
        if alike is not None and (_in_whole_call() or _from_whole_batch(value)):
            alike.setdefault(id(self), self)
    return _original["assign"](self, value)


def _from_whole_batch(value) -> bool:
    """Whether `value` (written to a layer's state in the call) is computed from a reduction
    made the whole batch's (`reductions.whole_ops`): every replica writes it alike."""
    known = reductions.whole_ops()
    if not known or not tf.is_tensor(value) or not hasattr(value, "op"):
        return False
    stack = [value.op]
    while stack:
        op = stack[-1]
        if op in known:
            stack.pop()
            continue
        missing = [t.op for t in op.inputs if t.op not in known]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        known[op] = any(known[t.op] for t in op.inputs)
    return known[value.op]


def _in_whole_call() -> bool:
    """Whether this replica computes a layer call on the whole batch (`whole_calls`): what the
    call writes, every replica writes alike, as one device does."""
    rows = replica.current()
    return rows is not None and rows.whole


def _install() -> None:
    with _install_lock:
        if not _original:
            _original["assign"] = Variable.assign
            Variable.assign = _assign


def seed_states(model) -> list:
    """The states of the seed generators `model` and its layers hold."""
    return [
        generator.state
        for layer in model._flatten_layers(include_self=True)
        for generator in layer._seed_generators
    ]


def moving_statistics(model) -> list:
    """The moving means and variances of `model`'s built BatchNormalization layers."""
    return [
        variable
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, BatchNormalization) and layer.built
        for variable in (layer.moving_mean, layer.moving_variance)
    ]
