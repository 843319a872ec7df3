"""A Keras model's own state as Keras keeps it: its compile arguments, compiled loss and metrics,
symbolic build, traced step functions, saving cache and copies, the epoch a restored `fit` starts
at, its outputs' masks, and its optimizers' variables and gradient accumulation.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
from keras.src.backend.common import masking as keras_masking
from keras.src.backend.tensorflow import trainer as keras_trainer
from keras.src.ops import function as keras_function
from keras.src.optimizers import base_optimizer
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers.compile_utils import CompileMetrics
from keras.src.utils import tracking as keras_tracking

__all__ = [
    "compile_arguments",
    "compiled_loss",
    "compiled_metrics",
    "compiled_metric_list",
    "metric_function",
    "symbolic_build",
    "resolve_auto_jit_compile",
    "calls_with_training",
    "resume_at_epoch",
    "resumed_epoch",
    "print_msg",
    "keep_saving_cache",
    "compiled_state",
    "step_functions",
    "refresh_copy",
    "masks_of",
    "with_masks",
    "no_aggregation",
    "local_optimizer",
    "accumulation",
]


def compile_arguments(model) -> dict:
    """The arguments `model.compile` was called with."""
    return dict(model._compile_config.config)


def compiled_loss(model):
    """The loss object `compile` made (None before compile)."""
    return model._compile_loss


def compiled_metrics(model):
    """The `CompileMetrics` object `compile` made of `metrics` and `weighted_metrics` (or None)."""
    return model._compile_metrics


def compiled_metric_list(metric) -> list | None:
    """The metrics a `CompileMetrics` holds (None for any other metric, or before it is built)."""
    if isinstance(metric, CompileMetrics):
        return metric.metrics if metric.built else None
    return None


def metric_function(metric):
    """The function a `keras.metrics.MeanMetricWrapper` averages."""
    return metric._fn


def symbolic_build(model, data_batch) -> None:
    """Builds `model`, its compiled loss and metrics from one batch, as Keras' `fit` does under a
    strategy. (`MirroredModel` overrides Keras' `_maybe_symbolic_build`, where `fit`, `evaluate`
    and `predict` call this.)"""
    model._symbolic_build(data_batch=data_batch)


def resolve_auto_jit_compile(model) -> bool:
    """What `jit_compile="auto"` means for `model` here (True when a GPU is visible)."""
    return model._resolve_auto_jit_compile()


def calls_with_training(model) -> bool:
    """Whether `model.call` takes a `training` argument."""
    return model._call_has_training_arg


def resume_at_epoch(model, epoch: int) -> None:
    """Makes the next `fit` of `model` start at `epoch`, as Keras' own BackupAndRestore does."""
    model._initial_epoch = epoch


def resumed_epoch(model) -> int:
    """The epoch a restored `fit` starts at (0 when nothing was restored)."""
    return int(getattr(model, "_initial_epoch", None) or 0)


def print_msg(message: str) -> None:
    """Prints as Keras' callbacks do (to stdout, or to the log without interactive logging)."""
    from keras.src.utils import io_utils

    io_utils.print_msg(message)


def keep_saving_cache() -> None:
    """Makes Keras' saving reuse its cache of the attributes it skips.

    Keras 3 (3.15 here) stores that cache under one key (`saving_attr_skipset_<type>`) and looks
    for it under another (`saving_attr_skiplist_<type>`), so every save builds its reference
    objects again, an optimizer with variables among them, and a process that checkpoints every
    epoch grows by tens of KiB per save. This stores the cache under the key Keras reads. It
    touches Keras internals, so where they differ it does nothing.
    """
    try:
        from keras.src.backend.common import global_state
        from keras.src.saving import saving_lib

        for kind in ("Operation", "Layer", "Functional", "Sequential", "Metric", "Optimizer"):
            read = f"saving_attr_skiplist_{kind}"
            if global_state.get_global_attribute(read) is None:
                global_state.set_global_attribute(read, saving_lib.get_attr_skipset(kind))
    except (ImportError, AttributeError, ValueError, TypeError):
        return


def compiled_state(model) -> tuple:
    """What `compile` made on `model` (optimizer, loss and metric objects) and Keras' traced step
    functions: what a copy of a model that kmirror compiles anew leaves out."""
    made = ("optimizer", "_compile_loss", "_compile_metrics", "_loss_tracker")
    return tuple(getattr(model, name, None) for name in made) + step_functions(model)


def step_functions(model) -> tuple:
    """Keras' traced train, test and predict functions of `model` (a copy makes its own)."""
    names = ("train_function", "test_function", "predict_function")
    return tuple(getattr(model, name, None) for name in names)


def refresh_copy(obj) -> None:
    """Brings a copied Keras object up to date with where it now lives: what Keras keys by object
    identity (a functional graph's node keys, an attribute tracker's ids, an optimizer's
    variable index) and the `tf.distribute` strategy it was made under."""
    if isinstance(obj, keras_function.Function) and hasattr(obj, "_nodes"):
        nodes, by_depth, operations, operations_by_depth = keras_function.map_graph(
            obj._inputs, obj._outputs
        )
        obj._nodes, obj._nodes_by_depth = nodes, by_depth
        obj._operations, obj._operations_by_depth = operations, operations_by_depth
    elif isinstance(obj, keras_tracking.Tracker):
        obj.stored_ids = {
            name: {id(item) for item in store} for name, (_, store) in obj.config.items()
        }
    elif isinstance(obj, base_optimizer.BaseOptimizer):
        # Keras' TensorFlow optimizer remembers the strategy it was made under.
        obj._distribution_strategy = tf.distribute.get_strategy()
        if hasattr(obj, "_trainable_variables_indices"):
            obj._trainable_variables_indices = {
                obj._var_key(v): i for i, v in enumerate(obj._trainable_variables)
            }
    if isinstance(obj, keras_trainer.TensorFlowTrainer):
        has = tf.distribute.has_strategy()
        obj._distribute_strategy = tf.distribute.get_strategy() if has else None


def masks_of(outputs):
    """The Keras masks of a model's outputs as 0/1 integers, which every reducer can gather
    (None where an output has none)."""

    def mask_of(output):
        mask = keras_masking.get_keras_mask(output)
        return None if mask is None else tf.cast(mask, tf.int32)

    return tf.nest.map_structure(mask_of, outputs)


def with_masks(outputs, masks):
    """`outputs` carrying `masks` again (after they were gathered from the replicas)."""
    for output, mask in zip(tf.nest.flatten(outputs), tf.nest.flatten(masks)):
        if mask is not None:
            keras_masking.set_keras_mask(output, tf.cast(mask, tf.bool))
    return outputs


# -- the optimizer and its variables -------------------------------------------------------------
def no_aggregation() -> contextlib.AbstractContextManager:
    """Variables created in this scope are updated per replica: an assignment in a replica changes
    that replica's copy (every replica applies the same summed gradient, and updates metrics with
    the same global values, so copies stay equal). Metric variables, which Keras makes
    synchronised on read, are mirrored like the others (read in any context)."""

    def creator(next_creator, **kwargs):
        kwargs["aggregation"] = tf.VariableAggregation.NONE
        if kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ:
            kwargs["synchronization"] = tf.VariableSynchronization.AUTO
        return next_creator(**kwargs)

    return tf.variable_creator_scope(creator)


#: Keras' backend-agnostic versions of what its TensorFlow optimizer routes through tf.distribute.
_LOCAL_METHODS = (
    "_backend_update_step",
    "_apply_weight_decay",
    "_backend_increment_gradient_accumulators",
    "_overwrite_model_variables_with_average_value",
)


def local_optimizer(optimizer):
    """Makes `optimizer` apply gradients as on one device, on each replica's copy of the variables.

    Keras' TensorFlow optimizer sums gradients across `tf.distribute` replicas and updates through
    `merge_call` (which fails inside the conditions of gradient accumulation and EMA). kmirror's
    reducer sums them before the optimizer sees them, so the optimizer must not sum again.
    """
    for name in _LOCAL_METHODS:
        setattr(optimizer, name, getattr(base_optimizer.BaseOptimizer, name).__get__(optimizer))
    if isinstance(optimizer, LossScaleOptimizer):
        optimizer._tf_apply = optimizer._common_apply
        local_optimizer(optimizer.inner_optimizer)
    return optimizer


def accumulation(optimizer, variables: list):
    """(whether this step is an update step, the optimizer's accumulator of each variable) for an
    optimizer with `gradient_accumulation_steps`; as Keras' optimizer decides it."""
    update = tf.equal((optimizer._iterations + 1) % optimizer.gradient_accumulation_steps, 0)
    accumulators = [
        optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables
    ]
    return update, accumulators
