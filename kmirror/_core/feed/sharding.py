"""Each process's rows of every global batch: `shard`, `local_batches` and what the input of a job
of several processes needs; public as `kmirror.data`, whose page says which input loads how."""

from __future__ import annotations

import tensorflow as tf

from kmirror._core.cluster import process
from kmirror._core.feed.py_datasets import RowDataset
from kmirror._core.feed.rows import COUNTED, LOCAL, bounds, is_row_count, row_count, unpack
from kmirror._core.feed.rows import placed as placed_rows

__all__ = [
    "RowDataset",
    "shard",
    "local_batches",
    "process",
    "bounds",
    "unpack",
    "local_batch_count",
    "COUNTED",
]


def shard(
    elements: tf.data.Dataset,
    global_batch_size: int,
    map_fn=None,
    *,
    num_parallel_calls: int | None = tf.data.AUTOTUNE,
) -> tf.data.Dataset:
    """This process's rows of every global batch of `elements`, after `map_fn`.

    Put it where the expensive work starts: `elements` yields one cheap element at a time (a file
    name, a record index, an encoded record), already shuffled with a fixed seed if at all (every
    process must draw the same order); `map_fn` decodes or augments one element. The global batch
    of each step is the same `global_batch_size` elements as `elements.map(map_fn)
    .batch(global_batch_size)` on one device, the last one smaller; only this process's rows of
    it reach `map_fn`. Elements must have one shape (batching them comes first).

    Example:

    ```python
    records = tf.data.Dataset.range(len(paths)).shuffle(len(paths), seed=7)
    data = kmirror.data.shard(records, 256, map_fn=lambda i: load(i))
    model.fit(data, epochs=3)
    ```

    Args:
        elements: an unbatched `tf.data.Dataset`.
        global_batch_size: rows per step over the whole job (`batch_size` of one device).
        map_fn: the per-element work, run on this process's elements only (None: none).
        num_parallel_calls: batches mapped in parallel (`tf.data.AUTOTUNE` by default).

    Returns:
        A dataset to pass to a wrapped model's `fit` or `evaluate`.
    """
    if not isinstance(elements, tf.data.Dataset):
        raise TypeError(
            f"kmirror.data.shard takes a tf.data.Dataset of single elements; got "
            f"{type(elements).__name__}. Make one with tf.data.Dataset.from_tensor_slices(...)."
        )
    _check_batch_size(global_batch_size)
    index, count = process()
    size = int(elements.cardinality())
    if size >= 0 and _batchable(size, global_batch_size, index, count):
        batches = _by_elements(
            elements, size, global_batch_size, map_fn, num_parallel_calls, index, count
        )
    else:
        batches = _by_batches(elements, global_batch_size, map_fn, num_parallel_calls, index, count)
    return batches.prefetch(tf.data.AUTOTUNE)


def _batchable(size: int, batch_size: int, index: int, count: int) -> bool:
    """Whether this process's elements, in order, batch into its share of every global batch
    with one `batch` call: a share of every batch, the last share no larger than the others."""
    full = _share(batch_size, index, count)
    last = _share(size % batch_size, index, count)
    return full > 0 and (size % batch_size == 0 or 0 < last <= full)


def _share(rows: int, index: int, count: int) -> int:
    start, stop = bounds(rows, index, count)
    return stop - start


def _by_elements(elements, size, batch_size, map_fn, num_parallel_calls, index, count):
    """Keeps process `index`'s elements (by their position in their global batch), maps them one
    by one in parallel and batches them: for datasets of known size."""
    full_batches, last = divmod(size, batch_size)

    def rows_of(batch):  # the rows of global batch `batch`
        return tf.where(batch < full_batches, tf.constant(batch_size, tf.int64), last)

    def mine(position, _):
        start, stop = bounds(rows_of(position // batch_size), index, count)
        return (position % batch_size >= start) & (position % batch_size < stop)

    kept = elements.enumerate().filter(mine).map(lambda _, element: element)
    if map_fn is not None:
        kept = kept.map(map_fn, num_parallel_calls=num_parallel_calls)

    def placed(batch, rows):
        start, _ = bounds(rows_of(batch), index, count)
        return placed_rows(rows, start, rows_of(batch))

    batches = kept.batch(_share(batch_size, index, count)).enumerate().map(placed)
    return batches.apply(tf.data.experimental.assert_cardinality(-(-size // batch_size)))


def _by_batches(elements, batch_size, map_fn, num_parallel_calls, index, count):
    """Batches the elements, keeps process `index`'s rows of each batch and maps them: for any
    dataset (a process may hold no row of a batch)."""
    spec = elements.map(map_fn).element_spec if map_fn is not None else None

    def mine(batch):
        total = row_count(batch)
        start, stop = bounds(total, index, count)
        rows = tf.nest.map_structure(lambda t: t[start:stop], batch)
        if map_fn is not None:
            rows = tf.map_fn(_applied(map_fn), rows, fn_output_signature=spec)
        return placed_rows(rows, start, total)

    return elements.batch(batch_size).map(mine, num_parallel_calls=num_parallel_calls)


def local_batches(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Marks `dataset` as already sharded by you: each of its batches holds this process's rows.

    The global batch of a step is every process's batch joined in process order (rank order
    under Horovod, task order across workers); its size is summed across processes at every
    step. The single-device equivalent trains on those joined batches. Every process must yield
    as many batches per epoch (use `drop_remainder=True` or `steps_per_epoch` if in doubt):
    when TensorFlow knows the counts, `fit` and `evaluate` compare them first and refuse to start
    if they differ.

    Example:

    ```python
    rank, size = kmirror.data.process()
    data = tf.data.Dataset.from_tensor_slices((x, y)).shard(size, rank).batch(64)
    model.fit(kmirror.data.local_batches(data), epochs=3)   # 64 * size rows per step
    ```
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"kmirror.data.local_batches takes a batched tf.data.Dataset; got "
            f"{type(dataset).__name__}."
        )
    return dataset.map(lambda *batch: {LOCAL: batch if len(batch) > 1 else batch[0]})


def local_batch_count(dataset) -> int | None:
    """How many batches a `local_batches` dataset yields per pass, if TensorFlow knows (else, and
    for any other input, None)."""
    if not isinstance(dataset, tf.data.Dataset):
        return None
    spec = dataset.element_spec
    if not (isinstance(spec, dict) and set(spec) == {LOCAL}):
        return None
    count = int(dataset.cardinality())
    return count if count >= 0 else None


def _applied(map_fn):
    """`map_fn` called as `Dataset.map` calls it: a tuple element spread over its arguments."""

    def call(element):
        return map_fn(*element) if isinstance(element, tuple) else map_fn(element)

    return call


def _check_batch_size(global_batch_size) -> None:
    if not is_row_count(global_batch_size):
        raise ValueError(
            f"global_batch_size must be a whole number >= 1 (the rows of one step over the whole "
            f"job); got {global_batch_size!r}."
        )
