"""Small tensors packed together for one collective: Horovod's (one negotiation per buffer instead
of one per tensor: Horovod negotiates each tensor it is given; a deep model has hundreds), and a
reducer's sums of a few small values inside a step (`in_one`).

Example:

```python
summed = packing.packed_sum(hvd, gradients, num_packs=2)
```
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

__all__ = ["PACK_BELOW_BYTES", "packed_sum", "packed_broadcast", "in_one"]

#: Gradients smaller than this are packed together before the all-reduce; larger ones are sent
#: as they are.
PACK_BELOW_BYTES = 1024 * 1024


def _groups(tensors: list, num_packs: int) -> list[list[int]]:
    """Indices of `tensors` in packs: per dtype, up to `num_packs` runs of consecutive tensors
    of about equal size."""
    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    groups = []
    for indices in by_dtype.values():
        sizes = [tensors[i].shape.num_elements() or 1 for i in indices]
        per_pack = sum(sizes) / num_packs
        run, filled, done = [], 0, 0
        for i, size in zip(indices, sizes):
            run.append(i)
            filled += size
            if filled >= per_pack * (done + 1):
                groups.append(run)
                run, done = [], done + 1
        if run:
            groups.append(run)
    return groups


def packed_sum(hvd, tensors: list, num_packs: int) -> list:
    """Sums `tensors` over the processes in one grouped all-reduce: the small ones concatenated
    into `num_packs` flat buffers per dtype (one negotiation each instead of one per tensor), the
    large ones as they are (copying them into a buffer would cost more than it saves)."""
    small = [i for i, t in enumerate(tensors) if _nbytes(t) < PACK_BELOW_BYTES]
    large = sorted(set(range(len(tensors))) - set(small))
    groups = [[small[j] for j in g] for g in _groups([tensors[i] for i in small], num_packs)]
    packs = [tf.concat([tf.reshape(tensors[i], [-1]) for i in g], axis=0) for g in groups]
    summed = hvd.grouped_allreduce(packs + [tensors[i] for i in large], op=hvd.Sum)
    out = [None] * len(tensors)
    for i, total in zip(large, summed[len(packs) :]):
        out[i] = total
    for total, group in zip(summed, groups):
        sizes = tf.stack([tf.size(tensors[i]) for i in group])
        for i, part in zip(group, tf.split(total, sizes, num=len(group))):
            out[i] = tf.reshape(part, tf.shape(tensors[i]))
    return out


def _storage(variable) -> tf.Variable:
    return variable if isinstance(variable, tf.Variable) else variable.value


def _nbytes(tensor) -> int:
    elements = tensor.shape.num_elements()
    return PACK_BELOW_BYTES if elements is None else elements * tensor.dtype.size


def packed_broadcast(hvd, variables: list) -> None:
    """Assigns rank 0's values to `variables`, in one broadcast per dtype."""
    for group in _groups(variables, 1):
        # A Keras variable's storage, or a raw tf.Variable an optimizer tracks, itself.
        values = [_storage(variables[i]) for i in group]
        flat = tf.concat([tf.reshape(v, [-1]) for v in values], axis=0)
        flat = hvd.broadcast(flat, root_rank=0)
        for value, part in zip(values, tf.split(flat, [v.shape.num_elements() for v in values])):
            value.assign(tf.reshape(part, value.shape))


def in_one(sum_one: Callable, tensors: list) -> list:
    """`tensors` (of one dtype) summed by one call of `sum_one`: flattened, joined, summed, and
    parted again into their shapes."""
    if len(tensors) == 1:
        return [sum_one(tensors[0])]
    total = sum_one(tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0))
    sizes = [t.shape.num_elements() for t in tensors]
    if None in sizes:
        sizes = tf.stack([tf.size(t) for t in tensors])
    parts = tf.split(total, sizes, num=len(tensors))
    return [tf.reshape(p, _shape(t)) for p, t in zip(parts, tensors)]


def _shape(tensor):
    return tensor.shape if tensor.shape.is_fully_defined() else tf.shape(tensor)
