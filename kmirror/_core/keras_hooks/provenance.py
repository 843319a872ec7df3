"""Which tensors of a model's own step are rows of its batch: those computed from the batch.

A layer call the step makes computes on the replica's rows of the inputs that are rows of the
batch (`calls`). A tensor is rows of the batch when the step computed it from the batch it was
given (the data, a tensor made with the batch's row count, a call's output of such rows), not
because it is a call's first input or has as many rows as the batch: a graph the model holds,
a table of prototypes, constants and weights are the model's own, and a call on them alone runs
whole, as on one device.

Where the step is traced (a `tf.function`, as Keras runs it), the graph says where a tensor comes
from: its ops' inputs, followed back to the batch, through conditions, loops and nested functions
(their captures). In eager mode (`run_eagerly=True`) a tensor does not say where it comes from,
and `Provenance.of_batch` answers None.
"""

from __future__ import annotations

import tensorflow as tf

from kmirror._core.keras_hooks import nested

__all__ = ["Provenance"]


class Provenance:
    """Where the tensors of one replica's step come from: the batch, or the model."""

    def __init__(self, batch) -> None:
        self._known: dict = {}  # an op -> whether it computes from the batch
        self._rows = set()  # the batch's row counts known when the step is traced
        for leaf in tf.nest.flatten(batch):
            if _symbolic(leaf):
                self._known[leaf.op] = True
            if tf.is_tensor(leaf) and leaf.shape.rank and leaf.shape[0] is not None:
                self._rows.add(leaf.shape[0])

    def mark(self, tensor) -> None:
        """`tensor` is rows of the batch (a call's joined output)."""
        if _symbolic(tensor):
            self._known[tensor.op] = True

    def of_batch(self, tensor) -> bool | None:
        """Whether the step computed `tensor` from its batch (None: not known, in eager mode):
        from the batch's tensors, or drawn in the step with as many rows as the batch has when
        its row count is known in the trace (noise of the batch's size). An input the graph
        does not say where it comes from (a loop's variable) is taken to be the model's: a call
        on it runs whole, which is one device's computation."""
        if tf.executing_eagerly():
            return None
        if not _symbolic(tensor):
            return False  # an array or a constant made outside the step
        start = tensor.op
        if start not in self._known:
            found, drawn = self._walk(start)
            rows = tensor.shape.rank and tensor.shape[0] in self._rows
            self._known[start] = found or bool(drawn and rows)
        return self._known[start]

    def _walk(self, start) -> tuple[bool, bool]:
        """(whether `start` computes from the batch, whether from a random draw)."""
        seen, stack, drawn = {start}, [start], False
        while stack:
            op = stack.pop()
            if self._known.get(op):
                return True, drawn
            drawn = drawn or _random(op)
            for source in _sources(op):
                if source not in seen:
                    seen.add(source)
                    stack.append(source)
        return False, drawn


def _random(op) -> bool:
    """Whether `op` draws random numbers (TensorFlow's stateful and stateless draws)."""
    kind = op.type
    return "Random" in kind or "TruncatedNormal" in kind or "Multinomial" in kind


def _symbolic(tensor) -> bool:
    return tf.is_tensor(tensor) and not tf.executing_eagerly() and hasattr(tensor, "op")


def _sources(op):
    """The ops whose outputs `op` computes from: its inputs and control inputs, and for a
    placeholder of a nested function (a branch of a condition, a loop's body), the tensor of the
    enclosing graph it captures."""
    found = [t.op for t in op.inputs] + list(op.control_inputs)
    if op.type == "Placeholder":
        external = nested.captured(op.outputs[0])
        if external is not None and hasattr(external, "op"):
            found.append(external.op)
    return found
