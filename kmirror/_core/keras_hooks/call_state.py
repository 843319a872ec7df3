"""What a layer keeps in Python from a call of a model's own step, each replica's own.

Every replica calls the same layer objects, so what Keras or the user keeps on a layer during a
call would be shared by the replicas, each reading another's. While an own step runs on a replica
(`own_thread`):

- **losses** a layer adds (`add_loss`, activity regularisers) are the replica's own while its call
  runs, and one device's of the whole batch after it (`combine_losses`: each a mean over the rows,
  weighed by the replica's share of them and summed over the replicas), where `layer.losses` and
  `model.losses` read them;
- **tensors set on a layer** (`self.gates = ...` in `call`, or by the step) are the replica's
  own: Python reads them back through `Layer.__getattr__`, from the replica's `OwnStep`. One a
  call on the replica's rows set with one value per row is joined into the whole batch's
  (`join_attributes`); one over the rows is refused, naming the layer, when the step reads it.
  After the step, each is set on its layer as the first replica set it (`settle`).

In kmirror's own step the losses a layer adds are the replica's too (`begin_compiled_call`): the
step weighs the loss they are part of by the replica's share of the rows.

`install` replaces `Layer.add_loss`, `Layer._get_own_losses` and `Layer.__setattr__`, and adds
`Layer.__getattr__` (Keras' `Layer` has none): each acts as Keras' own on every other thread and
outside a step. Checked on Keras 3.15.1 and 3.12.4.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import keras
import tensorflow as tf
from keras.src.layers.layer import Layer

from kmirror._core.keras_hooks import containers
from kmirror._core.keras_hooks.own_thread import OwnStep, current_step, inside_layer_call
from kmirror._core.keras_hooks.replica import current
from kmirror._core.keras_hooks.rows import Rows

__all__ = ["combine_losses", "join_attributes", "settle", "begin_compiled_call", "install"]

_original: dict[str, Callable] = {}
_install_lock = threading.Lock()


def combine_losses(own: OwnStep, rows: Rows | None) -> None:
    """The losses the call's layers added from the replica's rows, as one device's of the whole
    batch: each a mean over the rows, weighed by the replica's share of them and summed over the
    replicas (as kmirror's own step takes an `add_loss`). After a call that ran whole (`rows`
    None) they are one device's already."""
    for layer_id, added in own.added.items():
        if rows is None:
            own.losses[layer_id] = list(added)
        else:
            own.losses[layer_id] = [own.all_sum(loss * rows.share(loss.dtype)) for loss in added]
    own.added.clear()


def join_attributes(own: OwnStep, join: Callable | None) -> None:
    """The tensors the call's layers set on themselves from the replica's rows, as one device
    sets them from the whole batch (`join`: `call_results.whole_value`); one the replicas cannot
    make (None) is refused when the step reads it. After a call that ran whole (`join` None) they
    are one device's already."""
    if join is None:
        own.set_in_call.clear()
        return
    for key in own.set_in_call:
        layer, name, value = own.attributes[key]
        joined = join(value)
        value = _FromRows(layer, name, value) if joined is None else joined
        own.attributes[key] = (layer, name, value)
    own.set_in_call.clear()


@dataclass(frozen=True)
class _FromRows:
    """A layer's attribute a call set from the replica's rows, which the replicas cannot join."""

    layer: Layer
    name: str
    value: object

    def refused(self) -> ValueError:
        return ValueError(
            f"kmirror: the model's own step reads `{self.name}` of layer "
            f"'{self.layer.name}', which its call set from the replica's rows of the batch "
            "(holding them in another axis than the first, or their count on this replica), "
            "and which its replicas cannot join into the whole batch's "
            "value. Set one value per row in the first axis, or return the value from the call."
        )


def _setattr(layer, name, value):
    """`Layer.__setattr__`: while an own step runs, a tensor set on a layer (by the step or by a
    call), or a list or dict a call sets to fill with its tensors, is the replica's own, which it
    reads back; every replica sets it on the same object."""
    own = current_step()
    if own is None:
        return _original["__setattr__"](layer, name, value)
    key = (id(layer), name)
    own.attributes.pop(key, None)
    _original["__setattr__"](layer, name, value)
    tensor = tf.is_tensor(value) and not isinstance(value, tf.Variable | keras.Variable)
    stored = layer.__dict__.get(name)
    if not tensor and not (inside_layer_call() and layer.built and containers.fresh(stored)):
        return None
    layer.__dict__.pop(name, None)  # read back through `_getattr`
    own.attributes[key] = (layer, name, value if tensor else stored)
    if tensor and inside_layer_call():
        own.set_in_call.append(key)
    elif not tensor:
        containers.adopt(own, stored)
    return None


def _getattr(layer, name):
    """`Layer.__getattr__` (Python asks it for what the object does not hold): a tensor this
    replica set on the layer while its own step runs."""
    own = current_step()
    found = None if own is None else own.attributes.get((id(layer), name))
    if found is None:
        raise AttributeError(f"'{type(layer).__name__}' object has no attribute '{name}'")
    value = found[2]
    if isinstance(value, _FromRows):
        raise value.refused()
    return value


def settle(steps: list[OwnStep]) -> None:
    """After the replicas ran their step: the tensors they set on the layers are set on them as
    the first replica set them (as a traced step leaves them on one device), and the layers'
    lists and dicts hold what it put in them."""
    if not steps:
        return
    containers.settle(steps)
    for layer, name, value in steps[0].attributes.values():
        value = value.value if isinstance(value, _FromRows) else value
        _original["__setattr__"](layer, name, value)


_compiled = threading.local()  # `losses`: the layers' losses of kmirror's step on this replica


def begin_compiled_call() -> None:
    """kmirror's step calls the model on the replica's rows: as Keras' own outermost call does,
    the losses the layers added before are dropped."""
    _compiled.losses = {}
    containers.begin_compiled_call()


@contextlib.contextmanager
def compiled_whole_call() -> Iterator[None]:
    """kmirror's step calls the model on the whole batch on this replica (in eager mode): the
    losses its layers add are the replica's, as on its rows."""
    _compiled.whole, before = True, getattr(_compiled, "whole", False)
    try:
        yield
    finally:
        _compiled.whole = before


def _in_compiled_step() -> bool:
    rows = current()
    whole = rows is not None and rows.whole and not getattr(_compiled, "whole", False)
    return current_step() is None and rows is not None and not whole


def _add_loss(layer, loss):
    """`Layer.add_loss`: in a replica's part of a step, the loss is the replica's (every replica
    calls the same layer object, whose own list Keras would share between them), and in a
    model's own step, outside a layer call, the step's, read back by `layer.losses` until the
    layer is called again (Keras clears a layer's losses at a new call)."""
    own = current_step()
    if own is None and _in_compiled_step():
        for value in tf.nest.flatten(loss):
            _compiled.losses.setdefault(id(layer), []).append(tf.convert_to_tensor(value))
        return None
    if own is None:
        return _original["add_loss"](layer, loss)
    # Inside a call, from the replica's rows (combined when it returns); outside, the step's
    # own value, one device's on every replica.
    found = own.added if inside_layer_call() else own.losses
    for value in tf.nest.flatten(loss):
        found.setdefault(id(layer), []).append(tf.convert_to_tensor(value))
    return None


def _get_own_losses(layer):
    """A layer's `add_loss` losses (`layer.losses` reads them): in an own step, the replica's own
    inside a call, and the whole batch's after it; in kmirror's step, the replica's own."""
    own = current_step()
    if own is None and _in_compiled_step():
        return list(getattr(_compiled, "losses", {}).get(id(layer), []))
    if own is None:
        return _original["_get_own_losses"](layer)
    found = own.added if inside_layer_call() else own.losses
    return list(found.get(id(layer), []))


def install() -> None:
    with _install_lock:
        if not _original:
            _original["add_loss"] = Layer.add_loss
            _original["_get_own_losses"] = Layer._get_own_losses
            _original["__setattr__"] = Layer.__setattr__
            Layer.add_loss = _add_loss
            Layer._get_own_losses = _get_own_losses
            Layer.__setattr__ = _setattr
            Layer.__getattr__ = _getattr
    containers.install()
