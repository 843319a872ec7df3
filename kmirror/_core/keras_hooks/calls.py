"""While a model's own step runs on a replica: the step's layer calls compute on its rows.

`splitting(own)` makes each Keras layer call that the step itself makes (a call from no other
layer's call: `self.generator(noise)`, `self(x, training=True)`) run on this replica's rows of
those of its inputs that are rows of the batch (`provenance`: computed from it; what the model
holds is taken whole), and return the whole batch's output (`_core.global_batch`); a call on none
of the batch's rows runs whole, as the step does, and so does a call inside a function of the
step's own (a function it maps over rows, a loop's body, a condition's branch, a nested
`tf.function`: `own_thread.in_function`), where no sum over the replicas can run. What the
call's layers keep in Python (the losses they add, tensors set on them) is the replica's own
(`call_state`). Inside such a call, Keras
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

import keras
import numpy as np
import tensorflow as tf
from keras.src.layers.layer import Layer

from kmirror._core import python_draws
from kmirror._core.global_batch import Split
from kmirror._core.keras_hooks import (
    call_results,
    call_state,
    containers,
    explaining,
    mixing,
    other_ops,
    reductions,
    row_maps,
    whole_calls,
    writes,
)
from kmirror._core.keras_hooks.own_thread import OwnStep, current_step, in_function, per_row
from kmirror._core.keras_hooks.own_thread import state as _state
from kmirror._core.keras_hooks.replica import current
from kmirror._core.keras_hooks.replica import replica as replica_rows
from kmirror._core.keras_hooks.rows import Rows
from kmirror._core.tf_hooks import graphs

__all__ = ["splitting", "replica"]


_original: dict[str, Callable] = {}
_install_lock = threading.Lock()


@contextlib.contextmanager
def splitting(own: OwnStep) -> Iterator[None]:
    """Within this block (on this thread) the step's layer calls compute on the replica's rows,
    and the step itself computes as one device (`Rows.whole`)."""
    _install()
    previous = current_step(), getattr(_state, "inside", False)
    _state.step, _state.inside = own, False
    own.graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    whole = Rows(start=0, count=0, total=0, all_sum=own.all_sum, whole=True)
    try:
        with replica_rows(whole):
            yield
    finally:
        _state.step, _state.inside = previous


def replica(rows: Rows) -> contextlib.AbstractContextManager:
    """kmirror's step on a replica's `rows` (`replica.replica`): the model's call computes on
    them, and a reduction over them inside a layer's call is the whole batch's (`reductions`)."""
    _install()
    return replica_rows(rows)


def _call(layer, *args, **kwargs):
    own = current_step()
    if reductions.active():  # inside a call on the replica's rows
        with reductions.within(layer):
            return _on_rows(layer, args, kwargs)
    if own is None or _state.inside:
        rows = current()
        if own is not None or rows is None or rows.whole:
            return _original["__call__"](layer, *args, **kwargs)
        # kmirror's step: the replica's rows of the batch, in every input of the model's call
        seeds = [t for t in tf.nest.flatten((args, kwargs)) if _batched(t)]
        call_state.begin_compiled_call()
        if tf.executing_eagerly():  # no graph to check: one device's call, on every replica
            explaining.whole(layer, _EAGER)
            original = _original["__call__"]
            with call_state.compiled_whole_call():
                return whole_calls.eager(
                    layer, args, kwargs, lambda a, k: original(layer, *a, **k), rows
                )
        explaining.split(layer)
        with reductions.over_rows(layer, seeds, rows):
            return _on_rows(layer, args, kwargs)
    where = in_function()
    if where is not None:  # a function of the step's own: one device's call, on every replica
        explaining.whole(layer, f"it is called inside {where}, where no sum over the replicas runs")
        return _whole(own, layer, args, kwargs)
    batched = [t for t in tf.nest.flatten((args, kwargs)) if _batched(t)]
    known = [own.provenance.of_batch(t) for t in batched]
    # In eager mode no graph says which tensors are rows, or what the call computes over them:
    # the call runs whole, as one device's, on every replica.
    of_batch = {id(t) for t, rows in zip(batched, known) if rows}
    if None in known or not of_batch:  # or the model's own data only
        explaining.whole(layer, _EAGER if None in known else _NOT_ROWS)
        return _whole(own, layer, args, kwargs)
    explaining.split(layer)
    own.split_calls += 1
    reference = next(_tensor(t) for t in batched if id(t) in of_batch)  # the call's rows
    split = Split.of(reference, own.index, own.replicas, own.all_gather, own.all_sum)
    rows_taken = set()  # the inputs taken as the replica's rows (not whole)

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
        if alike:
            rows_taken.add(id(taken))
        return taken

    args, kwargs = tf.nest.map_structure(rows, (args, kwargs))
    seeds = [t for t in tf.nest.flatten((args, kwargs)) if id(t) in rows_taken]
    call_rows = Rows(
        start=split.start,
        count=split.count,
        total=split.total,
        all_sum=own.all_sum,
        sums_only=own.sums_only,
        global_statistics=own.global_statistics,
        padded=True,
    )
    for inner in layer._flatten_layers(include_self=True):  # Keras clears them at a new call
        own.losses.pop(id(inner), None)
    _state.inside = True
    try:
        with (
            replica_rows(call_rows),
            own.recording(split.count > 0),
            reductions.over_rows(layer, seeds, call_rows),
        ):
            outputs = _on_rows(layer, args, kwargs)
            where = call_results.placed(own, outputs)
    finally:
        _state.inside = False
    call_state.combine_losses(own, call_rows)
    call_state.join_attributes(own, lambda v: call_results.whole_value(v, split, own, where))
    containers.join(own, lambda v: call_results.whole_value(v, split, own, where))
    return tf.nest.map_structure(
        lambda output: call_results.output(output, split, own, where, layer), outputs
    )


def _on_rows(layer, args, kwargs):
    """`layer`'s call on the replica's rows; run again on the whole batch where a reduction in
    it over the rows is not a sum (`whole_calls`)."""
    saved = {}  # what the first attempt wrote to the layers' state, undone before the whole call
    drawn = python_draws.states()  # and where it found Python's and NumPy's generators
    try:
        with writes.attempt(saved), explaining.attempt():
            return _original["__call__"](layer, *args, **kwargs)
    except Exception:
        asked = reductions.whole_asked(layer)
        if asked is None:
            raise
    writes.undo(saved)
    python_draws.restore(drawn)
    what, refused = asked
    explaining.whole(layer, what)
    return whole_calls.run(
        layer, args, kwargs, lambda a, k: _original["__call__"](layer, *a, **k), what, refused
    )


_EAGER = "in eager mode no graph says what a call computes across its rows"
_NOT_ROWS = "none of its inputs are rows of the step's batch (data the model holds)"


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
    call_state.combine_losses(own, None)
    call_state.join_attributes(own, None)
    containers.join(own, None)
    return outputs


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


def _install() -> None:
    with _install_lock:
        if not _original:
            _original["__call__"] = Layer.__call__
            Layer.__call__ = _call
            graphs.watch_per_row_functions(per_row)
    call_state.install()
    mixing.install()
    other_ops.install()
    row_maps.install()
