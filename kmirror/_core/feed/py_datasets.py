"""A `PyDataset` as a wrapped model's `fit` and `evaluate` read it: a `tf.data` pipeline of its
batches, drawn as Keras' PyDataset adapter draws them.

Keras reads a `PyDataset` of known length pass by pass: it calls the dataset's `on_epoch_begin`,
draws the order of the batches with Python's `random.shuffle` when `shuffle=True`, reads the
batches in that order and calls `on_epoch_end`. Before the first pass of a `fit` or `evaluate`
(and of every validation), it calls `on_epoch_end` once more (its epoch iterator's reset), so a
dataset that reshuffles there has reshuffled once before the first epoch. `Batches` does the same,
at the same moments (a pass begins when its first batch is read, and ends once all its batches
are loaded, before the last is handed on: when `fit` or `evaluate` returns, every pass has
ended), so training is the single-device one, and:

- for a `kmirror.data.RowDataset` in a job of several processes, each process loads only its
  rows of each batch (`load(rows)`), handed on with their place in the batch;
- it knows where each pass drew its order from (`drawn_from`), and a resumed `fit` can start the
  first pass inside it without loading the batches already trained (`resume`).

The dataset's `workers` load batches ahead in threads (`use_multiprocessing` too: its batches are
loaded in threads of this process); up to `max_queue_size` batches wait, as in Keras.
"""

from __future__ import annotations

import collections
import random
import weakref
from concurrent import futures

import keras
import numpy as np
import tensorflow as tf

from kmirror._core import keras_hooks
from kmirror._core.feed.rows import PLACE, ROWS, bounds, placed

__all__ = ["RowDataset", "readable", "Batches"]


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


# The element specs of each PyDataset read so far, found from its first two batches once.
_specs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def readable(x, steps) -> bool:
    """Whether `Batches` reads `x`: a `PyDataset` of known length, read whole every pass (no
    `steps_per_epoch` or `steps`)."""
    return isinstance(x, keras.utils.PyDataset) and x.num_batches is not None and not steps


class Batches:
    """The batches of a `PyDataset`, pass after pass, as a `tf.data.Dataset` (`dataset`)."""

    def __init__(
        self, source, *, shuffle=False, class_weight=None, index=0, count=1, validation=False
    ) -> None:
        self.source = source
        #: Passes Keras begins with a reset: the first (fit, evaluate), or each (validation).
        self._resets = float("inf") if validation else 1
        self.shuffle = bool(shuffle)
        self._where = (index, count)
        self._rows = isinstance(source, RowDataset) and count > 1
        self._standard = keras_hooks.py_dataset_batches(source, class_weight)
        self._weighted = class_weight is not None
        self._skip = 0
        #: Python's random state the current pass drew its order from (None before any pass).
        self.drawn_from: tuple | None = None

    @property
    def num_batches(self) -> int:
        return self.source.num_batches

    def resume(self, skip: int) -> None:
        """The next pass starts after its first `skip` batches, which it does not load."""
        self._skip = skip

    def dataset(self) -> tf.data.Dataset:
        """The batches of every pass; each process's rows with their place for a `RowDataset`
        in a job of several processes."""
        known = _specs.setdefault(self.source, {})
        kind = (self._rows, self._weighted)
        if kind not in known:
            first = [self._batch(i) for i in range(min(2, self.num_batches))]
            known[kind] = _any_rows(keras_hooks.batches_spec(first))
        spec = known[kind]
        return tf.data.Dataset.from_generator(self._pass, output_signature=spec).prefetch(
            tf.data.AUTOTUNE
        )

    def _pass(self):
        if self._resets:  # Keras' epoch iterator ends a pass when it is made or reset
            self._resets -= 1
            self.source.on_epoch_end()
        self.source.on_epoch_begin()
        order = list(range(self.num_batches))
        self.drawn_from = random.getstate()
        if self.shuffle:
            random.shuffle(order)
        skip, self._skip = self._skip, 0
        last = None  # held back: the pass ends when it is loaded, not when tf.data asks past it
        for batch in self._loaded(order[skip:]):
            if last is not None:
                yield last
            last = batch
        self.source.on_epoch_end()
        if last is not None:
            yield last

    def _loaded(self, order):
        workers = self.source.workers
        if workers <= 1 and not self.source.use_multiprocessing:
            for i in order:
                yield self._batch(i)
            return
        waiting = collections.deque()
        with futures.ThreadPoolExecutor(max(workers, 1)) as pool:
            for i in order:
                waiting.append(pool.submit(self._batch, i))
                if len(waiting) > max(self.source.max_queue_size, 1):
                    yield waiting.popleft().result()
            while waiting:
                yield waiting.popleft().result()

    def _batch(self, i: int):
        if not self._rows:
            return self._standard(self.source[i])
        rows = list(self.source.batch_rows(i))
        start, stop = bounds(len(rows), *self._where)
        batch = self._standard(self.source.load(rows[start:stop]))
        return placed(batch, start, len(rows), lambda place: np.array(place, np.int64))


def _any_rows(spec):
    """`spec` with any number of rows per batch (an element's first dimension None); a row
    place keeps its two values."""
    if isinstance(spec, dict) and set(spec) == {ROWS, PLACE}:
        return {ROWS: _any_rows(spec[ROWS]), PLACE: tf.TensorSpec([2], tf.int64)}

    def one(s):
        if isinstance(s, tf.TensorSpec) and s.shape.rank:
            return tf.TensorSpec([None, *s.shape[1:]], s.dtype, s.name)
        return s

    return tf.nest.map_structure(one, spec)
