"""Where a batch's rows sit: the vocabulary of batches that hold part of a global batch.

Part `index` of `count` of a batch of `B` rows holds rows `[index*B//count, (index+1)*B//count)`
(`bounds`): a process's share, or a replica's. A batch that holds one process's rows says where
they sit (`{ROWS: rows, PLACE: [first row, global rows]}`), or, made by a dataset sharded by hand,
that its place is found by counting (`{LOCAL: rows}`); `unpack` reads either.

Example:

```python
rows, place = unpack(batch)   # place: None for a whole global batch
```
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

__all__ = [
    "ROWS",
    "PLACE",
    "LOCAL",
    "COUNTED",
    "bounds",
    "placed",
    "unpack",
    "row_count",
    "is_row_count",
]

# The keys of a batch that holds one process's rows (a dict no user batch is spelled as).
ROWS, PLACE, LOCAL = "kmirror_rows", "kmirror_place", "kmirror_local_batch"

#: `unpack`'s place for a batch whose place is found by summing the processes' row counts.
COUNTED = "counted"


def bounds(rows, index: int, count: int):
    """Rows `[index*rows//count, (index+1)*rows//count)`: the share of part `index` of `count`."""
    return rows * index // count, rows * (index + 1) // count


def placed(rows: Any, first, total, stack=tf.stack) -> dict:
    """A batch of `rows` that says where they sit: from row `first` of a global batch of `total`
    rows (`stack`: `np.stack` for a batch made in Python)."""
    return {ROWS: rows, PLACE: stack([first, total])}


def unpack(data: Any) -> tuple[Any, Any]:
    """`(the rows of a batch, where they sit in the global batch)`.

    The place is None for a global batch (every process holds it whole), a tensor
    `[first row, global rows]` for this process's rows of a batch made by `shard` or `arrays`,
    or `COUNTED` for a batch of `local_batches`.
    """
    if isinstance(data, dict) and set(data) == {ROWS, PLACE}:
        return data[ROWS], data[PLACE]
    if isinstance(data, dict) and set(data) == {LOCAL}:
        return data[LOCAL], COUNTED
    return data, None


def row_count(batch) -> tf.Tensor:
    """The rows of a (nested) batch, as an int64 tensor."""
    first = tf.nest.flatten(batch)[0]
    return tf.shape(first, out_type=tf.int64)[0]


def is_row_count(value) -> bool:
    """Whether `value` is a count of rows a batch can have: a whole number >= 1 (not a bool)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= 1
