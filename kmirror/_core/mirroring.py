"""The user's model trained where it is: its variables mirrored on the replicas in place, and back.

`wrap` gives each variable of the user's model, of its optimizers and of its metrics new storage
with one copy per replica (`_core.keras_hooks.store`, in the reducer's scope, from the current
value), and drops the single-device storage, so the weights are held once per replica. The Keras
variable objects stay: every layer, optimizer and metric object, and every reference the user
holds to them, is the one that trains. Nothing is copied but values, so any model that trains on
one device can be wrapped, whatever its depth or its layers' code, in time proportional to its
variables. `unmirror` (at `unwrap`) gives each variable single-device storage again, with the
trained value.

Variables made later (a model built at its first batch, an optimizer built at its first update)
are made in the scope (`Mirror.scope`) and so are mirrored from the start, as are the Keras
variables a layer holds untracked (a stateful RNN's states) from `wrap`.

A raw `tf.Variable` the model holds (a counter, gradient accumulators a model's own step writes)
is no Keras variable, so it has no storage to replace: while the model is wrapped, the attribute,
list item or dict value that holds it holds a mirrored `tf.Variable` with its value instead, and
`unmirror` puts the user's variable back with the trained value. Every replica then writes its
own copy, as it does a Keras variable's.

Example: `mirror = Mirror(reducer); mirror.mirror(model)` (one copy per replica), then
`mirror.unmirror(model)` (single-device again).
"""

from __future__ import annotations

import contextlib
import weakref

import keras
import tensorflow as tf

from kmirror._core import holding, keras_hooks, replicas, tf_hooks
from kmirror.reducers.base import Reducer

__all__ = ["Mirror", "is_wrapped", "optimizers", "state"]

_mirrored_models = weakref.WeakKeyDictionary()  # a wrapped model's user model -> its Mirror


class Mirror:
    """One user model's state, mirrored on one reducer's replicas."""

    def __init__(self, reducer: Reducer) -> None:
        self._reducer = reducer
        self._optimizers = weakref.WeakSet()
        #: The user's raw tf.Variables' mirrored stand-ins (`_mirror_raw`): id -> (the user's,
        #: its stand-in); and (holder, key, the user's) for each place a stand-in was put.
        self._stand_ins: dict[int, tuple] = {}
        self._raw: list[tuple] = []
        #: The Keras variables a traced step writes that no walk of the model found
        #: (`adopt_written`), mirrored as the model's own.
        self._written: list = []
        tf_hooks.read_as_numbers()  # a mirrored variable reads as a number, as on one device
        replicas.register(reducer.strategy)

    def scope(self) -> contextlib.AbstractContextManager:
        """Variables made in this scope are mirrored on every replica."""
        return self._reducer.scope()

    def adopt(self, model: keras.Model) -> None:
        """Mirrors `model`'s state in place: the first wrap of `model`. On failure, `model` is as
        it was."""
        _mirrored_models[model] = self
        try:
            self.mirror(model)
        except BaseException:
            self.unmirror(model)
            raise

    def mirror(self, model: keras.Model) -> int:
        """Mirrors every variable of `model`'s state that is not mirrored yet (made since, or
        given by the user); returns how many were."""
        for optimizer in optimizers(model):
            self.train(optimizer)
        strategy = self._reducer.strategy
        pending = []
        for variable in state(model):
            stored = keras_hooks.storage(variable)
            owner = None if stored is None else tf_hooks.strategy_of(stored)
            if stored is None or owner is strategy:
                continue
            if owner is not None:
                raise ValueError(
                    f"the variable {variable.path} is already distributed: it was created in a "
                    "tf.distribute strategy's scope, or it belongs to a model kmirror already "
                    "wraps. Build the model outside any strategy scope (kmirror.wrap replicates "
                    "it), and wrap each layer in one model at a time."
                )
            pending.append(variable)
        with self.scope():
            for variable in pending:
                keras_hooks.store(variable, keras_hooks.storage(variable).read_value())
        if pending:
            for optimizer in optimizers(model):
                keras_hooks.reindex(optimizer)
        return len(pending) + self._mirror_raw(model)

    def _mirror_raw(self, model: keras.Model) -> int:
        """Puts a mirrored `tf.Variable` wherever `model` holds a raw one of its own (Keras may
        hold it in a dict of its own too): one stand-in per variable, in every place."""
        strategy, made = self._reducer.strategy, 0
        for holder, key, variable in holding.held(model):
            owner = tf_hooks.strategy_of(variable)
            if owner is strategy or isinstance(variable, keras.Variable):
                continue
            if owner is not None or isinstance(holder, tuple):
                where = "in a tuple" if owner is None else "created in a tf.distribute scope"
                raise ValueError(
                    f"the tf.Variable {variable.name} that the model holds ({key!r}) is {where}; "
                    "kmirror cannot give every replica a copy of it. Make it a keras.Variable "
                    "(layer.add_weight or keras.Variable), or hold it in a list or an attribute "
                    "of a layer, created outside any strategy scope."
                )
            made += self._put_stand_in(holder, key, variable)
        return made

    def _put_stand_in(self, holder, key, variable: tf.Variable) -> bool:
        """Puts the mirrored stand-in of the raw `variable` (made once) at `holder[key]`, to be
        given back at `unmirror`; whether it was made now."""
        made = id(variable) not in self._stand_ins
        if made:
            with self.scope():
                self._stand_ins[id(variable)] = (variable, holding.stand_in(variable))
        holding.put(holder, key, self._stand_ins[id(variable)][1])
        self._raw.append((holder, key, variable))
        return made

    def adopt_written(self, handles: list) -> list:
        """Mirrors the variables behind `handles`, which a traced step writes and no walk found
        (`_core.reached_state`): a Keras variable gets mirrored storage, a raw `tf.Variable` a
        mirrored stand-in wherever it is held; each is single-device again at `unmirror`.
        Returns what the step writes now, in order: the Keras variables and the stand-ins."""
        adopted = []
        for handle in handles:
            variable = holding.variable_of(handle)
            owner = None if variable is None else holding.keras_owner(variable)
            if owner is not None:
                with self.scope():
                    keras_hooks.store(owner, variable.read_value())
                self._written.append(owner)
            else:
                for holder, key in holding.replaceable(variable):
                    self._put_stand_in(holder, key, variable)
            adopted.append(owner if owner is not None else self._stand_ins[id(variable)][1])
        for optimizer in list(self._optimizers):
            keras_hooks.reindex(optimizer)
        return adopted

    def train(self, optimizer) -> None:
        """`optimizer` applies each replica's summed gradient on the replica, and builds its
        variables mirrored (`_core.keras_hooks.train_locally`)."""
        keras_hooks.train_locally(optimizer)
        self._optimizers.add(optimizer)

    def build_optimizer(self, optimizer, variables: list) -> None:
        """Builds `optimizer` for `variables`, its variables mirrored (once).

        Keras' own optimizers are built in the replicas' scope, as Keras builds them under a
        strategy. An optimizer of the user's is built as one device builds it: in its first
        update's trace (where Keras builds an optimizer when no strategy is set), with what it
        makes there (another optimizer it holds, built there too), traced and never run; what
        it made is mirrored afterwards (`mirror`), as the model's own state is."""
        if optimizer is None or optimizer.built:
            return
        self.train(optimizer)
        if not type(optimizer).__module__.startswith("keras."):
            specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
            with keras_hooks.building():
                apply = tf.autograph.experimental.do_not_convert(
                    lambda grads: optimizer.apply(grads, variables)  # as in Keras' step
                )
                tf.function(apply, autograph=False).get_concrete_function(specs)
        if not optimizer.built:
            with self.scope():
                optimizer.build(variables)

    def unmirror(self, model: keras.Model) -> None:
        """Gives every mirrored variable of `model`'s state single-device storage again, holding
        its value, and leaves Keras' own behaviour to its optimizers."""
        strategy = self._reducer.strategy
        for variable in [*state(model), *self._written]:
            stored = keras_hooks.storage(variable)
            if stored is not None and tf_hooks.strategy_of(stored) is strategy:
                keras_hooks.store(variable, stored.read_value())
        self._written.clear()
        for variable, mirrored in self._stand_ins.values():
            variable.assign(mirrored.read_value())
        for holder, key, variable in self._raw:
            holding.put(holder, key, variable)
        self._stand_ins.clear()
        self._raw.clear()
        for optimizer in list(self._optimizers):
            keras_hooks.release(optimizer)
            keras_hooks.reindex(optimizer)
        keras_hooks.forget_traces(model)
        if _mirrored_models.get(model) is self:
            del _mirrored_models[model]


def is_wrapped(model: keras.Model) -> bool:
    """Whether `model`'s state is mirrored by a wrapped model now."""
    return _mirrored_models.get(model) is not None


def optimizers(model: keras.Model) -> list:
    """The model's optimizers: its compiled one and those it holds as attributes (a GAN's), or in
    lists, tuples and dicts it holds (a CycleGAN's `self.optimizers = [...]`)."""
    found = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
    seen = set()

    def visit(value) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, keras.optimizers.Optimizer):
            if value not in found:
                found.append(value)
            for item in vars(value).values():  # an optimizer it holds (a Lookahead's inner)
                visit(item)
        elif isinstance(value, list | tuple | set):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    for value in vars(model).values():
        visit(value)
    return found


def state(model: keras.Model) -> list:
    """Every variable training `model` reads or writes: its weights and random generators' states,
    its optimizers' and its metrics' variables, the Keras variables a layer holds untracked (a
    raw `tf.Variable` an optimizer tracks is not one: a step writing it mirrors it,
    `Mirror.adopt_written`)."""
    found, seen = [], set()
    groups = [model.variables, *(o.variables for o in optimizers(model))]
    groups += [metric.variables for metric in model.metrics]
    groups.append([v for _, _, v in holding.held(model)])
    for group in groups:
        for variable in group:
            if isinstance(variable, keras.Variable) and id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
    return found
