"""Gradient accumulation with one reduction per update.

With `gradient_accumulation_steps=k`, Keras' optimizer adds each step's gradient to its
accumulators and applies their mean every k-th step. kmirror keeps each replica's local sums in
the accumulators and sums over the replicas only on the update step, so the gradients cross the
replicas once per update, not once per step.

Example:

```python
grads = accumulated(reducer, optimizer, grads, variables)   # cross-replica context
reducer.run(lambda g: optimizer.apply_gradients(zip(g, variables)), args=(grads,))
```
"""

from __future__ import annotations

import tensorflow as tf

from kmirror._core import keras_hooks
from kmirror.reducers.base import Reducer

__all__ = ["accumulated"]


def accumulated(reducer: Reducer, optimizer, grads: list, variables: list) -> list:
    """The gradients each replica's optimizer applies this step, summed once per update.

    Keras' optimizer adds each micro-step's gradient to its accumulators and, every k-th step,
    applies (gradient + accumulators) / k. Here the accumulators hold the replica's LOCAL sums; on
    the update step the replica's accumulators are emptied and the optimizer is handed the sum
    over replicas of (gradient + accumulators): the global accumulated gradient, reduced once.
    """
    update, accumulators = keras_hooks.accumulation(optimizer, variables)

    def with_accumulators(grads):
        dense = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        return [None if g is None else g + acc.value for g, acc in zip(dense, accumulators)]

    local = reducer.run(with_accumulators, args=(grads,))
    present = [i for i, g in enumerate(grads) if g is not None]

    def summed():
        reduced = reducer.reduce_gradients([local[i] for i in present])
        return [reducer.local_values(g) for g in reduced]

    def unsummed():
        return [tuple(_zeros_beside(t) for t in reducer.local_values(local[i])) for i in present]

    flat = tf.cond(update, summed, unsummed)
    totals = [None] * len(grads)
    for i, values in zip(present, flat):
        totals[i] = reducer.from_local_values(values)

    def choose(grads, totals):
        chosen = []
        for g, total, acc in zip(grads, totals, accumulators):
            if g is None:
                chosen.append(None)
                continue
            acc.assign(tf.where(update, tf.zeros_like(acc.value), acc.value))
            chosen.append(tf.where(update, total, tf.convert_to_tensor(g)))
        return chosen

    return reducer.run(choose, args=(grads, totals))


def _zeros_beside(tensor):
    with tf.device(tensor.device):
        return tf.zeros_like(tensor)
