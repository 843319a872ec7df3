"""Which rows of a global batch each replica takes, and where they sit in it.

Replica `r` of `n` takes rows `[r*B//n, (r+1)*B//n)` of the global batch of `B` rows. When a
process holds only its rows of the batch (`kmirror.data`), its replicas split those, knowing
where they sit: the batch says so, or (a dataset sharded by hand) each replica finds it from every
replica's row count. Prefetched rows arrive on their replicas' devices with their place.

Example:

```python
shards = placement.split(reducer, (x, y, sample_weight))  # per replica: rows, first row, B
```
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from kmirror._core import global_batch
from kmirror._core.feed import rows as rows_lib
from kmirror.reducers.base import Reducer

__all__ = [
    "one_row_at_least",
    "own_rows",
    "batch_size",
    "shard",
    "split",
    "located",
    "placed",
    "global_rows",
]


def batch_size(data: Any) -> tf.Tensor:
    """The number of rows of a (nested) batch, from its first tensor."""
    first = next(t for t in tf.nest.flatten(data) if t is not None)
    return tf.shape(first)[0]


def shard(data: Any, index: int, count: int) -> Any:
    """Rows `[index*B//count, (index+1)*B//count)` of every tensor in `data`, each by its own
    row count `B` (a batch may zip tensors of different row counts)."""

    def rows(tensor):
        start, stop = rows_lib.bounds(tf.shape(tensor)[0], index, count)
        return global_batch.any_count(tensor[start:stop])

    return tf.nest.map_structure(lambda t: None if t is None else rows(t), data)


def split(reducer: Reducer, data: Any, place: Any = None) -> Any:
    """Per replica: (its rows of `data`, the index of its first row in the global batch, the
    global batch's rows).

    `place` says what `data` is (`kmirror.data.unpack`): None, the global batch (every process
    holds it whole); a tensor `[first row, global rows]`, this process's rows of the global batch;
    `COUNTED`, this process's rows of a global batch made of every process's rows (the replica
    finds its place with `located`); per-replica values, each replica's rows already on its
    device (`_core.feed.feeding.on_devices`).
    """
    if place is None:
        total = batch_size(data)

        def rows_of(index, count):
            start, _ = rows_lib.bounds(total, index, count)
            return shard(data, index, count), start, total

        # tf.nest keeps None leaves (absent y or sample_weight) as they are.
        return reducer.distribute(rows_of)
    if isinstance(place, tf.distribute.DistributedValues):  # already on the replicas' devices
        return reducer.run(_with_place, args=(data, place))
    rows = batch_size(data)
    counted = place is rows_lib.COUNTED
    first, total = (0, -1) if counted else tf.unstack(tf.cast(place, rows.dtype))

    def local_rows(index, count):
        start, _ = rows_lib.bounds(rows, index, count)
        return shard(data, index, count), first + start, total

    return reducer.distribute_local(local_rows)


def _with_place(rows, place) -> tuple:
    place = tf.cast(place, tf.int32)  # its shape is relaxed to (None,) by tf.distribute
    return rows, place[0], place[1]


def located(reducer: Reducer, rows) -> tuple:
    """In replica context, for a batch of `COUNTED` place: `(the replica's first row, the global
    batch's rows)`, from every replica's row count (gathered in replica order)."""
    counts = reducer.all_gather(tf.reshape(tf.cast(rows, tf.int32), [1]))
    before = tf.range(tf.shape(counts)[0]) < tf.cast(reducer.replica_index(), tf.int32)
    return tf.reduce_sum(tf.where(before, counts, 0)), tf.reduce_sum(counts)


def global_rows(reducer: Reducer, data: Any, place: Any = None) -> tf.Tensor:
    """The rows of the global batch of which `data` holds all (place None) or its process's."""
    if place is None:
        return batch_size(data)
    if isinstance(place, tf.distribute.DistributedValues):
        return tf.cast(reducer.local_values(place)[0][1], tf.int32)
    if place is not rows_lib.COUNTED:
        return tf.cast(place[1], tf.int32)
    shards = split(reducer, data, place)
    return reducer.sum(reducer.run(lambda shard: batch_size(shard[0]), args=(shards,)))


def placed(reducer: Reducer, x, start, total, place) -> tuple:
    """In replica context: the replica's first row and the global batch's rows."""
    return located(reducer, batch_size(x)) if place is rows_lib.COUNTED else (start, total)


def one_row_at_least(data, count: tf.Tensor):
    """`data` (a nest of tensors, rows first) with one row of zeros added where it has no rows
    (`count` 0): the replica computes on that row, and only its first `count` rows are its own
    (`Rows.padded`). TensorFlow's oneDNN CPU kernels of the float32 convolutions mistake a batch
    of no rows, forward and backward (an output of the input's shape; an abort; checked on
    TensorFlow 2.19 and 2.21); a replica with rows adds none."""
    missing = 1 - tf.minimum(count, 1)

    def pad(tensor):
        if tensor is None or isinstance(tensor, tf.SparseTensor | tf.RaggedTensor):
            return tensor
        tensor = tf.convert_to_tensor(tensor)
        if tensor.shape.rank == 0:
            return tensor
        return tf.pad(tensor, [[0, missing]] + [[0, 0]] * (tensor.shape.rank - 1))

    return tf.nest.map_structure(pad, data)


def own_rows(values, count: tf.Tensor):
    """The first `count` rows of each tensor of `values`: the replica's own."""
    return tf.nest.map_structure(lambda t: None if t is None else t[:count], values)
