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

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from kmirror._core.feed import rows as rows_lib
from kmirror.reducers.base import Reducer

__all__ = [
    "batch_size",
    "shard",
    "split",
    "located",
    "placed",
    "global_rows",
    "eager_empty_rows_explained",
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
        return tensor[start:stop]

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


@contextlib.contextmanager
def eager_empty_rows_explained(reducer: Reducer, data: Any, place: Any = None) -> Iterator[None]:
    """Around a step run eagerly (`run_eagerly=True`): an error raised while some of this
    process's replicas had no rows says so. Eagerly, Keras' layers see a replica's empty batch
    with its concrete shape, and some fail on it (Keras 3.15.1: the LSTM and GRU cells, global
    max pooling), where a traced step, whose row count is unknown when traced, runs them."""
    try:
        yield
    except (tf.errors.OpError, ValueError) as error:
        if not tf.executing_eagerly():
            raise
        counts = reducer.run(
            lambda shard: batch_size(shard[0]), args=(split(reducer, data, place),)
        )
        empty = sum(int(count) == 0 for count in reducer.local_values(counts))
        if not empty:
            raise
        raise ValueError(
            f"kmirror: this batch left {empty} of this process's replicas without rows, and with "
            "run_eagerly=True Keras' layers ran eagerly on their empty batch, which a layer of "
            f"this model cannot ({type(error).__name__}). Compile with run_eagerly=False "
            "(kmirror's traced step runs every layer on no rows), or choose a batch size that "
            "leaves no final batch smaller than the replica count."
        ) from error
