"""The variables made in a reducer's scope (`Reducer.scope`): how they are updated, and which
they are."""

from __future__ import annotations

import contextlib
import weakref

import tensorflow as tf

__all__ = ["creating", "made_in_scope"]


def creating() -> contextlib.AbstractContextManager:
    """Variables created in this scope (metrics', which Keras makes synchronised on read, too) are
    updated per replica: an assignment in a replica changes that replica's copy (every replica
    applies the same summed gradient, updates metrics with the same values: copies stay equal).
    Each plain variable made here is remembered (`made_in_scope`)."""

    def creator(next_creator, **kwargs):
        kwargs["aggregation"] = tf.VariableAggregation.NONE
        if kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ:
            kwargs["synchronization"] = tf.VariableSynchronization.AUTO
        variable = next_creator(**kwargs)
        if not isinstance(variable, tf.distribute.DistributedValues):
            handle = getattr(variable, "handle", None)
            if handle is not None:
                _made[id(handle)] = variable
        return variable

    return tf.variable_creator_scope(creator)


#: The plain variables made in a reducer's scope (a strategy whose variables are not distributed:
#: a Horovod rank's `OneDeviceStrategy`), by their resource handle's id.
_made = weakref.WeakValueDictionary()


def made_in_scope(handle) -> bool:
    """Whether `handle` is the resource of a plain variable made in a reducer's scope: on a
    strategy whose variables are not distributed, what marks a variable kmirror mirrors."""
    variable = _made.get(id(handle))
    return variable is not None and variable.handle is handle
