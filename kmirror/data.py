"""Input: each process loads only its rows of every global batch; within one process, each
replica's rows may be prefetched to its device (`on_devices`), and a resumed `fit` starts inside
an epoch (`resumed`).

The global batch, the order of the samples and the single-device result stay the same; only where
rows are loaded changes. Process `p` of `P` takes rows `[p*B//P, (p+1)*B//P)` of a batch of `B`
rows (its replicas then split them), so a job of 8 processes decodes each sample once, not 8 times.

Which case applies:

- **numpy arrays and tensors** given to `fit` or `evaluate` (with `y`, `sample_weight`,
  `class_weight`, `validation_split`, `validation_data`, `shuffle`): kmirror draws each batch's row
  indices as Keras does (the same shuffle, for the same seed) and gathers only this process's rows.
- **`tf.data` pipelines** built with `kmirror.data.shard(elements, global_batch_size, map_fn)`:
  the cheap elements (file names, record indices) are batched, each process keeps its rows, and
  only those go through `map_fn`, the expensive per-element work.
- **a `kmirror.data.RowDataset`**, a `PyDataset` that names each batch's rows (`batch_rows`)
  and loads any of them (`load`): each process loads only its rows of each batch, in the order
  Keras draws the batches.
- **a dataset you sharded yourself**, Horovod style (`dataset.shard(size, rank).batch(b)`), wrapped
  with `kmirror.data.local_batches(dataset)`: each process's batch is its rows, the global batch of
  a step is every process's batch in process order, and its size is summed across processes.
- **anything else** (a `tf.data.Dataset` of global batches, any other `PyDataset`, a generator):
  every process reads the whole global batch and keeps its rows, as within one process.

Example:

```python
import kmirror, keras, numpy as np, tensorflow as tf
x, y = np.random.rand(100, 8).astype("float32"), np.random.rand(100, 1).astype("float32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model = kmirror.wrap(model, reducer="one_device")
rows = tf.data.Dataset.range(100).shuffle(100, seed=1)   # cheap elements: row indices
data = kmirror.data.shard(rows, 32, map_fn=lambda i: (tf.gather(x, i), tf.gather(y, i)))
model.fit(data, epochs=1)   # 32 rows per step in all; each process loads only its own rows
```
"""

from __future__ import annotations

import os
import sys
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from kmirror import cluster, keras_hooks

__all__ = [
    "RowDataset",
    "shard",
    "local_batches",
    "process",
    "arrays",
    "is_arrays",
    "unpack",
    "local_batch_count",
    "on_devices",
    "resumed",
    "COUNTED",
]

# The keys of a batch that holds one process's rows (a dict no user batch is spelled as).
_ROWS, _PLACE, _LOCAL = "kmirror_rows", "kmirror_place", "kmirror_local_batch"

#: `unpack`'s place for a batch whose place is found by summing the processes' row counts.
COUNTED = "counted"


def process() -> tuple[int, int]:
    """`(this process's index, the job's number of processes)`: the multi-worker cluster joined
    with `kmirror.cluster.connect()`, else Horovod's rank and size, else `(0, 1)`.

    Example:

    ```python
    index, count = kmirror.data.process()   # (0, 1) in a script run alone
    ```
    """
    joined = cluster.joined()
    if joined is not None:
        return joined.index, joined.num_workers
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is not None and hvd.is_initialized():  # launched by mpirun as well
        return hvd.rank(), hvd.size()
    if "HOROVOD_RANK" in os.environ and "HOROVOD_SIZE" in os.environ:
        return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    return 0, 1


def bounds(rows, index: int, count: int):
    """Rows `[index*rows//count, (index+1)*rows//count)`: the share of part `index` of `count`."""
    return rows * index // count, rows * (index + 1) // count


class RowDataset(keras.utils.PyDataset):
    """A `PyDataset` whose batches a job loads in parts: each process loads only its rows.

    Define `__len__` (the number of batches), `batch_rows(index)` (which samples batch `index`
    holds: cheap, such as file names or record numbers) and `load(rows)` (the batch of those
    samples, in that order: the expensive work). A batch is `load(batch_rows(index))`, so on one
    device and in plain Keras this is an ordinary `PyDataset`; in a job of several processes,
    process `p` of `P` loads rows `[p*B//P, (p+1)*B//P)` of each batch of `B` rows (possibly none:
    `load` then gets an empty list, and its result must have 0 rows). Batches are drawn in the
    order Keras draws them (`shuffle=True` included), so training is the single-device one.

    Example:

    ```python
    import keras, kmirror, numpy as np
    x, y = np.random.rand(100, 8).astype("float32"), np.random.rand(100, 1).astype("float32")

    class Rows(kmirror.data.RowDataset):
        def __len__(self):
            return 4                                # batches of 25 rows

        def batch_rows(self, index):                # cheap: which samples (file names, ...)
            return list(range(index * 25, (index + 1) * 25))

        def load(self, rows):                       # the expensive work, on these samples only
            return x[rows], y[rows]

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model = kmirror.wrap(model, reducer="one_device")
    model.fit(Rows(), epochs=1, shuffle=True)       # each process loads only its rows
    ```
    """

    def batch_rows(self, index: int):
        """The samples of batch `index`, as a sequence `load` takes (in order)."""
        raise NotImplementedError(f"{type(self).__name__} must define batch_rows(index).")

    def load(self, rows):
        """The batch holding samples `rows` (a slice of `batch_rows`' sequence), like `__getitem__`
        returns: `(x, y)`, `(x, y, sample_weight)`, `(x,)` or a dict."""
        raise NotImplementedError(f"{type(self).__name__} must define load(rows).")

    def __getitem__(self, index: int):
        return self.load(self.batch_rows(index))


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
        return {_ROWS: rows, _PLACE: tf.stack([start, rows_of(batch)])}

    batches = kept.batch(_share(batch_size, index, count)).enumerate().map(placed)
    return batches.apply(tf.data.experimental.assert_cardinality(-(-size // batch_size)))


def _by_batches(elements, batch_size, map_fn, num_parallel_calls, index, count):
    """Batches the elements, keeps process `index`'s rows of each batch and maps them: for any
    dataset (a process may hold no row of a batch)."""
    spec = elements.map(map_fn).element_spec if map_fn is not None else None

    def mine(batch):
        total = _rows(batch)
        start, stop = bounds(total, index, count)
        rows = tf.nest.map_structure(lambda t: t[start:stop], batch)
        if map_fn is not None:
            rows = tf.map_fn(_applied(map_fn), rows, fn_output_signature=spec)
        return {_ROWS: rows, _PLACE: tf.stack([start, total])}

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
    return dataset.map(lambda *batch: {_LOCAL: batch if len(batch) > 1 else batch[0]})


def local_batch_count(dataset) -> int | None:
    """How many batches a `local_batches` dataset yields per pass, if TensorFlow knows (else, and
    for any other input, None)."""
    if not isinstance(dataset, tf.data.Dataset):
        return None
    spec = dataset.element_spec
    if not (isinstance(spec, dict) and set(spec) == {_LOCAL}):
        return None
    count = int(dataset.cardinality())
    return count if count >= 0 else None


def arrays(
    x,
    y=None,
    sample_weight=None,
    *,
    batch_size: int | None,
    shuffle=False,
    class_weight=None,
    index: int,
    count: int,
) -> tf.data.Dataset:
    """The batches `fit` makes of arrays, holding process `index` of `count`'s rows only.

    The row indices of each global batch are drawn by Keras' own array adapter (same order,
    same shuffle for the same seed); only this process's rows are gathered.
    """
    if class_weight is not None:
        if sample_weight is not None:
            raise ValueError(
                "class_weight and sample_weight cannot be given together (as in Keras): pass the "
                "class weights as sample weights, or only class_weight."
            )
        sample_weight = keras_hooks.class_weighted(y, class_weight)
    if tf.nest.is_nested(y) and sample_weight is not None and not tf.nest.is_nested(sample_weight):
        sample_weight = tf.nest.map_structure(lambda _: sample_weight, y)  # as Keras does
    data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(data)]
    num_samples = int(flat[0].shape[0])
    if any(int(t.shape[0]) != num_samples for t in flat):
        sizes = sorted({int(t.shape[0]) for t in flat})
        raise ValueError(f"x, y and sample_weight must have as many rows; got sizes {sizes}.")
    batch_size = batch_size or 32
    order = keras_hooks.batch_order(num_samples, batch_size, shuffle)

    def mine(indices, tensors):
        total = tf.shape(indices, out_type=tf.int64)[0]
        start, stop = bounds(total, index, count)
        rows = [tf.gather(t, indices[start:stop], axis=0) for t in tensors]
        return {_ROWS: tf.nest.pack_sequence_as(data, rows), _PLACE: tf.stack([start, total])}

    source = tf.data.Dataset.from_tensors(tuple(flat)).repeat()
    batches = tf.data.Dataset.zip((order, source)).map(mine, num_parallel_calls=tf.data.AUTOTUNE)
    steps = -(-num_samples // batch_size)
    batches = batches.apply(tf.data.experimental.assert_cardinality(steps))
    return batches.prefetch(tf.data.AUTOTUNE)


def is_arrays(*values) -> bool:
    """Whether every non-None leaf of `values` is a numpy array or a tensor (what `arrays`
    takes)."""
    leaves = [v for v in tf.nest.flatten(values) if v is not None]
    return bool(leaves) and all(isinstance(v, np.ndarray | tf.Tensor) for v in leaves)


def unpack(data: Any) -> tuple[Any, Any]:
    """`(the rows of a batch, where they sit in the global batch)`.

    The place is None for a global batch (every process holds it whole), a tensor
    `[first row, global rows]` for this process's rows of a batch made by `shard` or `arrays`,
    or `COUNTED` for a batch of `local_batches`.
    """
    if isinstance(data, dict) and set(data) == {_ROWS, _PLACE}:
        return data[_ROWS], data[_PLACE]
    if isinstance(data, dict) and set(data) == {_LOCAL}:
        return data[_LOCAL], COUNTED
    return data, None


def on_devices(dataset: tf.data.Dataset, reducer) -> Any:
    """`dataset`'s batches with each local replica's rows prefetched to its device ahead of the
    step, as `tf.distribute` prefetches per-replica batches; `dataset` itself where the reducer
    does not prefetch (`Reducer.batches_on_devices`) or its batches' place is found by counting.

    Each element of the result is, per replica, its rows of one batch with their place
    (`unpack`): the same rows and places as the step's own split of the host batch.
    """
    spec, place = unpack(dataset.element_spec)
    if place is COUNTED or not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(spec)):
        return dataset
    count = len(reducer.devices)
    per_replica = reducer.batches_on_devices(_replica_rows(dataset, count))
    if per_replica is None:
        return dataset
    return keras_hooks.distributed_input(per_replica, int(dataset.cardinality()))


def resumed(dataset: tf.data.Dataset, epoch: int, step: int) -> Any:
    """`dataset` as `fit` reads it when resuming `step` batches into epoch `epoch` (0-based): the
    first pass skips the `step` batches already trained, later passes are whole, and each draws
    what the uninterrupted run drew: the passes that run began and this one did not are begun
    and left unread, so that a reshuffling dataset's seed stands where it stood."""
    return keras_hooks.distributed_input(_Resumed(dataset, epoch, step), int(dataset.cardinality()))


class _Resumed(tf.distribute.DistributedDataset):
    """A dataset whose first pass starts inside an epoch (Keras begins passes with `iter`)."""

    def __init__(self, dataset: tf.data.Dataset, epoch: int, step: int) -> None:
        self._dataset = dataset
        self._passes = 0
        self._resume = (epoch, step)

    def __iter__(self):
        self._passes += 1
        epoch, step = self._resume
        if self._passes == 1:
            self._begin(keras_hooks.passes_begun_before(epoch))
            return iter(self._dataset.skip(step))
        if self._passes == 2 and step:
            # The resumed epoch ran out of batches early: Keras did not begin the pass it begins
            # at the end of a whole epoch.
            self._begin(1)
        return iter(self._dataset)

    def _begin(self, passes: int) -> None:
        for _ in range(passes):
            iter(self._dataset)

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def reduce(self, initial_state, reduce_func):
        return self._dataset.reduce(initial_state, reduce_func)


def _replica_rows(dataset: tf.data.Dataset, count: int) -> tf.data.Dataset:
    """Each batch of `dataset` as `count` elements: replica `r`'s rows of it, with their place."""

    def replicas(batch):
        rows, place = unpack(batch)
        local = _rows(rows)
        first, total = (tf.constant(0, tf.int64), local) if place is None else tf.unstack(place)

        def replica(index):
            start, stop = bounds(local, index, count)
            mine = tf.nest.map_structure(lambda t: t[start:stop], rows)
            return {_ROWS: mine, _PLACE: tf.stack([first + start, total])}

        return tf.data.Dataset.range(count).map(replica)

    batches = dataset.flat_map(lambda *batch: replicas(batch if len(batch) > 1 else batch[0]))
    steps = int(dataset.cardinality())
    if steps >= 0:
        batches = batches.apply(tf.data.experimental.assert_cardinality(steps * count))
    return batches


def _rows(batch) -> tf.Tensor:
    first = tf.nest.flatten(batch)[0]
    return tf.shape(first, out_type=tf.int64)[0]


def _applied(map_fn):
    """`map_fn` called as `Dataset.map` calls it: a tuple element spread over its arguments."""

    def call(element):
        return map_fn(*element) if isinstance(element, tuple) else map_fn(element)

    return call


def _check_batch_size(global_batch_size) -> None:
    if (
        not isinstance(global_batch_size, int | np.integer)
        or isinstance(global_batch_size, bool)
        or global_batch_size < 1
    ):
        raise ValueError(
            f"global_batch_size must be a whole number >= 1 (the rows of one step over the whole "
            f"job); got {global_batch_size!r}."
        )
