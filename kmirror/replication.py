"""Moving a user's model onto the replicas, and back: its weights, compile state and optimizer
state.

`replicate` copies the model inside the reducer's scope, so that its variables are mirrored on
every replica (nothing is serialised: `kmirror.copying`). `plain_model` makes the single-device
model `unwrap()` returns, with the weights, compile settings and optimizer state of the replicas,
and `bring_up_to_date` refreshes such a copy in place. Nothing here runs a step.

Example:

```python
replica = replication.replicate(model, reducer, keep_compiled=False)
plain = replication.plain_model(replica, compile_arguments, optimizer)
```
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kmirror import copying, keras_hooks, own_step
from kmirror.reducers.base import Reducer

__all__ = [
    "replicate",
    "copy_without_compile",
    "plain_model",
    "bring_up_to_date",
    "new_optimizer",
    "build_optimizer",
    "copy_optimizer_state",
    "fresh_metrics",
    "layers",
    "has_batch_norm",
]


def replicate(model: keras.Model, reducer: Reducer, keep_compiled: bool) -> keras.Model:
    """The model copied inside the reducer's scope: its variables mirrored on every replica;
    with `keep_compiled`, its optimizers, losses and metrics too (a model with its own steps)."""
    with reducer.scope():
        if keep_compiled:
            return copying.copy_model(model, skip=keras_hooks.step_functions(model))
        return copy_without_compile(model)


def copy_without_compile(model: keras.Model) -> keras.Model:
    """`model` copied with its weights, without what `compile` made (kmirror compiles the copy)
    nor Keras' traced step functions (they belong to the original)."""
    return copying.copy_model(model, skip=keras_hooks.compiled_state(model))


def plain_model(replica: keras.Model, compiled: dict | None, optimizer, own_steps: bool):
    """A plain single-device copy of `replica` with its weights, compiled with the user's
    `compiled` arguments and carrying `optimizer`'s state (a model with its own steps: its own
    compiled state and optimizers, copied)."""
    if own_steps:
        return copying.copy_model(replica, skip=keras_hooks.step_functions(replica))
    plain = copy_without_compile(replica)
    if compiled is not None:
        plain.compile(
            optimizer=new_optimizer(optimizer),
            **{
                **compiled,
                "metrics": fresh_metrics(compiled["metrics"]),
                "weighted_metrics": fresh_metrics(compiled["weighted_metrics"]),
            },
        )
        if plain.built:
            build_optimizer(plain)
            copy_optimizer_state(optimizer, plain.optimizer)
    return plain


def bring_up_to_date(replica: keras.Model, plain: keras.Model) -> None:
    """Copies `replica`'s variables and optimizer states into `plain_model`'s copy of it."""
    _copy_variables(replica, plain)
    for ours, theirs in zip(own_step.optimizers(replica), own_step.optimizers(plain)):
        if theirs.built:
            copy_optimizer_state(ours, theirs)


def _copy_variables(source: keras.Model, target: keras.Model) -> None:
    """Every variable of `source` into `target`: weights, and the state of random layers' seed
    generators (so that dropout draws the masks it would have drawn)."""
    target.set_weights(source.get_weights())
    given, rest = _non_weights(source), _non_weights(target)
    if len(rest) == len(given):
        for src, dst in zip(given, rest):
            if tuple(src.shape) == tuple(dst.shape):
                dst.assign(src.value)


def _non_weights(model: keras.Model) -> list:
    """The variables of `model` that `get_weights` leaves out (seed generator states)."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def new_optimizer(optimizer):
    """A new optimizer with `optimizer`'s config, its variables created in the current scope."""
    if optimizer is None or isinstance(optimizer, str | dict):
        return keras.optimizers.get(optimizer) if optimizer is not None else None
    return type(optimizer).from_config(optimizer.get_config())


def build_optimizer(model: keras.Model) -> None:
    """Builds `model`'s optimizer for its trainable variables (once)."""
    optimizer = model.optimizer
    if optimizer is None or optimizer.built:
        return
    optimizer.build(model.trainable_variables)


def copy_optimizer_state(source, target) -> None:
    """`source` optimizer's variables (step count, moments) into `target`'s."""
    if len(source.variables) != len(target.variables):
        raise ValueError(
            f"cannot carry the optimizer state over: {len(source.variables)} variables in the "
            f"original optimizer, {len(target.variables)} in the new one."
        )
    for src, dst in zip(source.variables, target.variables):
        dst.assign(src.value)


def fresh_metrics(metrics):
    """Copies of the user's metric objects (with their names), so that the wrapped model never
    shares their state."""
    if metrics is None:
        return None

    def copy(metric):
        if isinstance(metric, keras.metrics.Metric):
            return type(metric).from_config(metric.get_config())
        return metric

    return tf.nest.map_structure(copy, metrics)


def layers(layer) -> list:
    """Every layer inside `layer`, nested models included."""
    found = []
    for inner in getattr(layer, "layers", []):
        found += [inner, *layers(inner)]
    return found


def has_batch_norm(model: keras.Model) -> bool:
    return any(isinstance(layer, keras.layers.BatchNormalization) for layer in layers(model))
