"""While a model's own step runs on a replica: the step's layer calls compute on its rows.

`splitting(own)` makes each Keras layer call that the step itself makes (a call from no other
layer's call: `self.generator(noise)`, `self(x, training=True)`) run on this replica's rows of
those of its inputs that are rows of the batch (`provenance`: computed from it; what the model
holds is taken whole), and return the whole batch's output (`_core.global_batch`); a call on none
of the batch's rows runs whole, as the step does. A tensor the step or a call sets on a layer
(`self.gates = ...`) is the replica's own, read back by it; one per row of a call is joined. The
losses its layers add (`add_loss`, activity regularisers) are the replica's own while it runs,
and one device's of the whole batch after it (each a mean over the rows, summed over the replicas
by their shares), where `layer.losses` and `model.losses` read them. Inside such a call, Keras
decides BatchNormalization's statistics and random draws over the call's whole batch, as in
kmirror's own step (`replica`), and the state the call writes is recorded for its combination
over the replicas (`OwnStep.recording`). Outside the calls the step computes as one device on the
whole batch: Keras' losses are its own.

Every call goes through `keras.Layer.__call__` (a `Model` is a layer; a layer class that defines
its own `__call__`, as Keras' preprocessing layers do, ends in it): it is replaced once, and acts
as Keras' own on every other thread and outside a step. Checked on Keras 3.15.1 and 3.12.4.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf
from keras.src import backend
from keras.src.layers.layer import Layer

from kmirror._core.global_batch import Split
from kmirror._core.keras_hooks.provenance import Provenance
from kmirror._core.keras_hooks.replica import replica
from kmirror._core.keras_hooks.rows import Rows

__all__ = ["OwnStep", "splitting", "current_step", "inside_layer_call", "settle"]


@dataclass
class OwnStep:
    """A replica running a model's own step on the whole global batch."""

    index: tf.Tensor  # this replica among all the job's replicas
    replicas: int
    all_gather: Callable[[tf.Tensor], tf.Tensor]  # every replica's rows, in replica order
    all_sum: Callable[[tf.Tensor], tf.Tensor]
    reduce_gradients: Callable[[list], list]  # summed over the replicas, in replica context
    variable_scope: Callable[[], contextlib.AbstractContextManager]
    #: The block whose writes to the model's state are recorded (a call's pass on its rows),
    #: given whether the replica has rows in the call.
    recording: Callable[[tf.Tensor], contextlib.AbstractContextManager] = lambda has_rows: (
        contextlib.nullcontext()
    )
    global_statistics: bool = True
    #: The replica's rows of every call's inputs: an embedding looked up with indices computed
    #: from them is looked up per row (`_core.sparse_gradients`).
    split_inputs: list = field(default_factory=list)
    #: Each output a call joined (by `id`): the output, what the replica computed, and its split.
    joins: dict = field(default_factory=dict)
    #: The losses layers add (`add_loss`) in the call running, from the replica's rows (by the
    #: layer's `id`), and, after its call, each layer's losses of the whole batch.
    added: dict = field(default_factory=dict)
    losses: dict = field(default_factory=dict)
    #: Where the step's tensors come from: which of a call's inputs are rows of the batch.
    provenance: Provenance = field(default_factory=lambda: Provenance(()))
    #: The tensors the step and its layers set as attributes of a layer while the step runs
    #: (`(id(layer), name)`: `(layer, name, value)`), which this replica reads back, and those a
    #: call on the replica's rows set, to join when it returns.
    attributes: dict = field(default_factory=dict)
    set_in_call: list = field(default_factory=list)


_state = threading.local()  # tf.distribute runs each replica in a thread of its own
_original: dict[str, Callable] = {}
_install_lock = threading.Lock()


def current_step() -> OwnStep | None:
    """The own step running on this thread, or None."""
    return getattr(_state, "step", None)


def inside_layer_call() -> bool:
    """Whether this thread runs inside a layer call of an own step (on the replica's rows)."""
    return getattr(_state, "inside", False)


@contextlib.contextmanager
def splitting(own: OwnStep) -> Iterator[None]:
    """Within this block (on this thread) the step's layer calls compute on the replica's rows,
    and the step itself computes as one device (`Rows.whole`)."""
    _install()
    previous = current_step(), getattr(_state, "inside", False)
    _state.step, _state.inside = own, False
    whole = Rows(start=0, count=0, total=0, all_sum=own.all_sum, whole=True)
    try:
        with replica(whole):
            yield
    finally:
        _state.step, _state.inside = previous


def _call(layer, *args, **kwargs):
    own = current_step()
    if own is None or _state.inside:
        return _original["__call__"](layer, *args, **kwargs)
    batched = [t for t in tf.nest.flatten((args, kwargs)) if _batched(t)]
    known = [own.provenance.of_batch(t) for t in batched]
    if None in known:  # in eager mode: the call's rows are its first input's
        of_batch = {id(t) for t in batched}
    else:
        of_batch = {id(t) for t, rows in zip(batched, known) if rows}
    if not of_batch:  # the model's own data only: the call runs whole, as on one device
        return _whole(own, layer, args, kwargs)
    reference = next(_tensor(t) for t in batched if id(t) in of_batch)  # the call's rows
    split = Split.of(reference, own.index, own.replicas, own.all_gather, own.all_sum)

    def rows(leaf):
        if not _batched(leaf):
            return leaf
        if id(leaf) not in of_batch:
            return split.whole(_tensor(leaf))
        alike = leaf is reference or _as_many_rows(_tensor(leaf), reference)
        joined, computed, by = own.joins.get(id(leaf), (None, None, None))
        if joined is leaf and alike:  # another call's joined output: the rows computed here
            taken = by.rows_computed(computed)
        elif alike:
            taken = split.rows(_tensor(leaf))
        else:  # as many rows as the call's, or another count (known when the step runs)
            taken = split.rows_or_whole(_tensor(leaf))
        own.split_inputs.append(taken)
        return taken

    args, kwargs = tf.nest.map_structure(rows, (args, kwargs))
    call_rows = Rows(
        start=split.start,
        count=split.count,
        total=split.total,
        all_sum=own.all_sum,
        global_statistics=own.global_statistics,
        padded=True,
    )
    for inner in layer._flatten_layers(include_self=True):  # Keras clears them at a new call
        own.losses.pop(id(inner), None)
    _state.inside = True
    try:
        with replica(call_rows), own.recording(split.count > 0):
            outputs = _original["__call__"](layer, *args, **kwargs)
    finally:
        _state.inside = False
    _combine_losses(own, call_rows)
    _join_attributes(own, split)
    return tf.nest.map_structure(lambda output: _joined(output, split, own), outputs)


def _whole(own: OwnStep, layer, args, kwargs):
    """A call on none of the batch's rows runs whole on every replica, as the step around it:
    its outputs, the losses its layers add and the state they write are one device's."""
    for inner in layer._flatten_layers(include_self=True):
        own.losses.pop(id(inner), None)
    _state.inside = True
    try:
        outputs = _original["__call__"](layer, *args, **kwargs)
    finally:
        _state.inside = False
    for layer_id, added in own.added.items():
        own.losses[layer_id] = list(added)
    own.added.clear()
    own.set_in_call.clear()
    return outputs


def _combine_losses(own: OwnStep, rows: Rows) -> None:
    """The losses the call's layers added from the replica's rows, as one device's of the whole
    batch: each a mean over the rows, weighed by the replica's share of them and summed over the
    replicas (as kmirror's own step takes an `add_loss`)."""
    for layer_id, added in own.added.items():
        own.losses[layer_id] = [own.all_sum(loss * rows.share(loss.dtype)) for loss in added]
    own.added.clear()


def _join_attributes(own: OwnStep, split: Split) -> None:
    """The tensors the call's layers set on themselves from the replica's rows, as one device
    sets them from the whole batch: each of the call's rows joined; one the replicas cannot join
    (a value over the rows, not one per row) is refused when the step reads it."""
    for key in own.set_in_call:
        layer, name, value = own.attributes[key]
        if value.shape.rank and value.shape[0] is None:  # one per row of the call
            value = _joined(value, split, own)
        else:
            value = _FromRows(layer, name, value)
        own.attributes[key] = (layer, name, value)
    own.set_in_call.clear()


@dataclass(frozen=True)
class _FromRows:
    """A layer's attribute a call set from the replica's rows only, not one per row."""

    layer: Layer
    name: str
    value: object

    def refused(self) -> ValueError:
        return ValueError(
            f"kmirror: the model's own step reads `{self.name}` of layer "
            f"'{self.layer.name}', which its call set to a value computed from the replica's "
            "rows of the batch, not one value per row, and which its replicas cannot join into "
            "the whole batch's value. Set one value per row in the call (and reduce over the "
            "rows in the step), or return the value from the call."
        )


def _setattr(layer, name, value):
    """`Layer.__setattr__`: while an own step runs, a tensor set on a layer (by the step or by a
    call) is the replica's own, which it reads back; every replica sets it on the same object."""
    own = current_step()
    if own is None:
        return _original["__setattr__"](layer, name, value)
    key = (id(layer), name)
    own.attributes.pop(key, None)
    _original["__setattr__"](layer, name, value)
    if not tf.is_tensor(value) or isinstance(value, tf.Variable | keras.Variable):
        return None
    layer.__dict__.pop(name, None)  # read back through `_getattr`
    own.attributes[key] = (layer, name, value)
    if _state.inside:
        own.set_in_call.append(key)
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
    the first replica set them (as a traced step leaves them on one device)."""
    if not steps:
        return
    for layer, name, value in steps[0].attributes.values():
        value = value.value if isinstance(value, _FromRows) else value
        _original["__setattr__"](layer, name, value)


def _add_loss(layer, loss):
    """`Layer.add_loss`: inside a call of an own step, the loss is the replica's (every replica
    calls the same layer object, whose own list Keras would share between them)."""
    own = current_step()
    if own is None or not _state.inside:
        return _original["add_loss"](layer, loss)
    for value in tf.nest.flatten(loss):
        own.added.setdefault(id(layer), []).append(tf.convert_to_tensor(value))
    return None


def _get_own_losses(layer):
    """A layer's `add_loss` losses (`layer.losses` reads them): in an own step, the replica's own
    inside a call, and the whole batch's after it."""
    own = current_step()
    if own is None:
        return _original["_get_own_losses"](layer)
    found = own.added if _state.inside else own.losses
    return list(found.get(id(layer), []))


def _batched(leaf) -> bool:
    """Whether a call's argument holds rows (a tensor or array of rank 1 or more)."""
    if isinstance(leaf, np.ndarray):
        return leaf.ndim > 0
    variable = isinstance(leaf, tf.Variable | keras.Variable)
    return tf.is_tensor(leaf) and not variable and leaf.shape.rank != 0


def _as_many_rows(tensor, reference) -> bool:
    """Whether `tensor` has as many rows as `reference`, known from their static shapes."""
    rows = tensor.shape[0]
    return rows is not None and rows == reference.shape[0]


def _tensor(leaf):
    return tf.convert_to_tensor(leaf) if isinstance(leaf, np.ndarray) else leaf


def _joined(output, split: Split, own: OwnStep):
    if not tf.is_tensor(output):
        return output
    if output.shape.rank == 0:
        raise ValueError(
            "kmirror: a layer called in the model's own step returned a scalar, which its replicas "
            "compute from their rows only and cannot join into the whole batch's value. Return "
            "one value per row from the layer, and reduce over the rows in the step."
        )
    mask = backend.get_keras_mask(output)
    joined = split.joined(output)
    if mask is not None:
        backend.set_keras_mask(joined, split.joined(mask))
    own.joins[id(joined)] = (joined, output, split)
    own.provenance.mark(joined)
    return joined


def _install() -> None:
    with _install_lock:
        if not _original:
            _original["__call__"] = Layer.__call__
            _original["add_loss"] = Layer.add_loss
            _original["_get_own_losses"] = Layer._get_own_losses
            _original["__setattr__"] = Layer.__setattr__
            Layer.__call__ = _call
            Layer.__setattr__ = _setattr
            Layer.__getattr__ = _getattr
            Layer.add_loss = _add_loss
            Layer._get_own_losses = _get_own_losses
