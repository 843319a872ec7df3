"""Where kmirror reaches into Keras: the places that decide what a replica's part of a step is.

A replica computes its rows of the global batch. For its part to add up to the single-device step,
four things Keras decides per call must be decided over the GLOBAL batch instead:

- loss normalisers: a loss' divisor (row count, sum of sample weights, unmasked entries) is the
  global one, and Keras' own division by the replica count is undone;
- BatchNormalization: batch statistics are those of the global batch;
- random draws: a replica takes its rows of the draw one device would make for the whole batch;
- the optimizer: every replica applies the summed gradient to its own copy of the variables
  (Keras' TensorFlow optimizer would sum the gradients again, inside `tf.distribute`).

Keras exposes none of these as public API, so this module replaces a few functions of
`keras.src` while a kmirror replica runs (elsewhere they behave exactly as Keras' own). It also
holds every other use of Keras internals (a model's compile arguments and compiled loss, its
symbolic build, copies brought up to date, Keras' saving cache, the epoch a restored `fit` starts
at, the order in which Keras' array adapter draws rows, its class weights and validation split,
the data adapter of a distributed dataset, the passes Keras begins over a dataset, what its
PyDataset adapter makes of a batch),
so that it is the only module that touches them; kmirror's callbacks, which extend Keras'
callback classes, also override the methods Keras' own subclasses override. Checked on Keras
3.15.1 with TensorFlow 2.21.0 (`make test`) and on Keras 3.12.4 with TensorFlow 2.19.1
(`make test-compat`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from keras.src import ops
from keras.src.backend.common import masking as keras_masking
from keras.src.backend.tensorflow import nn as keras_nn
from keras.src.backend.tensorflow import random as keras_random
from keras.src.backend.tensorflow import trainer as keras_trainer
from keras.src.layers.normalization.batch_normalization import BatchNormalization
from keras.src.losses import loss as keras_loss
from keras.src.ops import function as keras_function
from keras.src.optimizers import base_optimizer
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers.compile_utils import CompileMetrics
from keras.src.trainers.data_adapters import (
    array_data_adapter,
    array_slicing,
    data_adapter_utils,
    py_dataset_adapter,
    tf_dataset_adapter,
)
from keras.src.trainers.epoch_iterator import EpochIterator
from keras.src.utils import tracking as keras_tracking

__all__ = [
    "Rows",
    "replica",
    "current",
    "install",
    "local_optimizer",
    "no_aggregation",
    "compile_arguments",
    "compiled_loss",
    "symbolic_build",
    "resolve_auto_jit_compile",
    "calls_with_training",
    "first_batch",
    "keep_saving_cache",
    "compiled_state",
    "step_functions",
    "refresh_copy",
    "compute_loss",
    "accumulation",
    "masks_of",
    "with_masks",
]


@dataclass
class Rows:
    """This replica's place in the global batch, and how it sums a value with the others."""

    start: tf.Tensor  # first row of this replica in the global batch
    count: tf.Tensor  # rows of this replica (may be 0)
    total: tf.Tensor  # rows of the global batch
    all_sum: Callable[[tf.Tensor], tf.Tensor]  # sum over every replica (replica context)
    global_statistics: bool = True  # BatchNormalization over the global batch
    #: In a model's own step: sums gradients over every replica (replica context), and joins
    #: every replica's rows of a tensor in row order.
    reduce_gradients: Callable[[list], list] | None = None
    all_gather: Callable[[tf.Tensor], tf.Tensor] | None = None
    #: The scope variables made during the step (an optimizer's, on its first update) need.
    variable_scope: Callable[[], contextlib.AbstractContextManager] | None = None

    def share(self, dtype) -> tf.Tensor:
        """This replica's fraction of the global batch's rows."""
        return tf.math.divide_no_nan(tf.cast(self.count, dtype), tf.cast(self.total, dtype))


_state = threading.local()  # tf.distribute runs each replica in a thread of its own


def _current() -> Rows | None:
    return getattr(_state, "rows", None)


def current() -> Rows | None:
    """The rows of the replica running on this thread, or None outside a replica."""
    return _current()


@contextlib.contextmanager
def replica(rows: Rows) -> Iterator[None]:
    """Within this block (on this thread) Keras computes replica `rows`' part of the step."""
    install()
    previous, _state.rows = _current(), rows
    try:
        yield
    finally:
        _state.rows = previous


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


# -- the model's own Keras state -------------------------------------------------------------------
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


def first_batch(x, batch_size):
    """The first batch Keras makes of `x` (any input `predict` takes)."""
    for _, _, batches in EpochIterator(
        x=x, batch_size=batch_size, steps_per_epoch=1, shuffle=False
    ):
        return next(iter(batches)) if isinstance(batches, list) else next(batches)
    return None


def batch_order(num_samples: int, batch_size: int, shuffle) -> tf.data.Dataset:
    """The row indices of each batch `fit` makes of `num_samples` rows, in the order Keras'
    array adapter draws them (`shuffle`: False, True or "batch"; the same random ops, so the
    same order for the same seed)."""
    adapter = array_data_adapter.ArrayDataAdapter(
        np.arange(num_samples, dtype=np.int64), batch_size=batch_size, shuffle=shuffle
    )
    return adapter.get_tf_dataset()


def distributed_input(distributed, steps: int):
    """What `fit` and `evaluate` take for a `tf.distribute` dataset yielding `steps` steps per
    epoch (a dataset made with `distribute_datasets_from_function` counts its per-replica
    elements instead; Keras takes a data adapter as `x` and reads the count from it)."""

    class Adapter(tf_dataset_adapter.TFDatasetAdapter):
        @property
        def num_batches(self):
            return steps if steps >= 0 else None

    return Adapter(distributed)


def passes_begun_before(epoch: int) -> int:
    """How many passes over a dataset Keras' fit has begun before the pass epoch `epoch` trains
    on: its epoch iterator begins one at the start of every epoch, and one more at the end of an
    epoch that used all its batches (left unused, since the next epoch begins its own). What a
    reshuffling `tf.data` dataset's order depends on."""
    return 2 * epoch


def py_dataset_batches(py_dataset, class_weight=None) -> Callable:
    """What Keras' PyDataset adapter makes of a batch of `py_dataset`: a tuple `(x,)`, `(x, y)` or
    `(x, y, sample_weight)` (with `class_weight` made sample weights) or a dict."""
    adapter = py_dataset_adapter.PyDatasetAdapter(py_dataset, class_weight=class_weight)
    return adapter._standardize_batch


def batches_spec(batches: list):
    """The element spec Keras' PyDataset adapter gives batches like `batches`: each dimension the
    batches share is fixed, any other is None."""
    return data_adapter_utils.get_tensor_spec(batches)


def class_weighted(y, class_weight):
    """The sample weights Keras makes of `class_weight` for the targets `y`."""
    return data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


def validation_split(arrays, split: float) -> tuple:
    """`(training arrays, validation arrays)` as `fit(validation_split=split)` cuts them."""
    return array_slicing.train_validation_split(arrays, validation_split=split)


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


def compute_loss(model, x, y, y_pred, sample_weight, training: bool) -> tf.Tensor:
    """The model's loss for these rows (its own `compute_loss` if it has one)."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


# -- loss normalisers ------------------------------------------------------------------------------
def _reduce_weighted_values(
    values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None
):
    """Keras' reduction, with the divisor of the global batch.

    Returns the replica's exact part of the global loss divided by its share of the rows: the step
    multiplies every loss by that share, which makes a mean over a replica's rows (a user's own
    `ops.mean`, a regulariser) exact too. Values are those of Keras' `reduce_weighted_values`.
    """
    rows = _current()
    reduction = keras_loss.standardize_reduction(reduction)
    if rows is None or reduction == "none" or tuple(values.shape) == ():
        return _ORIGINAL["reduce_weighted_values"](values, sample_weight, mask, reduction, dtype)
    values = ops.convert_to_tensor(values, dtype=dtype)
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    if mask is not None:
        mask = ops.convert_to_tensor(mask, dtype=dtype)
    # Plain weights: sample weight times the 0/1 mask (Keras normalises the mask by the replica's
    # own count for the mean reductions; the global count replaces that below).
    weights = keras_loss.apply_mask(sample_weight, mask, dtype=values.dtype, reduction="sum")
    if weights is not None:
        weights = ops.cast(weights, values.dtype)
        values, weights = keras_loss.squeeze_or_expand_to_same_rank(values, weights)
        values = values * weights
    total = ops.sum(values)
    share = rows.share(total.dtype)
    if reduction == "sum":
        return tf.math.divide_no_nan(total, share)
    size = tf.cast(tf.size(values), total.dtype)
    if reduction == "mean_with_sample_weight" and weights is not None:
        divisor = rows.all_sum(tf.stop_gradient(ops.sum(weights)))
    elif mask is not None:
        valid = ops.sum(ops.cast(mask, total.dtype))
        entries = tf.cast(tf.size(mask), total.dtype)
        divisor = rows.all_sum(tf.stop_gradient(tf.math.divide_no_nan(valid * size, entries)))
    else:
        # Every replica's rows have the same shape: the mean over this replica's rows is exact.
        return tf.math.divide_no_nan(total, size)
    return tf.math.divide_no_nan(total, divisor * share)


def _scale_loss_for_distribution(value):
    # kmirror weighs each replica's loss by its share of the rows; Keras' 1/replicas is undone.
    if _current() is not None:
        return value
    return _ORIGINAL["scale_loss_for_distribution"](value)


def _unscale_loss_for_distribution(value):
    # The replica's loss is its mean, not 1/replicas of it: nothing to unscale.
    if _current() is not None:
        return value
    return _ORIGINAL["unscale_loss_for_distribution"](value)


# -- BatchNormalization ----------------------------------------------------------------------------
def _compute_moments_sync(x, axes, keepdims):
    """Mean and variance of the global batch, computed as `tf.nn.moments` computes them on one
    device (mean first, then the mean squared difference), with sums over every replica."""
    rows = _current()
    if rows is None:
        return _ORIGINAL["_compute_moments_sync"](x, axes, keepdims)
    count = rows.all_sum(tf.reduce_sum(tf.ones_like(x), axis=axes, keepdims=True))
    mean = tf.math.divide_no_nan(rows.all_sum(tf.reduce_sum(x, axis=axes, keepdims=True)), count)
    squared = tf.math.squared_difference(x, tf.stop_gradient(mean))
    variance = tf.math.divide_no_nan(
        rows.all_sum(tf.reduce_sum(squared, axis=axes, keepdims=True)), count
    )
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


def _batch_norm_moments(layer, inputs, mask):
    rows = _current()
    if rows is None or mask is not None or not rows.global_statistics:
        return _ORIGINAL["_moments"](layer, inputs, mask)
    return ops.moments(inputs, axes=layer._reduction_axes, synchronized=True)


# -- random draws ----------------------------------------------------------------------------------
def _global_shape(shape, rows: Rows):
    """(shape of the draw one device makes, first row of this replica in it) when the draw's first
    dimension is this replica's rows; else the draw as it is."""
    shape = tf.convert_to_tensor(shape)
    if shape.shape.rank != 1 or shape.shape[0] == 0:
        return shape, None
    first = tf.cast(shape[0], tf.int64)
    batch = tf.equal(first, tf.cast(rows.count, tf.int64))
    wide = tf.where(batch, tf.cast(rows.total, tf.int64), first)
    start = tf.where(batch, tf.cast(rows.start, tf.int64), tf.constant(0, tf.int64))
    return tf.concat([tf.cast([wide], shape.dtype), shape[1:]], 0), (start, first)


def _rows_of(draw, place):
    if place is None:
        return draw
    start, count = place
    return draw[start : start + count]


def _drawing(name: str):
    original = _ORIGINAL[name]

    def draw(shape, *args, **kwargs):
        rows = _current()
        if rows is None:
            return original(shape, *args, **kwargs)
        wide, place = _global_shape(shape, rows)
        return _rows_of(original(wide, *args, **kwargs), place)

    draw.__name__ = name
    return draw


def _dropout(inputs, rate, noise_shape=None, seed=None):
    rows = _current()
    if rows is None:
        return _ORIGINAL["dropout"](inputs, rate, noise_shape=noise_shape, seed=seed)
    inputs = tf.convert_to_tensor(inputs)
    noise_shape = keras_random._get_concrete_noise_shape(inputs, noise_shape)
    wide, place = _global_shape(noise_shape, rows)
    # The scaled keep-mask one device would draw for the whole batch, this replica's rows of it.
    kept = _ORIGINAL["dropout"](tf.ones(wide, inputs.dtype), rate, seed=seed)
    kept = _rows_of(kept, place)
    return tf.where(tf.not_equal(kept, 0), inputs * kept, tf.zeros_like(inputs))


# -- installing ------------------------------------------------------------------------------------
_RANDOM = ("normal", "uniform", "truncated_normal", "randint")
_ORIGINAL: dict[str, Callable] = {}
_install_lock = threading.Lock()


def install() -> None:
    """Puts kmirror's versions in place (once per process). Outside a replica they call Keras'."""
    with _install_lock:
        if _ORIGINAL:
            return
        targets = [
            (keras_loss, "reduce_weighted_values", _reduce_weighted_values),
            (keras_loss, "scale_loss_for_distribution", _scale_loss_for_distribution),
            (keras_loss, "unscale_loss_for_distribution", _unscale_loss_for_distribution),
            (keras_nn, "_compute_moments_sync", _compute_moments_sync),
            (BatchNormalization, "_moments", _batch_norm_moments),
            (keras_random, "dropout", _dropout),
        ]
        for module, name, _ in targets:
            _ORIGINAL[name] = getattr(module, name)
        for name in _RANDOM:
            _ORIGINAL[name] = getattr(keras_random, name)
        for module, name, replacement in targets:
            setattr(module, name, replacement)
        for name in _RANDOM:
            setattr(keras_random, name, _drawing(name))


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
