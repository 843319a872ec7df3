"""A Keras model's own state as Keras keeps it: its compile arguments, compiled loss, metrics and
loss tracker, saving cache, the epoch a restored `fit` starts at, and its outputs'
masks.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf
from keras.src.backend.common import masking as keras_masking
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.trainers.compile_utils import CompileMetrics

__all__ = [
    "compile_arguments",
    "compile_call",
    "compiled_loss",
    "compiled_metrics",
    "loss_tracker",
    "compiled_metric_list",
    "metric_function",
    "resolve_auto_jit_compile",
    "calls_with_training",
    "resume_at_epoch",
    "resumed_epoch",
    "print_msg",
    "keep_saving_cache",
    "masks_of",
    "with_masks",
    "from_adding_metric_module",
    "per_row_keras_function",
    "rowwise_step",
    "keras_model_name",
]


def compile_arguments(model) -> dict:
    """The arguments `model.compile` was called with."""
    return dict(model._compile_config.config)


def compile_call(model) -> object | None:
    """What stands for `model`'s latest `compile` call (another object after every call; None
    before the first)."""
    return getattr(model, "_compile_config", None)


def compiled_loss(model):
    """The loss object `compile` made (None before compile)."""
    return model._compile_loss


def compiled_metrics(model):
    """The `CompileMetrics` object `compile` made of `metrics` and `weighted_metrics` (or None)."""
    return model._compile_metrics


def loss_tracker(model):
    """The metric `compile` made to track the mean loss (None before compile)."""
    return model._loss_tracker


def compiled_metric_list(metric) -> list | None:
    """The metrics a `CompileMetrics` holds (None for any other metric, or before it is built)."""
    if isinstance(metric, CompileMetrics):
        return metric.metrics if metric.built else None
    return None


def metric_function(metric):
    """The function a `keras.metrics.MeanMetricWrapper` averages."""
    return metric._fn


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


#: The modules of Keras' metric classes whose state is a sum over the rows (counts, totals,
#: confusion matrices); the others (AUC's thresholds included) are checked one by one.
_ADDING_MODULES = tuple(
    f"keras.src.metrics.{name}"
    for name in (
        "accuracy_metrics",
        "confusion_metrics",
        "f_score_metrics",
        "hinge_metrics",
        "iou_metrics",
        "probabilistic_metrics",
        "regression_metrics",
    )
)


def from_adding_metric_module(kind: type) -> bool:
    """Whether `kind` is one of Keras' metric classes from a module of adding metrics."""
    return kind.__module__ in _ADDING_MODULES


#: Keras' loss functions that couple a batch's rows: a row's loss depends on the other rows (Dice
#: and Tversky give one value for the whole batch). Checked on Keras 3.12 and 3.15.
_COUPLING_FUNCTIONS = frozenset({"dice", "tversky", "circle"})


#: The methods Keras' own train_step and test_step call on the model besides `call`.
_STEP_PARTS = ("compute_loss", "compute_metrics")


def rowwise_step(model) -> bool:
    """Whether Keras' own step of `model` adds up over rows: each row's loss under its compiled
    loss depends on that row alone, and the model computes its loss and metrics as Keras does (no
    `compute_loss` or `compute_metrics` of its own), with Keras' losses that give a value per
    row, by name, class or function."""
    if any(getattr(type(model), name) is not getattr(keras.Model, name) for name in _STEP_PARTS):
        return False
    losses = tf.nest.flatten(compile_arguments(model).get("loss"))
    return all(_rowwise(loss) for loss in losses if loss is not None)


def _rowwise(loss) -> bool:
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, LossFunctionWrapper):
        return type(loss).__module__ == LossFunctionWrapper.__module__ and _rowwise(loss.fn)
    if isinstance(loss, keras.losses.Loss):
        return False  # a loss class of the user's own
    return per_row_keras_function(loss)


def per_row_keras_function(fn) -> bool:
    """Whether `fn` is one of Keras' loss or metric functions whose value for a row depends on that
    row alone (not the correlation metrics, Dice, Tversky or Circle)."""
    module = getattr(fn, "__module__", "") or ""
    return (
        module.startswith(("keras.src.metrics.", "keras.src.losses."))
        and "correlation" not in module
        and getattr(fn, "__name__", "") not in _COUPLING_FUNCTIONS
    )


#: What Keras' fit, evaluate and predict set on a model as they run (Keras 3.12 and 3.15).
_LOOP_STATE = frozenset({"history", "stop_training", "stop_evaluating", "stop_predicting"})


@functools.cache
def _keras_instance_names() -> frozenset:
    """The attributes Keras sets on every model it makes and compiles, and in its loops."""
    with tf.init_scope():
        probe = keras.Model()
        probe.compile(optimizer="sgd", loss="mse")
    return frozenset(vars(probe)) | _LOOP_STATE


def keras_model_name(name: str) -> bool:
    """Whether `name` is one Keras gives a model (a private name, a method or property of
    `keras.Model`, or an attribute Keras sets), not one of a user's model class of its own."""
    return name.startswith("_") or hasattr(keras.Model, name) or name in _keras_instance_names()
