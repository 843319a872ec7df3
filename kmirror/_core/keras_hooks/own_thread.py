"""The own step running on this thread (tf.distribute runs each replica in a thread of its own):
what the replica's layer calls read and leave behind while it runs (`calls`, `call_state`), and
whether the step is inside a function it maps over the rows (`per_row`), where it computes as one
device, with no sum over the replicas."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import tensorflow as tf

from kmirror._core.keras_hooks.provenance import Provenance

__all__ = ["OwnStep", "state", "current_step", "inside_layer_call", "per_row", "in_function"]


@dataclass
class OwnStep:
    """A replica running a model's own step on the whole global batch."""

    index: tf.Tensor  # this replica among all the job's replicas
    replicas: int
    all_gather: Callable[[tf.Tensor], tf.Tensor]  # every replica's rows, in replica order
    all_sum: Callable[[tf.Tensor], tf.Tensor]
    sums_only: Callable[[list], list]  # of tensors of one dtype, with no gradient of their own
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
    #: The replica's own copy of each list or dict of a layer it put a tensor in
    #: (`id(container)`: `(container, copy)`), and the tensors (by `id`) a call put in them.
    shadows: dict = field(default_factory=dict)
    put_in_call: set = field(default_factory=set)
    #: The graph the step is traced in (None when it runs eagerly): a graph made inside it is a
    #: function of the step (a loop's body, a condition's branch, a nested `tf.function`).
    graph: object = None
    #: The calls made on the replica's rows so far, and when each tape the step entered began
    #: and stopped recording (`id(tape)`: `[tape, calls before, calls by its end or None]`).
    split_calls: int = 0
    tapes: dict = field(default_factory=dict)


state = threading.local()  # `step`: the OwnStep; `inside`: in one of its layer calls


def current_step() -> OwnStep | None:
    """The own step running on this thread, or None."""
    return getattr(state, "step", None)


def inside_layer_call() -> bool:
    """Whether this thread runs inside a layer call of an own step (on the replica's rows)."""
    return getattr(state, "inside", False)


@contextlib.contextmanager
def per_row() -> Iterator[None]:
    """A function the step maps over rows is traced within this block (`tf.vectorized_map`'s,
    a Jacobian's: TensorFlow traces it once, in the step's graph, and makes every row's ops from
    it)."""
    state.per_row = getattr(state, "per_row", 0) + 1
    try:
        yield
    finally:
        state.per_row -= 1


def in_function() -> str | None:
    """Where the own step on this thread is, outside its layer calls, when it is inside a
    function of its own: a function mapped over rows (`per_row`) or a graph made inside the
    step's (a loop's body, a condition's branch, a nested `tf.function`), by its name; else
    None. No sum over the replicas can run there, and none is needed: the step computes there
    as one device."""
    own = current_step()
    if own is None or inside_layer_call():
        return None
    if getattr(state, "per_row", 0):
        return "a function mapped over rows (`tf.vectorized_map`, a Jacobian)"
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    return None if graph is own.graph else f"the function graph {graph.name!r}"
