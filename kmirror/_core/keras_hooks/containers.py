"""The lists and dicts a layer fills during a step, each replica's own.

Keras makes a list or dict a layer holds (`self.seen = []`, `self.cache = {}`) a tracked container
(`TrackedList`, `TrackedDict`, `TrackedOrderedDict`). Every replica calls the same layer objects:
their calls would fill the same container, and a replica would read another's tensors. While a
replica runs its part of a step, the first tensor it puts into such a container gives it a copy
of its own (its shadow), which that replica reads and writes from then on; the container itself
is left as it was, and the other replicas read their own.

In a model's own step, a tensor a call on the replica's rows put there is, when the call
returns, the whole batch's as one device computes it (`join`, `call_results`): one value per row
of the call is joined from every replica's rows, a value holding none of them is one device's
already; one the replicas cannot make (the rows in another axis, their count on the replica) is
refused when the step reads it. After the step each container holds what the first replica
left in it, as a traced step leaves it on one device (`settle`). In kmirror's own step the
shadows are the replica's, and the containers are left as they were.

Keras' containers keep their class; their methods are replaced once (`install`) and act as
Keras' own on every other thread and outside a step. Checked on Keras 3.15.1 and 3.12.4.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import keras
import tensorflow as tf
from keras.src.utils import tracking

from kmirror._core.keras_hooks.own_thread import OwnStep, current_step, inside_layer_call
from kmirror._core.keras_hooks.replica import current

__all__ = ["begin_compiled_call", "fresh", "adopt", "join", "settle", "install"]

#: Each tracked container class, its builtin base, the methods that write to it and those
#: that read it.
_LIST_READS = ("__getitem__", "__iter__", "__len__", "__contains__", "__reversed__")
_LIST_READS += ("index", "count", "copy", "__repr__", "__eq__")
_LIST_WRITES = ("append", "insert", "extend", "remove", "pop", "clear", "__setitem__")
_LIST_WRITES += ("__delitem__", "__iadd__", "sort", "reverse")
_DICT_READS = ("__getitem__", "__iter__", "__len__", "__contains__", "get", "keys", "values")
_DICT_READS += ("items", "copy", "__repr__", "__eq__")
_DICT_WRITES = ("__setitem__", "__delitem__", "update", "pop", "popitem", "clear", "setdefault")
_CLASSES = (
    (tracking.TrackedList, list, _LIST_READS, _LIST_WRITES),
    (tracking.TrackedDict, dict, _DICT_READS, _DICT_WRITES),
)
if hasattr(tracking, "TrackedOrderedDict"):  # Keras 3.15 (not 3.12)
    _CLASSES += ((tracking.TrackedOrderedDict, OrderedDict, _DICT_READS, _DICT_WRITES),)
_BASES = {cls: base for cls, base, *_ in _CLASSES}

_compiled = threading.local()  # `shadows`: kmirror's step on this replica


class _FromRows:
    """A tensor a call put in a container from the replica's rows, which the replicas cannot
    join."""

    def __init__(self, value) -> None:
        self.value = value

    def refused(self) -> ValueError:
        return ValueError(
            "kmirror: the model's own step reads from a list or dict of a layer a value its "
            "call put there from the replica's rows of the batch (holding them in another axis "
            "than the first, or their count on this replica), which its replicas cannot join "
            "into the whole batch's value. Put one value per row in the first axis there, or "
            "return the value from the call."
        )


def fresh(value) -> bool:
    """Whether `value` is a layer's list or dict holding nothing but tensors (or nothing): one a
    call sets on its layer to fill with the call's tensors (`self.seen = []`)."""
    if not isinstance(value, tuple(_BASES)):
        return False
    values = list.__iter__(value) if isinstance(value, list) else dict.values(value)
    return all(tf.is_tensor(v) for v in values)


def adopt(own: OwnStep, container) -> None:
    """A list or dict a call set on its layer (`fresh`), filled already: its tensors are the
    call's, joined as those it puts in later (`join`)."""
    base = next(base for cls, base in _BASES.items() if isinstance(container, cls))
    shadow = _copy(base, container)
    own.shadows[id(container)] = (container, shadow)
    own.put_in_call.update(id(v) for v in (shadow if base is list else shadow.values()))


def begin_compiled_call() -> None:
    """kmirror's step calls the model on a replica's rows: its containers start as they are."""
    _compiled.shadows = {}


def _shadows() -> dict | None:
    own = current_step()
    if own is not None:
        return own.shadows
    rows = current()
    if rows is not None and not rows.whole:
        return getattr(_compiled, "shadows", None)
    return None


def join(own: OwnStep, joined: Callable | None) -> None:
    """The tensors a call put in the containers from the replica's rows, as one device puts them
    from the whole batch (`joined`); after a call run whole (`joined` None) they are already."""
    put, own.put_in_call = own.put_in_call, set()
    if joined is None or not put:
        return

    def one(value):
        if not tf.is_tensor(value) or id(value) not in put:
            return value
        found = joined(value)
        return _FromRows(value) if found is None else found

    for _container, shadow in own.shadows.values():
        if isinstance(shadow, dict):
            for key, value in list(shadow.items()):
                shadow[key] = one(value)
        else:
            list.__setitem__(shadow, slice(None), [one(value) for value in shadow])


def settle(steps: list[OwnStep]) -> None:
    """After the replicas ran their step: each container as the first replica left it."""
    if not steps:
        return
    for container, shadow in steps[0].shadows.values():
        if isinstance(shadow, dict):
            base = type(shadow)
            base.clear(container)
            base.update(container, {key: _unwrapped(v) for key, v in base.items(shadow)})
        else:
            list.__setitem__(container, slice(None), [_unwrapped(v) for v in shadow])


def _unwrapped(value):
    return value.value if isinstance(value, _FromRows) else value


def _checked(value):
    if isinstance(value, _FromRows):
        raise value.refused()
    return value


def _copy(base: type, container):
    """A plain copy of `container`'s contents (read as its builtin base reads them)."""
    return list(list.__iter__(container)) if base is list else base(base.items(container))


def _holds_tensor(args, kwargs) -> bool:
    return any(
        tf.is_tensor(leaf) and not isinstance(leaf, tf.Variable | keras.Variable)
        for leaf in tf.nest.flatten((args, kwargs))
    )


def _writing(base: type, name: str, original: Callable) -> Callable:
    def method(self, *args, **kwargs):
        shadows = _shadows()
        if shadows is None:
            return original(self, *args, **kwargs)
        found = shadows.get(id(self))
        if found is None:
            if not _holds_tensor(args, kwargs):
                return original(self, *args, **kwargs)
            found = shadows[id(self)] = (self, _copy(base, self))
        own = current_step()
        if own is not None and inside_layer_call():
            own.put_in_call.update(id(leaf) for leaf in tf.nest.flatten((args, kwargs)))
        result = getattr(base, name)(found[1], *args, **kwargs)
        return self if result is found[1] else result  # `+=` keeps the container

    method.__name__ = name
    return method


def _reading(base: type, name: str, original: Callable) -> Callable:
    def method(self, *args, **kwargs):
        shadows = _shadows()
        found = None if not shadows else shadows.get(id(self))
        if found is None:
            return original(self, *args, **kwargs)
        shadow = found[1]
        if name == "__iter__" and base is list:
            return (_checked(value) for value in list.__iter__(shadow))
        if name == "values":
            return [_checked(value) for value in dict.values(shadow)]
        if name == "items":
            return [(key, _checked(value)) for key, value in dict.items(shadow)]
        result = getattr(base, name)(shadow, *args, **kwargs)
        if name in ("__getitem__", "copy") and base is list and isinstance(result, list):
            return [_checked(value) for value in result]  # a slice
        return _checked(result)

    method.__name__ = name
    return method


_installed: list = []
_install_lock = threading.Lock()


def install() -> None:
    """Replaces the tracked containers' methods, once per process."""
    with _install_lock:
        if _installed:
            return
        for cls, base, reads, writes in _CLASSES:
            for names, wrap in ((reads, _reading), (writes, _writing)):
                for name in names:
                    original = getattr(cls, name)
                    setattr(cls, name, wrap(base, name, original))
            _installed.append(cls)
