"""What a wrapped model's `fit` and `evaluate` hand Keras: the user's input as this job reads it.

- numpy arrays and tensors: when the job has several processes, each batch holds this process's
  rows (`_core.feed.feeding.arrays`); within one process they become a dataset of whole batches when
  those are prefetched to the replicas or resumed inside an epoch;
- a `PyDataset` of known length: `_core.feed.py_datasets`' pipeline of its batches, drawn as Keras
  draws them (a `kmirror.data.RowDataset`'s rows per process);
- a `tf.data` dataset: prefetched to the replicas' devices (`_core.feed.feeding.on_devices`), or
  resumed inside an epoch (`_core.feed.feeding.resumed`);
- a `kmirror.data.local_batches` dataset: the processes' batch counts are compared first.

The model is built from a dataset's element spec before Keras reads it (`build`), so that no
batch is drawn before training.

Example:

```python
inputs = Inputs(reducer, prefetch=False, build=model.build_from_spec)
arguments = inputs.for_fit(arguments_of(keras.Model.fit, model, args, kwargs, True), None)
```
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from kmirror._core import keras_hooks
from kmirror._core.callbacks.backup_folder import Position
from kmirror._core.feed import feeding, py_datasets, sharding
from kmirror._core.feed import rows as rows_lib
from kmirror.reducers.base import Reducer

__all__ = ["Inputs", "arguments_of", "batch_spec"]


def arguments_of(method, model, args, kwargs, chief: bool) -> dict:
    """`method`'s arguments by name; one progress bar per job: other processes than the chief
    are quiet unless `verbose` was given."""
    signature = inspect.signature(method)
    given = {}
    for name, value in signature.bind(model, *args, **kwargs).arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            given.update(value)
        elif name != "self":
            given[name] = value
    if not chief and "verbose" not in given:
        given["verbose"] = 0
    for name in ("batch_size", "validation_batch_size"):
        check_batch_size(name, given.get(name))
    x = given.get("x")
    split = given.get("validation_split")
    batched = isinstance(x, tf.data.Dataset | keras.utils.PyDataset) or inspect.isgenerator(x)
    if split and given.get("validation_data") is None and batched:
        raise ValueError(
            f"validation_split={split!r} splits numpy arrays and tensors only; x is a "
            f"{type(x).__name__}. Pass validation_data=... instead."
        )
    return given


def check_batch_size(name: str, value) -> None:
    """Refuses a batch size that is not None or a whole number >= 1."""
    if value is not None and not rows_lib.is_row_count(value):
        raise ValueError(
            f"{name}={value!r}: give a whole number >= 1 (the global batch: the rows of one step "
            "over every replica), or None for Keras' default."
        )


def batch_spec(data):
    """The specs of a batch of `data` (validation data as `fit` takes it: a tuple of arrays or
    tensors, or a `tf.data` dataset), the batch dimension unknown; None for other input."""
    if isinstance(data, tf.data.Dataset):
        return rows_lib.unpack(data.element_spec)[0]
    if isinstance(data, tuple | list) and data and feeding.is_arrays(*data):
        return tf.nest.map_structure(
            lambda a: None if a is None else tf.TensorSpec([None, *a.shape[1:]], a.dtype),
            tuple(data),
        )
    return None


class Inputs:
    """Turns `fit`'s and `evaluate`'s arguments into what Keras reads in this job."""

    def __init__(
        self,
        reducer: Reducer,
        prefetch: bool,
        build: Callable[[Any, str], None],
        built: Callable[[], bool],
    ) -> None:
        self._reducer = reducer
        self._prefetch = prefetch
        self._build = build  # builds the model from a dataset's element spec, for a step
        self._built = built
        #: `local_batches` datasets whose batch counts the processes compared.
        self._counted = weakref.WeakSet()
        #: The PyDataset the current `fit` reads, or None.
        self.batches: py_datasets.Batches | None = None

    def for_fit(self, arguments: dict, resume: Position | None) -> dict:
        """`fit`'s arguments as Keras reads them; `resume` is where a relaunch starts."""
        skipping = resume is not None and resume.step > 0
        given = self._rows_of_process(arguments, fit=True, skipping=skipping)
        # The resumed pass of a PyDataset does not load the batches already trained.
        given = self._read_py_datasets(given, fit=True, skip=resume.step if skipping else 0)
        self._check_local_batches(given)
        self._build(given.get("x"), "train_step")
        if resume is None:
            return self._on_devices(given)
        if isinstance(given.get("x"), tf.data.Dataset):
            # Not prefetched: the resumed pass is this dataset's own.
            given["x"] = feeding.resumed(given["x"], resume.epoch, resume.step)
        return given

    def for_evaluate(self, arguments: dict) -> dict:
        """`evaluate`'s arguments as Keras reads them."""
        given = self._read_py_datasets(self._rows_of_process(arguments))
        self._check_local_batches(given)
        self._build(given.get("x"), "test_step")
        return self._on_devices(given)

    def _rows_of_process(self, arguments: dict, fit: bool = False, skipping: bool = False) -> dict:
        """Arrays replaced by datasets of this process's rows of each global batch when the job
        has several processes (`_core.feed.feeding.arrays`), or datasets of the whole batches when
        they are to be prefetched to the replicas or resumed inside an epoch (`skipping`)."""
        prefetched = self._prefetch and self._reducer.num_replicas > 1
        if self._reducer.job.num_processes == 1 and not (prefetched or skipping):
            return arguments
        given = dict(arguments)
        where = self._process()
        x, y, weights = (given.get(k) for k in ("x", "y", "sample_weight"))
        batch_size = given.get("batch_size")
        if feeding.is_arrays(x, y, weights):
            split = given.pop("validation_split", 0.0)
            if split and given.get("validation_data") is None:
                (x, y, weights), given["validation_data"] = keras_hooks.validation_split(
                    (x, y, weights), split
                )
            rows = int(tf.nest.flatten(x)[0].shape[0])
            steps = given.get("steps_per_epoch", given.get("steps"))
            batch_size = batch_size or (-(-rows // steps) if steps else 32)
            given["x"] = feeding.arrays(
                x,
                y,
                weights,
                batch_size=batch_size,
                shuffle=given.pop("shuffle", fit),  # fit shuffles by default
                class_weight=given.pop("class_weight", None),
                **where,
            )
            given.update(y=None, sample_weight=None, batch_size=None)
            if fit:  # the batches are drawn shuffled; the dataset itself is not shuffled again
                given["shuffle"] = False
        validation = given.get("validation_data")
        if isinstance(validation, tuple) and feeding.is_arrays(*validation):
            vx, vy, vweights = keras.utils.unpack_x_y_sample_weight(validation)
            given["validation_data"] = feeding.arrays(
                vx,
                vy,
                vweights,
                batch_size=given.pop("validation_batch_size", None) or batch_size,
                **where,
            )
        return given

    def _read_py_datasets(self, arguments: dict, fit: bool = False, skip: int = 0) -> dict:
        """Each `PyDataset` of known length replaced by its batches as Keras draws them
        (`_core.feed.py_datasets`); the first pass of `fit`'s skips `skip` batches."""
        given = dict(arguments)
        where = self._process()
        if fit:
            self.batches = None
        if py_datasets.readable(given.get("x"), given.get("steps_per_epoch" if fit else "steps")):
            batches = py_datasets.Batches(
                given["x"],
                shuffle=given.pop("shuffle", True) if fit else False,
                class_weight=given.pop("class_weight", None),
                **where,
            )
            batches.resume(skip)
            given["x"] = self._read(batches, "train_step" if fit else "test_step")
            if fit:
                self.batches = batches
        validation = given.get("validation_data")
        if fit and py_datasets.readable(validation, given.get("validation_steps")):
            batches = py_datasets.Batches(validation, validation=True, **where)
            given["validation_data"] = self._read(batches, "test_step")
        return given

    def _process(self) -> dict[str, int]:
        """This process among the job's: the `index` and `count` of the per-process readers."""
        job = self._reducer.job
        return {"index": job.process_index, "count": job.num_processes}

    def _read(self, batches: py_datasets.Batches, step: str):
        """What Keras takes for `batches` (with their count of steps), the model built first
        for `step` (`train_step`, `test_step`)."""
        dataset = batches.dataset()
        self._build(dataset, step)
        return keras_hooks.distributed_input(dataset, batches.num_batches)

    def _on_devices(self, arguments: dict) -> dict:
        """Datasets replaced by their batches prefetched to the replicas' devices
        (`_core.feed.feeding.on_devices`) once the model is built from their spec."""
        if not (self._prefetch and self._built()):
            return arguments
        given = dict(arguments)
        for name in ("x", "validation_data"):
            if isinstance(given.get(name), tf.data.Dataset):
                given[name] = feeding.on_devices(given[name], self._reducer)
        return given

    def _check_local_batches(self, arguments: dict) -> None:
        """Every process must yield as many batches of its own (`kmirror.data.local_batches`):
        one with more would wait for the others at its extra steps."""
        if arguments.get("steps_per_epoch") or arguments.get("steps"):
            return
        validation = arguments.get("validation_data")
        for name, data in (("x", arguments.get("x")), ("validation_data", validation)):
            count = sharding.local_batch_count(data)
            # A dataset's count never changes: fit's evaluate of every epoch needs no new check.
            if count is None or data in self._counted:
                continue
            counts = self._reducer.job.gather_counts(count)
            if len(set(counts)) > 1:
                raise ValueError(
                    f"kmirror.data.local_batches: the processes' datasets ({name}) yield "
                    f"{', '.join(map(str, counts))} batches (in process order); every process "
                    "must yield as many. Batch with drop_remainder=True after sharding evenly, "
                    "or pass steps_per_epoch (steps for evaluate)."
                )
            self._counted.add(data)
