"""The optimizers kmirror trains: every replica applies the summed gradient to its own copy of
the variables, as one device applies it.

Keras' TensorFlow optimizer sums gradients across `tf.distribute` replicas itself, updates through
`merge_call` (which fails inside the conditions of gradient accumulation and EMA), and creates its
variables beside the model's through the strategy it was made under. kmirror's reducer sums the
gradients before any optimizer sees them, so an optimizer kmirror trains (`train_locally`) takes
Keras' backend-agnostic versions of those methods instead, and creates its variables in the scope
it is built in (the reducer's: mirrored like the model's). Nothing is set on the optimizer objects:
the methods of Keras' TensorFlow optimizer choose by membership, and `release` (at `unwrap`) gives
an optimizer back to Keras' own behaviour.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import tensorflow as tf
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.optimizers import base_optimizer
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

from kmirror._core import replicas

__all__ = ["train_locally", "release", "reindex", "accumulation", "building"]

#: What Keras' TensorFlow optimizer routes through tf.distribute, by method name.
_LOCAL_METHODS = (
    "_backend_update_step",
    "_apply_weight_decay",
    "_backend_increment_gradient_accumulators",
    "_overwrite_model_variables_with_average_value",
    "add_variable_from_reference",
)

_local = weakref.WeakSet()  # the optimizers kmirror trains
_install_lock = threading.Lock()
_installed = False
_building = threading.local()  # `depth`: kmirror traces a step on this thread to build it


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Within this block this thread traces a step as one device, to build what it makes
    (never run): every optimizer applies there as those kmirror trains do."""
    _install()
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        yield
    finally:
        _building.depth -= 1


def train_locally(optimizer) -> None:
    """From now on, `optimizer` (and a loss-scale optimizer's inner one) applies as on one device
    on each replica's copy of its variables, and creates variables in the current scope."""
    _install()
    _local.add(optimizer)
    if isinstance(optimizer, LossScaleOptimizer):
        train_locally(optimizer.inner_optimizer)


def release(optimizer) -> None:
    """`optimizer` behaves as Keras' own again."""
    _local.discard(optimizer)
    if isinstance(optimizer, LossScaleOptimizer):
        release(optimizer.inner_optimizer)


def reindex(optimizer) -> None:
    """Brings `optimizer`'s index of its variables up to date after their storage changed
    (Keras' TensorFlow optimizer keys each variable by its storage)."""
    if hasattr(optimizer, "_trainable_variables_indices"):
        optimizer._trainable_variables_indices = {
            optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)
        }
    if isinstance(optimizer, LossScaleOptimizer):
        reindex(optimizer.inner_optimizer)


def _trained_locally(optimizer) -> bool:
    """Whether `optimizer` applies as on one device: kmirror trains it, it applies in one of
    kmirror's replicas (an optimizer another holds, or a step makes) or in a step kmirror
    traces to build it."""
    if optimizer in _local or getattr(_building, "depth", 0):
        return True
    return replicas.in_replica()


def _choosing(name: str):
    keras_own = getattr(TFOptimizer, name)
    local = getattr(base_optimizer.BaseOptimizer, name)

    def method(self, *args, **kwargs):
        return (local if _trained_locally(self) else keras_own)(self, *args, **kwargs)

    method.__name__ = name
    return method


def _loss_scale_apply(keras_own):
    def _tf_apply(self, grads, trainable_variables=None):
        if _trained_locally(self):
            return self._common_apply(grads, trainable_variables)
        return keras_own(self, grads, trainable_variables)

    return _tf_apply


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        for name in _LOCAL_METHODS:
            setattr(TFOptimizer, name, _choosing(name))
        LossScaleOptimizer._tf_apply = _loss_scale_apply(LossScaleOptimizer._tf_apply)
        _installed = True


def accumulation(optimizer, variables: list):
    """(whether this step is an update step, the optimizer's accumulator of each variable) for an
    optimizer with `gradient_accumulation_steps`; as Keras' optimizer decides it."""
    update = tf.equal((optimizer._iterations + 1) % optimizer.gradient_accumulation_steps, 0)
    accumulators = [
        optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables
    ]
    return update, accumulators
