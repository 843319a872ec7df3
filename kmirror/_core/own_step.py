"""A model's own `train_step`, `test_step` or `predict_step`, run data-parallel.

Every replica runs the model's own step, unchanged, on the whole global batch, and computes what
one device computes: the user's `GradientTape`, losses, logs, metric updates and draws outside its
models' layers are one device's values on every replica. Only the layer calls the step makes
compute on the replica's rows (`_core.global_batch`): each returns the whole batch's output, and
gives each weight the gradient of its replica's rows. So:

- **The gradients** the step takes of its weights (`tape.gradient`) are one device's: summed
  over the replicas where the step asks for them (`_core.own_gradients`, through the chosen
  reducer), whatever the step computes from the layers' outputs (a loss that couples the rows, a
  vector of per-row losses) and whatever it then does with them (a norm, clipping, a
  perturbation, accumulation); `apply_gradients` of every optimizer applies what it is given on
  each replica, as one device would.
- **Metrics** are updated on every replica with one device's arguments, and the step's logs are
  one device's values.
- **State** the layers write while they compute on a replica's rows is combined over the
  replicas (`_core.layer_state`); what the step writes outside them is written alike.

What a step must do for this to hold is in docs/concepts.md ("A model's own train_step").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from kmirror._core import draws, keras_hooks, mirroring, own_gradients
from kmirror._core.feed import placement
from kmirror._core.layer_state import LayerState, after
from kmirror.reducers.base import Reducer

__all__ = [
    "overridden",
    "build_as_one_device",
    "train",
    "evaluate",
    "predict",
]

_STEPS = ("train_step", "test_step", "predict_step")


def overridden(model: keras.Model) -> set[str]:
    """Which of the Keras steps `model`'s class overrides."""
    return {name for name in _STEPS if getattr(type(model), name) is not getattr(keras.Model, name)}


def _hooked(model: keras.Model) -> contextlib.AbstractContextManager:
    """While the model's own step runs on the replicas: its optimizers' `apply` is replaced, on
    the objects, by one that builds an optimizer not built yet as one device would (and does what
    the class does); the objects are as they were afterwards."""
    replaced = [(o, "apply", _building_apply) for o in mirroring.optimizers(model)]
    return keras_hooks.methods_replaced(replaced)


def _building_apply(optimizer, grads, trainable_variables=None):
    """`optimizer.apply` of the class (the user's override too): the gradients it is given are
    one device's already (`_core.own_gradients`)."""
    apply = type(optimizer).apply
    own = keras_hooks.current_step()
    if own is not None and not optimizer.built:
        if trainable_variables is not None:  # read once: it may be an iterator
            trainable_variables = list(trainable_variables)

        # Keras builds an optimizer on its first update. Its variables are made outside the
        # step's graph, mirrored like the model's: once, in cross-replica context.
        def build(_):
            with tf.init_scope(), own.variable_scope():
                optimizer.build(trainable_variables)

        tf.distribute.get_replica_context().merge_call(build)
    return apply(optimizer, grads, trainable_variables)


def build_as_one_device(model: keras.Model, step: str, data) -> None:
    """Builds what the model's `step` (`train_step`, `test_step`, `predict_step`) builds when it
    first runs, as on one device.

    Keras builds a model with its own steps in its first step, not from a symbolic batch: its
    sub-models made without an `Input`, a model with no `call()`, its optimizers at their first
    update, its compiled loss if the step uses it. So does kmirror: the step is traced once on one
    device, before any replica runs it, and never run; the variables made then are mirrored
    afterwards (`_core.mirroring`), with the values one device's would have. It is traced as
    Keras traces a step, without autograph.
    """
    method = getattr(model, step)

    def traced(data):
        with tf.variable_creator_scope(_made_outside):
            return method(data)

    # Autograph off in the step and in what it calls, as Keras traces one (`do_not_convert`).
    traced = tf.autograph.experimental.do_not_convert(traced)
    with keras_hooks.building():
        tf.function(traced, autograph=False).get_concrete_function(data)


def _made_outside(next_creator, **kwargs):
    """A variable the traced step makes, made outside its graph at once, as `tf.function` lifts it
    (from the same initial value): `tf.function` then keeps its first trace, where it would trace
    the step a second time, without making variables, to run. An initial value computed in the
    step's graph is left to `tf.function`, which refuses it as on one device."""
    graph = getattr(kwargs.get("initial_value"), "graph", None)
    if graph is not None and graph.building_function:
        return next_creator(**kwargs)
    with tf.init_scope():
        return next_creator(**{**kwargs, "experimental_enable_variable_lifting": False})


def _run(
    method: Callable,
    model: keras.Model,
    reducer: Reducer,
    data,
    global_statistics: bool,
    place=None,
    training: bool = True,
):
    """`method(batch)` on every replica, each with the whole global batch; the per-replica
    results. `data` is the global batch, or this process's rows of it at `place`
    (`placement.split`), which the replicas join. A layer's reduction over the rows of its
    call is the whole batch's where `global_statistics` is set (`evaluate` and `predict` set
    it); the moving statistics a `training` step writes come from it there too."""
    shards = None if place is None else placement.split(reducer, data, place)
    state = LayerState(model, reducer, global_statistics and training)
    steps = []  # each replica's

    def local(shard):
        batch = data if shard is None else _joined(reducer, shard[0])
        own = keras_hooks.OwnStep(
            index=reducer.replica_index(),
            replicas=reducer.num_replicas,
            all_gather=reducer.all_gather,
            all_sum=reducer.all_sum,
            sums_only=reducer.replica_sums,
            reduce_gradients=reducer.reduce_in_replica,
            variable_scope=reducer.scope,
            recording=state.recording,
            global_statistics=global_statistics,
            provenance=keras_hooks.Provenance(batch),
        )
        steps.append(own)
        before = state.before()
        with keras_hooks.splitting(own):
            result = method(batch)
        return after(state.combine(before), result)

    own_gradients.install()
    try:
        with _hooked(model), draws.watched():
            return reducer.run(local, args=(shards,))
    finally:
        keras_hooks.settle(steps)


def _joined(reducer: Reducer, rows):
    """Every replica's rows of each tensor of a batch, joined in row order."""
    return tf.nest.map_structure(lambda t: None if t is None else reducer.all_gather(t), rows)


def _first(reducer: Reducer, per_replica) -> Any:
    return tf.nest.map_structure(lambda v: reducer.local_values(v)[0], per_replica)


def train(model: keras.Model, reducer: Reducer, data, global_statistics: bool = True, place=None):
    """The model's own train_step on every replica; its logs (global values)."""
    return _first(reducer, _run(model.train_step, model, reducer, data, global_statistics, place))


def evaluate(model: keras.Model, reducer: Reducer, data, place=None):
    """The model's own test_step on every replica; its logs (global values)."""
    return _first(reducer, _run(model.test_step, model, reducer, data, True, place, False))


def predict(model: keras.Model, reducer: Reducer, data, place=None):
    """The model's own predict_step on every replica: the whole batch's outputs."""
    return _first(reducer, _run(model.predict_step, model, reducer, data, True, place, False))
