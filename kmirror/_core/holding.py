"""Where the variables a model trains with are held, and how another is put in their place.

`held` walks a model (its layers' attributes, lists, tuples and dicts) for the variables it holds;
`holders`, `variable_of` and `keras_owner` find what holds a variable by the references to it
(Python's garbage collector knows every object referring to another), for a variable a traced step
writes that no walk found. `put` sets a holder's item or attribute, `stand_in` makes a variable
like another in the current scope.
"""

from __future__ import annotations

import gc

import keras
import tensorflow as tf

from kmirror._core import keras_hooks

__all__ = ["held", "put", "stand_in", "variable_of", "keras_owner", "holders", "replaceable"]


def held(model: keras.Model) -> list[tuple]:
    """(holder, key, variable) for each Keras variable or raw `tf.Variable` (not a Keras variable's
    storage) `model` or a layer in it holds, outside optimizers and metrics: as an attribute
    (`holder` the layer, `key` its name), or in a list, tuple or dict (`key` its index or key)."""
    found, seen = [], set()

    def visit(holder, key, value) -> None:
        if isinstance(value, keras.optimizers.Optimizer | keras.metrics.Metric):
            return
        if isinstance(value, keras.Variable | tf.Variable):
            found.append((holder, key, value))
            return
        if id(value) in seen:
            return
        if isinstance(value, keras.layers.Layer):
            seen.add(id(value))
            for name, item in list(vars(value).items()):
                visit(value, name, item)
        elif isinstance(value, list | tuple):
            seen.add(id(value))
            for index, item in enumerate(value):
                visit(value, index, item)
        elif isinstance(value, dict):
            seen.add(id(value))
            for name, item in list(value.items()):
                visit(value, name, item)

    visit(None, None, model)
    return found


def put(holder, key, value) -> None:
    if isinstance(holder, list | dict):
        holder[key] = value
    else:
        setattr(holder, key, value)


def stand_in(variable: tf.Variable) -> tf.Variable:
    """A `tf.Variable` like `variable`, holding its value, made in the current scope."""
    return tf.Variable(
        variable.read_value(),
        trainable=variable.trainable,
        name=variable.name.split(":")[0],
        dtype=variable.dtype,
        shape=variable.shape,
    )


def variable_of(handle) -> tf.Variable | None:
    """The `tf.Variable` whose resource `handle` is (found by the references to it)."""
    for referrer in _objects_referring_to(handle):
        if isinstance(referrer, tf.Variable) and getattr(referrer, "handle", None) is handle:
            return referrer
    return None


def keras_owner(variable: tf.Variable) -> keras.Variable | None:
    """The Keras variable `variable` is the storage of, if any."""
    for referrer in _objects_referring_to(variable):
        if isinstance(referrer, keras.Variable) and keras_hooks.storage(referrer) is variable:
            return referrer
    return None


def holders(variable: tf.Variable) -> list[tuple]:
    """(holder, key) for each list, dict, tuple and object attribute holding `variable`."""
    found = []
    for referrer in gc.get_referrers(variable):
        if isinstance(referrer, list):
            found += [(referrer, i) for i, item in enumerate(referrer) if item is variable]
        elif isinstance(referrer, tuple):
            found.append((referrer, None))
        elif isinstance(referrer, dict):
            owner = _owner_of_dict(referrer)
            keys = [k for k, item in referrer.items() if item is variable]
            found += [(owner if owner is not None else referrer, k) for k in keys]
        elif hasattr(referrer, "__dict__") and not isinstance(referrer, type):
            found += [(referrer, k) for k, item in vars(referrer).items() if item is variable]
    return found


def replaceable(variable: tf.Variable | None) -> list[tuple]:
    """`holders(variable)`, each of which can be given another variable in its place; a ValueError
    naming the variable, what holds it and what to change otherwise."""
    holders_ = [] if variable is None else holders(variable)
    if variable is not None and holders_ and not any(isinstance(h, tuple) for h, _ in holders_):
        return holders_
    name = "a variable" if variable is None else f"the tf.Variable {variable.name!r}"
    where = (
        ", ".join(sorted({type(h).__name__ for h, _ in holders_})) or "nothing kmirror can reach"
    )
    raise ValueError(
        f"kmirror: the step writes {name}, held by {where}, and kmirror cannot give every "
        "replica its own copy of it there (a tuple cannot be changed). Make it a keras.Variable "
        "(layer.add_weight, optimizer.add_variable), or hold it in a list, a dict or an "
        "attribute of an object."
    )


def _objects_referring_to(value) -> list:
    """The objects holding `value`: each one whose attributes' dict holds it stands for it."""
    found = []
    for referrer in gc.get_referrers(value):
        owner = _owner_of_dict(referrer) if isinstance(referrer, dict) else None
        found.append(referrer if owner is None else owner)
    return found


def _owner_of_dict(attributes: dict):
    """The object whose attributes `attributes` is, or None (a dict of its own)."""
    for referrer in gc.get_referrers(attributes):
        if getattr(referrer, "__dict__", None) is attributes:
            return referrer
    return None
