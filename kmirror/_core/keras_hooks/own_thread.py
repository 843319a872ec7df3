"""The own step running on this thread (tf.distribute runs each replica in a thread of its own):
what the replica's layer calls read and leave behind while it runs (`calls`, `call_state`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import tensorflow as tf

from kmirror._core.keras_hooks.provenance import Provenance

__all__ = ["OwnStep", "state", "current_step", "inside_layer_call"]


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


state = threading.local()  # `step`: the OwnStep; `inside`: in one of its layer calls


def current_step() -> OwnStep | None:
    """The own step running on this thread, or None."""
    return getattr(state, "step", None)


def inside_layer_call() -> bool:
    """Whether this thread runs inside a layer call of an own step (on the replica's rows)."""
    return getattr(state, "inside", False)
