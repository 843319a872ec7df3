"""Whether this thread runs one of kmirror's replicas: `tf.distribute` runs each replica of a
strategy in a thread of its own, in replica context, and kmirror's strategies are those a
wrapped model mirrors its state with (`register`, at `Mirror`)."""

from __future__ import annotations

import weakref

import tensorflow as tf

__all__ = ["register", "in_replica", "distributes_variables"]

_strategies = weakref.WeakSet()


def register(strategy: tf.distribute.Strategy) -> None:
    """`strategy` runs kmirror's replicas."""
    _strategies.add(strategy)


def in_replica() -> bool:
    """Whether this thread runs a replica of one of kmirror's strategies."""
    if tf.distribute.in_cross_replica_context():
        return False
    return tf.distribute.get_strategy() in _strategies


def distributes_variables() -> bool:
    """Whether the current strategy gives each variable made in its scope a copy per replica
    (a distributed variable): not `OneDeviceStrategy` (a Horovod rank's), whose are plain."""
    return not isinstance(tf.distribute.get_strategy(), tf.distribute.OneDeviceStrategy)
