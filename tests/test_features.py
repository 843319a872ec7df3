"""Exact for the Keras features real models compile with: each feature of tests/features.py trains
on 2 and 3 in-process replicas exactly as on one device with the same global batch (batches of 33:
not divisible by 2 or 3, a final batch of 2, so one of 3 replicas gets no rows), with each
replica's rows split from the host batch inside the step; the features of `PREFETCHED` also with
the rows prefetched to the replicas' devices ahead of it (`prefetch=True`, the default on GPUs).

Multi-process reducers run the same features in tests/test_horovod.py and
tests/test_multi_worker.py.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from features import (
    EPOCHS,
    FEATURES,
    LENGTH,
    PREFETCHED,
    TRANSFORMER_VARIANTS,
    VOCABULARY,
    assert_same_logs,
    dense,
    fit,
    one_device,
    trained_state,
)
from models import Weights, assert_same_history, max_weight_difference

import kmirror


@functools.cache
def reference(name: str):
    feature = FEATURES[name]
    model = feature.build()
    return model, fit(model, feature)


CASES = [(name, n, False) for name in sorted(FEATURES) for n in FEATURES[name].replicas]
# Prefetched on 3 replicas, the case with uneven shares and a replica without rows (2 replicas:
# tests/test_prefetch.py).
CASES += [(name, 3, True) for name in PREFETCHED]


@pytest.mark.parametrize(
    "name, n, prefetch",
    CASES,
    ids=[f"{c[0]}-{c[1]}" + ("-prefetched" if c[2] else "") for c in CASES],
)
def test_feature_equals_single_device(name, n, prefetch):
    feature = FEATURES[name]
    weights, expected_history = one_device(name)
    model = kmirror.wrap(
        feature.build(), reducer="hierarchical_copy", devices=cpus(n), prefetch=prefetch
    )
    history = fit(model, feature)

    state = trained_state(model)
    assert len(state) == len(weights), "the weights and optimizer variables of one device"
    assert max_weight_difference(Weights(weights), Weights(state)) < feature.tolerance
    assert_same_logs(feature, expected_history, history)


def test_batch_norm_moving_statistics_are_those_of_one_device():
    feature = FEATURES["batch_norm"]
    expected, _ = reference("batch_norm")
    model = kmirror.wrap(feature.build(), reducer="one_device", devices=cpus(3))
    fit(model, feature)
    layer = next(lay for lay in model.unwrap().layers if "batch_norm" in lay.name)
    single = next(lay for lay in expected.layers if "batch_norm" in lay.name)
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(
            getattr(layer, name).numpy(), getattr(single, name).numpy(), atol=1e-5
        )


def test_accumulation_counts_updates_as_one_device():
    feature = FEATURES["accumulation"]
    model = kmirror.wrap(feature.build(), reducer="hierarchical_copy", devices=cpus(2))
    fit(model, feature)
    assert int(model.optimizer.iterations.numpy()) == 3 * 4 // 2  # 12 micro-steps, 6 updates


class CountingReducer(kmirror.reducers.HierarchicalCopy):
    """Counts the gradient reductions as they run (a variable, not a trace count)."""

    def __init__(self):
        super().__init__()
        self.count = tf.Variable(0, trainable=False)

    def reduce_gradients(self, gradients):
        self.count.assign_add(1)
        return super().reduce_gradients(gradients)


@pytest.mark.parametrize(
    "name, reductions",
    [
        ("accumulation", 6),
        ("adam", 12),
        ("own_step_batch_norm", 12),
        ("own_step_accumulated_cond_raw", 12),
        ("own_step_sharpness_aware", 24),
    ],
)
def test_gradients_are_reduced_once_per_update(name, reductions):
    """3 epochs of 4 micro-steps: 12 reductions without accumulation, 6 with 2 steps. A model's
    own step: one per gradient it takes, applied or accumulated (sharpness-aware: two)."""
    feature = FEATURES[name]
    reducer = CountingReducer()
    model = kmirror.wrap(feature.build(), reducer=reducer, devices=cpus(2))
    fit(model, feature)
    assert int(reducer.count.numpy()) == reductions


def test_an_overflow_in_one_replica_skips_the_step_on_every_replica():
    feature = FEATURES["mixed_precision_overflow"]
    expected, _ = reference("mixed_precision_overflow")
    model = kmirror.wrap(feature.build(), reducer="hierarchical_copy", devices=cpus(3))
    fit(model, feature)

    # One device skipped the overflowing step of each epoch and halved its loss scale each time.
    assert float(expected.optimizer.dynamic_scale.numpy()) == 2.0**15 / 2**EPOCHS
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15 / 2**EPOCHS
    # Every replica skipped, not only the row's: each evaluates its rows with its own weights.
    x, y, _ = feature.data()
    losses = [m.evaluate(x, y, batch_size=33, verbose=0)[0] for m in (expected, model)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)


def test_per_replica_batch_norm_statistics_are_an_option_that_leaves_one_device():
    feature = FEATURES["batch_norm"]
    expected, _ = reference("batch_norm")
    model = kmirror.wrap(
        feature.build(), reducer="hierarchical_copy", devices=cpus(2), sync_batch_norm=False
    )
    fit(model, feature)
    # Each replica normalises its own rows: no longer the single-device result.
    assert max_weight_difference(expected, model) > 1e-3


def test_xla_with_global_batch_norm_statistics_warns_and_stays_exact():
    expected, _ = reference("batch_norm")
    user = dense(hidden=[keras.layers.BatchNormalization], jit_compile=True)
    with pytest.warns(UserWarning, match="not compiled with XLA"):
        model = kmirror.wrap(user, reducer="hierarchical_copy", devices=cpus(2))
    assert model.replica_jit_compile is False
    fit(model, FEATURES["batch_norm"])
    assert max_weight_difference(expected, model) < FEATURES["batch_norm"].tolerance


@pytest.mark.parametrize("variant", sorted(TRANSFORMER_VARIANTS))
def test_embedding_lookups_sum_as_one_device_wherever_gradients_are_summed(variant):
    """The transformer (a token lookup per row, a position lookup shared by the rows, Adam) in
    a model's own train_step, with XLA, and with gradient accumulation, on 3 replicas."""
    feature = TRANSFORMER_VARIANTS[variant]
    expected = feature.build()
    expected_history = fit(expected, feature)
    model = kmirror.wrap(feature.build(), reducer="hierarchical_copy", devices=cpus(3))
    history = fit(model, feature)
    assert max_weight_difference(expected, model) < feature.tolerance
    assert_same_history(expected_history, history, rtol=1e-4)


def test_embedding_lookups_in_eager_mode_are_one_devices():
    """In eager mode every call runs whole on every replica: each replica's slices of the
    transformer's token and position lookups are every row's, summed value by value. Before, the
    lookups were taken to be per row, with a warning, and a shared lookup trained differently."""
    feature = FEATURES["transformer"]
    x, y, _ = feature.data()
    weights = []
    for replicas in (None, 2):
        model = feature.build()
        model.compile(optimizer="adam", loss=model.loss, run_eagerly=True)
        if replicas:
            model = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(replicas))
        model.fit(x[:20], y[:20], batch_size=9, epochs=1, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    assert max(np.max(np.abs(a - b)) for a, b in zip(*weights)) < feature.tolerance


class SharedTable(keras.layers.Layer):
    """One embedding looked up per row (tokens) and once for all rows (positions)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = keras.layers.Embedding(VOCABULARY, 4)

    def call(self, x):
        return self.table(x) + self.table(keras.ops.arange(x.shape[-1]))


def test_an_embedding_looked_up_both_ways_is_named_in_a_warning():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((LENGTH,), dtype="int32"), SharedTable(), keras.layers.Dense(3)]
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
    wrapped = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(2))
    x, y, _ = FEATURES["masked_loss"].data()
    with pytest.warns(UserWarning, match="looked up both per row and once for all rows"):
        wrapped.fit(x, y, batch_size=33, epochs=1, verbose=0)


def _random_crop():
    """Keras' RandomCrop in training mode: one crop offset per batch (a draw of shape `()`)."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((10, 10, 3)),
            keras.layers.RandomCrop(8, 8),
            keras.layers.Conv2D(4, 3),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3),
        ]
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model


@pytest.mark.parametrize("n", [2, 3])
def test_a_scalar_draw_is_one_devices_on_every_replica(n):
    """A draw of shape `()` (RandomCrop's offset) is the one value one device draws."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(101, 10, 10, 3)), rng.integers(0, 3, 101)
    reference = _random_crop()
    model = kmirror.wrap(_random_crop(), devices=cpus(n))
    histories = [
        m.fit(x, y, batch_size=33, epochs=2, shuffle=False, verbose=0).history
        for m in (reference, model)
    ]
    assert max_weight_difference(reference, model) < 1e-5
    assert_same_history(*histories)
