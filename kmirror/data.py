"""Input: each process loads only its rows of every global batch; within one process, each
replica's rows may be prefetched to its device, and a resumed `fit` may start inside an epoch
(`_core.feed.feeding`).

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

from kmirror._core.feed.sharding import (
    COUNTED,
    RowDataset,
    bounds,
    local_batch_count,
    local_batches,
    process,
    shard,
    unpack,
)

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
