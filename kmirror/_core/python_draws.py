"""Draws from Python's `random` module and NumPy's global generator while a step is traced are
one device's.

Code that runs while a step is traced may draw from Python's `random` module or from NumPy's
global generator (`np.random`): Keras' `AugMix` layer picks each chain's augmentations with
`random.choice`, and whatever is drawn is fixed in the traced graph. One device traces the step
once and draws once. kmirror traces one replica's pass per local replica, each in a thread of its
own, and traces some code more than once (a layer call on the replica's rows, then on the whole
batch; a step looked at before it runs): each would draw anew from the process's generators, the
replicas would compute different graphs, and the generators would be left elsewhere than one
device leaves them. So:

- while the local replicas run a function (`alike`), each replica's thread draws from its own
  copy of the two generators, each starting where the process's were; afterwards the process's
  generators are where replica 0's copies ended: where one device's trace leaves them (where
  the function raised, where they were before it);
- a trace that is tried and done again, or made to look at a step and never run, restores the
  generators it drew from (`states`, `restore`, `unchanged`).

Draws through the modules (`random.choice(...)`, `np.random.permutation(...)`) are seen: the
modules' functions are replaced, once, by ones that draw from the thread's copy where it has one
and from the process's generators everywhere else. A function taken from the module before
kmirror was imported (`from random import choice`), a `random.Random` or NumPy `Generator` of
the program's own, draw as they are.

Example:

```python
with python_draws.alike() as each:
    strategy.run(each(replica_fn))   # every replica draws what one device draws
```
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["install", "alike", "states", "restore", "unchanged", "drawn", "TracedAgain"]

_local = threading.local()  # `.streams`: this replica thread's (random.Random, RandomState)
_install_lock = threading.Lock()
_originals: dict = {}  # "python" / "numpy" -> {name: the module's own function}
_draws = [0]  # draws the replicas' threads made through the modules' functions
_NOT_DRAWS = frozenset({"getstate", "setstate", "get_state", "set_state", "seed"})


class TracedAgain(Exception):  # noqa: N818 (not an error: the step is traced once more)
    """Raised at the end of a step's first trace that drew from Python's or NumPy's generators
    where one device traces that step twice: TensorFlow traces a function again when its first
    trace made variables (Keras builds a model's optimizer, metrics and layers in its first
    step on one device; kmirror builds them before it), and the graph that runs is the second
    trace's, drawn from where the first left the generators. The step is traced again, from
    there."""


def drawn() -> int:
    """How many draws this thread and the replicas' threads made through the modules'
    functions so far."""
    return _draws[0] + getattr(_local, "draws", 0)


def install() -> None:
    """Replaces the functions of Python's `random` module and NumPy's `np.random` by ones that
    draw from the replica thread's copies of the generators where it has them (`alike`)."""
    with _install_lock:
        if _originals:
            return
        # Every function of Python's `random` module is a method of its one hidden generator;
        # every legacy function of `numpy.random` a method of its global `RandomState`.
        python = _methods_of(random, random.random.__self__)
        numpy = _methods_of(np.random, np.random.random.__self__)
        _originals.update(python=python, numpy=numpy)
        for name, original in python.items():
            setattr(random, name, _dispatching(0, name, original))
        for name, original in numpy.items():
            setattr(np.random, name, _dispatching(1, name, original))


def _methods_of(module, owner) -> dict:
    return {
        name: getattr(module, name)
        for name in dir(module)
        if getattr(getattr(module, name), "__self__", None) is owner
    }


def _dispatching(kind: int, name: str, original: Callable) -> Callable:
    counted = int(name not in _NOT_DRAWS)

    @functools.wraps(original)
    def draw(*args, **kwargs):
        streams = getattr(_local, "streams", None)
        if streams is None:
            _local.draws = getattr(_local, "draws", 0) + counted
            return original(*args, **kwargs)
        _draws[0] += counted
        return getattr(streams[kind], name)(*args, **kwargs)

    return draw


def states() -> tuple:
    """The states of the generators this thread draws from."""
    streams = getattr(_local, "streams", None)
    if streams is not None:
        return _states_of(streams)
    return random.getstate(), np.random.get_state()


def _states_of(streams: tuple) -> tuple:
    return streams[0].getstate(), streams[1].get_state()


def restore(saved: tuple) -> None:
    """Sets the generators this thread draws from to `saved` (`states`)."""
    streams = getattr(_local, "streams", None)
    if streams is not None:
        streams[0].setstate(saved[0])
        streams[1].set_state(saved[1])
    else:
        random.setstate(saved[0])
        np.random.set_state(saved[1])


@contextlib.contextmanager
def unchanged() -> Iterator[None]:
    """Inside: a trace made to look at or build from code, never run: what it draws is undone."""
    saved = states()
    try:
        yield
    finally:
        restore(saved)


@contextlib.contextmanager
def alike() -> Iterator[Callable[[Callable], Callable]]:
    """Gives `each(fn)`: `fn`, run by each local replica (in a thread of its own, or in this
    one), drawing from copies of the process's generators as they are now."""
    install()
    start = states()
    ends: dict = {}

    def each(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def replica(*args, **kwargs) -> Any:
            previous = getattr(_local, "streams", None)
            streams = (random.Random(), np.random.RandomState())
            streams[0].setstate(start[0])
            streams[1].set_state(start[1])
            _local.streams = streams
            try:
                return fn(*args, **kwargs)
            finally:
                _local.streams = previous
                ends[_replica_index()] = _states_of(streams)

        return replica

    try:
        yield each
    except BaseException:
        restore(start)  # tried again, or not at all: as if nothing was drawn
        raise
    restore(ends[min(ends)] if ends else start)


def _replica_index() -> int:
    index = tf.distribute.get_replica_context().replica_id_in_sync_group
    value = tf.get_static_value(index)
    return int(value) if value is not None else 0
