"""Sparse gradients summed over the replicas as one device makes them.

An embedding's gradient is a `tf.IndexedSlices`: a slice per looked-up index, in the order of the
lookup. Keras' optimizers update from the slices as they are (Adam squares each slice before
adding it to its second moment), so the sum over replicas must be the slices one device makes,
not merely the same dense sum:

- a lookup per row (tokens): one device's slices are every row's, in row order, so the replicas'
  slices joined in replica order (what every reducer does with `IndexedSlices`) are one device's;
- a lookup shared by the rows (positions, `arange(maxlen)`; a learned query): one device looks up
  once for the whole batch, with the sum of every row's gradient, so the replicas' slices are
  summed value by value, and keep the replica's own (identical) indices.

A lookup is shared when its indices do not depend on the values of the step's rows (the traced
graph says so; the shape of the rows, such as their length, does not count). In eager mode every
layer call runs whole on every replica (`keras_hooks.whole_calls.eager`): each replica looks up
every row, and every lookup is summed as a shared one.

Example:

```python
shared = shared_lookups(grads, rows_data)   # in replica context
sent, lookups = apart(grads, shared)        # the values of shared lookups are summed as tensors
summed = together(reduce(sent), lookups)    # in replica context again: one device's slices
```
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf

__all__ = ["shared_lookups", "apart", "together"]

#: Ops whose output depends on their input's shape only, not on its values.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "VariableShape"})


def shared_lookups(gradients: list, rows: Any, variables: list | None = None) -> list[bool]:
    """For each gradient (of each of `variables`): whether it is the gradient of a lookup shared
    by the rows `rows` (a nest of the replica's tensors: the step's inputs, targets and weights).
    An embedding looked up both ways in one step is summed as lookups per row, with a warning."""
    if not any(isinstance(g, tf.IndexedSlices) for g in gradients):
        return [False] * len(gradients)
    if tf.executing_eagerly():  # every call runs whole: each replica looks up every row
        return [isinstance(g, tf.IndexedSlices) for g in gradients]
    sources = {t.ref() for t in tf.nest.flatten(rows) if isinstance(t, tf.Tensor)}
    found = []
    for gradient, variable in zip(gradients, variables or [None] * len(gradients)):
        if not isinstance(gradient, tf.IndexedSlices):
            found.append(False)
            continue
        # A variable looked up several times has its slices joined (ConcatV2), a part per lookup.
        indices = gradient.indices
        parts = indices.op.inputs[:-1] if indices.op.type == "ConcatV2" else [indices]
        shared = [not _depends_on(part, sources) for part in parts]
        if any(shared) and not all(shared):
            warnings.warn(
                f"kmirror: {getattr(variable, 'path', 'an embedding')} is looked up both per row "
                "and once for all rows in one step; its gradient is summed as lookups per row, "
                "which is not the single-device gradient. Use a separate embedding for each kind "
                "of lookup.",
                stacklevel=2,
            )
        found.append(all(shared))
    return found


def apart(gradients: list, shared: list[bool]) -> tuple[list, list]:
    """(the gradients to sum, each shared lookup's (indices, dense_shape) or None): a shared
    lookup's slices are summed as a dense tensor of their values."""
    sent, lookups = [], []
    for gradient, is_shared in zip(gradients, shared):
        if is_shared:
            sent.append(gradient.values)
            lookups.append((gradient.indices, gradient.dense_shape))
        else:
            sent.append(gradient)
            lookups.append(None)
    return sent, lookups


def together(summed: list, lookups: list) -> list:
    """`apart`'s inverse on the summed gradients: each shared lookup's summed values at its
    indices."""
    return [
        g if lookup is None else tf.IndexedSlices(g, lookup[0], lookup[1])
        for g, lookup in zip(summed, lookups)
    ]


def _depends_on(tensor: tf.Tensor, sources: set) -> bool:
    """Whether `tensor`'s value depends on the value of a tensor in `sources` (refs)."""
    pending, seen = [tensor], set()
    while pending:
        current = pending.pop()
        if current.ref() in sources:
            return True
        op = current.op
        if op.name in seen or op.type in _SHAPE_OPS:
            continue
        seen.add(op.name)
        pending.extend(op.inputs)
    return False
