"""Building a wrapped model's parts before its first step: the user's model, its compiled loss,
its optimizers and the logs' metrics.

Keras builds a model inside a strategy's scope from one batch (`fit`, `evaluate` and `predict`
call `Model._maybe_symbolic_build`); a wrapped model builds the user's model in the replicas'
scope from a global batch, so that uneven batches never reach the build, and its new variables
are mirrored from the start. A dataset's element spec builds it without drawing a batch.

Example:

```python
builder = Builder(wrapped, model, reducer, mirror, own_training=lambda: False, built=chief.changed)
builder.build(data_batch=(x[:32], y[:32]))
```
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from kmirror._core import keras_hooks, mirroring, own_step, python_draws
from kmirror._core.feed import rows as rows_lib
from kmirror.reducers.base import Reducer

__all__ = ["Builder", "every_layer"]


class Builder:
    """Builds `model` (the user's), and what `wrapped` (its `MirroredModel`) logs with, once."""

    def __init__(
        self,
        wrapped: keras.Model,
        model: keras.Model,
        reducer: Reducer,
        mirror: mirroring.Mirror,
        own_training: Callable[[], bool],
        built: Callable[[], None],
        fitting: Callable[[], bool] = lambda: False,
    ) -> None:
        self._wrapped, self._model, self._reducer = wrapped, model, reducer
        self._mirror, self._own_training, self._built = mirror, own_training, built
        self._fitting = fitting  # whether the wrapped model's fit is running
        self._traced = set()  # the own steps traced to build the model
        self._traced_with = weakref.WeakSet()  # the optimizers when train_step was traced
        self._traced_twice = set()  # the steps one device would trace twice at their next trace

    def build(self, iterator=None, data_batch=None, step: str | None = None) -> None:
        """Builds what is not built yet, from `data_batch` or the first batch of `iterator`
        (Keras' epoch iterator); then calls `built`. `step`: the step about to run (default:
        `train_step` in `fit`, else `test_step`).

        One device builds these in the step's first trace, and TensorFlow then traces its step a
        second time (a first trace that made variables is not the one that runs): the step is
        noted (`traces_twice`). What the build draws from Python's and NumPy's generators is
        undone, as one device makes no such build."""
        step = step or ("train_step" if self._fitting() else "test_step")
        made = []

        def counting(next_creator, **kwargs):
            made.append(True)
            return next_creator(**kwargs)

        with python_draws.unchanged(), tf.variable_creator_scope(counting):
            built = self._build(iterator, data_batch, step)
        if made:
            self._traced_twice.add(step)
        if built:
            self._mirror.mirror(self._model)
            self._built()

    def traces_twice(self, step: str) -> bool:
        """Whether one device traces `step` twice at its first trace from now (once: the next
        call says no)."""
        twice = step in self._traced_twice
        self._traced_twice.discard(step)
        return twice

    def _build(self, iterator, data_batch, step: str) -> bool:
        model = self._model
        loss = keras_hooks.compiled_loss(model)
        loss_built = loss is None or loss.built
        optimizers = mirroring.optimizers(model)
        optimizers_built = all(o.built for o in optimizers)
        own_training = self._own_training()
        if own_training:
            # Optimizers made since the training step was traced (the model compiled again)
            # are built by tracing it again.
            fresh = step == "train_step" and any(
                not o.built and o not in self._traced_with for o in optimizers
            )
            if {step, "train_step"} & self._traced and not fresh:
                return False  # the step built what it uses; what it never uses stays unbuilt
            done = all(layer.built for layer in every_layer(model)) and optimizers_built
            if done and loss_built:
                return False
            metrics = None
        else:
            done = model.built and loss_built
            metrics = keras_hooks.compiled_metrics(self._wrapped)
            if done and optimizers_built and (metrics is None or metrics.built):
                return False
        if data_batch is None:
            for _, _, batches in iterator:
                data_batch = next(batches)
                break
        data_batch = _as_one_device(*rows_lib.unpack(data_batch))
        for optimizer in mirroring.optimizers(model):
            self._mirror.train(optimizer)  # building may build an optimizer too
        outputs = None  # the specs of the model's outputs for the batch, once computed
        if own_training:
            own_step.build_as_one_device(model, step, data_batch)
            self._traced.add(step)
            if step == "train_step":
                self._traced_with.update(mirroring.optimizers(model))
        elif not done:
            with self._mirror.scope():
                outputs = keras_hooks.symbolic_build(model, _symbolic(data_batch))
        if not own_training and model.compiled:
            self._mirror.build_optimizer(model.optimizer, model.trainable_variables)
        if metrics is not None and not metrics.built:
            # The logs' metrics are updated outside the replicas, from their summed states.
            keras_hooks.build_compiled(self._wrapped, _symbolic(data_batch), outputs)
        return True

    def check_takes(self, data_batch) -> None:
        """Raises what the user's model raises evaluating `data_batch` (tensors or their specs),
        computed symbolically: its outputs and compiled loss, nothing run. A model's own
        `test_step` takes what it takes: it is not checked here."""
        if "test_step" in own_step.overridden(self._model):
            return
        with self._mirror.scope(), python_draws.unchanged():  # one device checks nothing
            keras_hooks.symbolic_evaluation(self._model, _symbolic(data_batch))

    def from_spec(self, x, step: str | None = None) -> None:
        """Builds from a dataset's element spec, drawing no batch from it: a batch drawn before
        training would advance a seeded shuffle, and the epochs would no longer be one device's."""
        if not isinstance(x, tf.data.Dataset):
            return
        spec = _as_one_device(*rows_lib.unpack(x.element_spec))
        leaves = tf.nest.flatten(spec)
        if all(isinstance(s, tf.TensorSpec) and s.shape.rank is not None for s in leaves):
            self.build(data_batch=spec, step=step)


def every_layer(layer) -> list:
    """Every layer inside `layer`, nested models included."""
    found = []
    for inner in getattr(layer, "layers", []):
        found += [inner, *every_layer(inner)]
    return found


def _symbolic(data_batch):
    """A batch for Keras' symbolic build: tensors as they are, a dataset's specs as KerasTensors."""
    return tf.nest.map_structure(
        lambda t: keras.KerasTensor(t.shape, dtype=t.dtype) if isinstance(t, tf.TensorSpec) else t,
        data_batch,
    )


def _as_one_device(data_batch, place):
    """`data_batch` (tensors or specs) as one device builds from it: where it is this process's
    rows of the global batch (`place` not None), specs of the global batch's shape, its rows'
    count where `place` gives it (a stateful RNN's states have as many rows), else unknown."""
    if place is None:
        return data_batch
    rows = int(place[1]) if isinstance(place, tf.Tensor | np.ndarray) else None

    def spec(leaf):
        if not isinstance(leaf, tf.Tensor | tf.TensorSpec | np.ndarray):
            return leaf
        if not tf.TensorShape(leaf.shape).rank:
            return leaf
        return tf.TensorSpec([rows, *leaf.shape[1:]], tf.as_dtype(leaf.dtype))

    return tf.nest.map_structure(spec, data_batch)
