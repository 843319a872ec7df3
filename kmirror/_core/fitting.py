"""One `fit` of a wrapped model: what it settles before Keras' loop starts, and how it ends.

Before the loop, the job's processes seed their random generators alike (once per job: they then
shuffle alike), agree on where a relaunch resumes (`_core.feed.resume`), and turn the user's input
into what this process reads (`_core.feed.inputs`); a watch on the epochs (`errors.NonFiniteWatch`)
joins the callbacks. A resumed epoch is shorter than the others: its batches are drawn in Python,
a step per call (`draws_in_python`). A non-finite global loss ends the fit with
`kmirror.errors.NonFiniteLoss`, at the same step in every process.

Example:

```python
call = Fit(model, reducer, inputs, args, kwargs)
with call.running():
    keras.Model.fit(model, **call.arguments)
```
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import keras
import tensorflow as tf

from kmirror import errors
from kmirror._core.callbacks import keras_own, preemption
from kmirror._core.feed import inputs as inputs_lib
from kmirror._core.feed import resume as resume_lib
from kmirror.reducers.base import Reducer

__all__ = ["Fit"]


class Fit:
    """One call of a wrapped model's `fit`: its arguments as Keras takes them, and its state."""

    def __init__(
        self, model: keras.Model, reducer: Reducer, inputs: inputs_lib.Inputs, args, kwargs
    ) -> None:
        job = self._job = reducer.job
        arguments = inputs_lib.arguments_of(keras.Model.fit, model, args, kwargs, job.is_chief)
        #: The validation data as given, checked against the model before the first step.
        self._validation = arguments.get("validation_data")
        self._training = _batch(arguments)
        arguments["callbacks"] = keras_own.stand_ins(arguments.get("callbacks"))
        keras_own.check(arguments.get("callbacks"))  # before anything is read or written
        #: SIGTERM backs up and stops every process at one step (with a BackupAndRestore).
        self._preemption = preemption.watch(arguments.get("callbacks"), job)
        job.seed_once()
        resume = resume_lib.agree(reducer, arguments)
        #: Batches drawn in Python, a step per call: the resumed epoch is shorter than the
        #: others, and Keras' step function would find its end inside the graph, after advancing
        #: the optimizer's step counter.
        self.draws_in_python = resume is not None and resume.step > 0
        self.arguments = inputs.for_fit(arguments, resume)
        #: The PyDataset this fit reads, drawn as Keras draws it (None for other input).
        self.batches = inputs.batches
        self._watch = errors.NonFiniteWatch()
        given = list(self.arguments.get("callbacks") or [])
        self.arguments["callbacks"] = [
            *given,
            self._watch,
            *[self._preemption] * bool(self._preemption),
        ]

    def check_validation(self, check: Callable) -> None:
        """Refuses validation data that the model cannot take (`check(batch)` raises on it, and
        not on the training data's batch: a model that cannot be checked symbolically is not
        refused), once, before the first step: one device would train an epoch before it failed."""
        validation = inputs_lib.batch_spec(self._validation)
        self._validation = None  # checked once: later calls (each epoch's validation) skip
        if validation is None:
            return
        training = inputs_lib.batch_spec(self._training)
        if training is None:
            return
        try:
            check(validation)
        except Exception as error:
            try:
                check(training)
            except Exception:
                return
            raise ValueError(
                f"validation_data does not fit the model: {error}\nNothing was trained. Pass "
                "validation data shaped as the training data (the model's inputs and targets)."
            ) from error

    @contextlib.contextmanager
    def running(self):
        """The context Keras' loop runs in: Keras' own file-writing callbacks write once in the
        job (`_core.callbacks.keras_own`); a non-finite loss becomes `NonFiniteLoss`."""
        callbacks = self.arguments["callbacks"]
        try:
            catching = self._preemption.catching() if self._preemption else contextlib.nullcontext()
            with warnings.catch_warnings(), errors.state_checked(), catching:
                if self.draws_in_python:
                    warnings.filterwarnings("ignore", message="Your input ran out of data")
                with keras_own.written_once(callbacks, self._job) as chosen:
                    self.arguments["callbacks"] = chosen
                    yield
        except tf.errors.InvalidArgumentError as error:
            if errors.NON_FINITE not in str(error):
                raise
            raise errors.NonFiniteLoss(self._watch.describe_non_finite(error)) from None


def _batch(arguments: dict):
    """The training data as given: the dataset, or the tuple of arrays (x, y, sample_weight)."""
    x = arguments.get("x")
    if isinstance(x, tf.data.Dataset):
        return x
    return (x, arguments.get("y"), arguments.get("sample_weight"))
