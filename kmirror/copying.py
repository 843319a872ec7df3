"""Copies of a Keras model's objects, with every variable created anew where the copy is made.

`wrap` puts a model on the replicas by copying it inside the reducer's scope: the copy's layers,
sub-models, optimizers, metrics and seed generators are new objects of the user's own classes,
with the same attributes, and each variable is a new variable (mirrored on every replica, since it
is created in the scope) holding the original's value. `unwrap` makes the plain model the same way
outside the scope. Nothing is serialised, so any model that runs on one device can be copied:
custom layers and models with or without `get_config`, Lambda layers, nested models, models with
their own `train_step`.

What is copied: Keras objects (instances of classes defined in Keras, or of user subclasses of
them), the lists, tuples, dicts and sets holding them, and variables. Everything else (functions,
numpy arrays, modules, plain Python objects of the user's) is shared with the original.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import keras
import tensorflow as tf

from kmirror import keras_hooks

__all__ = ["copy_model"]

_ATOMIC = (type(None), bool, int, float, complex, str, bytes, type, types.ModuleType)


def copy_model(model, skip: tuple = ()) -> Any:
    """A copy of `model` whose variables are created in the current scope.

    Args:
        model: a Keras model (or any Keras object).
        skip: objects the copy leaves out (their attributes become None in the copy), e.g. a
            compiled state that will be made anew.
    """
    memo: dict[int, Any] = {id(obj): None for obj in skip if obj is not None}
    copier = _Copier(memo)
    copied = copier.copy(model)
    for obj in copier.made:
        keras_hooks.refresh_copy(obj)
    return copied


def _is_keras(obj) -> bool:
    return any(cls.__module__.split(".")[0] == "keras" for cls in type(obj).__mro__)


class _Copier:
    def __init__(self, memo: dict[int, Any]) -> None:
        self.memo = memo
        self.keep_alive: list = []  # objects whose ids are in memo must outlive the copy
        self.made: list = []  # the Keras objects made, in the order they were made

    def copy(self, obj):
        if isinstance(obj, _ATOMIC):
            return obj
        key = id(obj)
        if key in self.memo:
            return self.memo[key]
        self.keep_alive.append(obj)
        if isinstance(obj, tf.Variable):
            return self._variable(obj)
        if isinstance(obj, types.MethodType):
            new = types.MethodType(obj.__func__, self.copy(obj.__self__))
            self.memo[key] = new
            return new
        if _is_keras(obj) and hasattr(obj, "__dict__"):
            return self._object(obj)
        if isinstance(obj, list | dict | set | tuple | frozenset):
            return self._container(obj)
        return obj  # shared: not a Keras object

    def _variable(self, variable: tf.Variable) -> tf.Variable:
        new = tf.Variable(
            variable.read_value(),
            trainable=variable.trainable,
            name=variable.name.split(":")[0],
            dtype=variable.dtype,
            aggregation=variable.aggregation,
            synchronization=variable.synchronization,
        )
        self.memo[id(variable)] = new
        return new

    def _container(self, obj):
        """A list, dict, set or tuple (or a subclass: defaultdict, named tuples...) of copies."""
        if isinstance(obj, tuple | frozenset):  # no cycle can pass through an immutable one
            items = [self.copy(item) for item in obj]
            kind = type(obj)
            new = kind(*items) if hasattr(kind, "_fields") else kind(items)
            self.memo[id(obj)] = new
            return new
        new = copy.copy(obj)  # same type (and default factory), filled with copies below
        self.memo[id(obj)] = new
        if isinstance(obj, list):
            items = [self.copy(item) for item in obj]
            new.clear()
            new.extend(items)
        elif isinstance(obj, dict):
            new.clear()
            new.update((self.copy(k), self.copy(v)) for k, v in obj.items())
        else:
            new.clear()
            new.update(self.copy(item) for item in obj)
        return new

    def _object(self, obj):
        """A Keras object: a new instance of its class with copies of its attributes (and of its
        items, for Keras' tracked lists, dicts and sets)."""
        kind = type(obj)
        if isinstance(obj, tuple):  # named tuples (e.g. a Keras tensor's history)
            items = [self.copy(item) for item in obj]
            new = kind(*items) if hasattr(kind, "_fields") else tuple.__new__(kind, items)
            self.memo[id(obj)] = new
            return new
        if isinstance(obj, keras.layers.Layer):
            new = kind.__new__(kind)  # Keras makes the layer's own build wrapper here
        else:
            base = next(b for b in (list, dict, set, object) if isinstance(obj, b))
            new = base.__new__(kind)
        made = {k for k, v in vars(new).items() if isinstance(v, types.FunctionType)}
        self.memo[id(obj)] = new
        self.made.append(new)
        if isinstance(obj, list):
            list.extend(new, [self.copy(item) for item in obj])
        elif isinstance(obj, dict):
            dict.update(new, {self.copy(k): self.copy(v) for k, v in obj.items()})
        elif isinstance(obj, set):
            set.update(new, {self.copy(item) for item in obj})
        # Functions made for the new object (closures over it) are kept; the original's would
        # act on the original.
        state = {name: self.copy(value) for name, value in vars(obj).items() if name not in made}
        vars(new).update(state)
        return new
