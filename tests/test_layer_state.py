"""State that layers write during a step follows each weight's declared aggregation.

The exactness matrix (tests/features.py, "layer_state") trains keras.io's endpoint-layer pattern
and a layer keeping a running sum and counters on 2 and 3 replicas, Horovod ranks and ring
workers. Here: what each aggregation means where replicas write different values, the error for
a weight left at "none", per-replica BatchNormalization statistics, a model's own train_step
and eager steps.
"""

import keras
import numpy as np
import pytest
from conftest import cpus
from features import FEATURES, RunningSum, fit, rows_seen
from models import dense_data, max_weight_difference
from own_steps import GuideStep

import kmirror
from kmirror._core import keras_hooks


def test_mean_and_only_first_replica_combine_what_the_replicas_wrote():
    """Each replica computing from its own rows (`sync_batch_norm=False`: its row count too; by
    default the layer's call runs whole and every replica writes the batch's count)."""
    x, y = dense_data()
    for aggregation, expected in (("mean", 16.5), ("only_first_replica", 16.0)):
        model = kmirror.wrap(
            rows_seen(aggregation), "hierarchical_copy", devices=cpus(2), sync_batch_norm=False
        )
        # One batch of 33 rows: the replicas see 16 and 17 of them.
        model.fit(x[:33], y[:33], batch_size=33, epochs=1, verbose=0)
        assert model.layers[0].seen.numpy() == expected


def test_a_none_weight_written_differently_raises_naming_aggregation_and_updates_nothing():
    x, y = dense_data()
    user = rows_seen("none")
    before = [w.numpy().copy() for w in user.weights]
    # Each replica writes its own row count (`sync_batch_norm=False`).
    model = kmirror.wrap(user, reducer="one_device", devices=cpus(2), sync_batch_norm=False)
    with pytest.raises(
        ValueError, match=r"rows_seen(_\d+)?/seen, whose aggregation is 'none'.*aggregat"
    ):
        model.fit(x, y, batch_size=33, epochs=1, verbose=0)
    # The check runs before the optimizer: the failing (first) step updated no weight.
    np.testing.assert_array_equal(user.layers[1].kernel.numpy(), before[1])
    # In eager mode every call runs whole: each replica counts the whole batch's rows, as one
    # device does (the last batch's 2 of 101 rows), and they write alike.
    eager = rows_seen("none")
    eager.compile(loss=keras.losses.SparseCategoricalCrossentropy(True), run_eagerly=True)
    kmirror.wrap(eager, devices=cpus(2)).evaluate(x, y, batch_size=33, verbose=0)
    assert eager.layers[0].seen.numpy() == 2.0
    # A batch every replica sees the same share of (2 rows on 2 replicas) writes alike.
    model.fit(x[:2], y[:2], batch_size=2, epochs=1, verbose=0)
    assert user.layers[0].seen.numpy() == 1.0


def test_per_replica_batch_norm_statistics_are_averaged_over_the_replicas():
    feature = FEATURES["batch_norm"]
    model = kmirror.wrap(
        feature.build(), reducer="hierarchical_copy", devices=cpus(2), sync_batch_norm=False
    )
    fit(model, feature)
    layer = next(lay for lay in model.layers if "batch_norm" in lay.name)
    for variable in (layer.moving_mean, layer.moving_variance):
        copies = model._reducer.local_values(keras_hooks.storage(variable))
        np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy())


def _own_step_with_state():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(RunningSum()(inputs))
    model = GuideStep(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def test_state_written_in_a_models_own_train_step_and_in_predict_is_one_devices():
    x, y = dense_data()
    expected = _own_step_with_state()
    model = kmirror.wrap(_own_step_with_state(), reducer="hierarchical_copy", devices=cpus(3))
    for trained in (expected, model):
        trained.fit(x, y, batch_size=33, epochs=2, verbose=0, shuffle=False)
        trained.predict(x, batch_size=33, verbose=0)
    layer = next(lay for lay in model.layers if isinstance(lay, RunningSum))
    assert int(layer.calls.numpy()) == 2 * 4 + 4  # 4 batches a pass: two epochs, one predict
    assert max_weight_difference(expected, model) < 1e-4


def test_state_written_in_eager_steps_is_one_devices():
    feature = FEATURES["layer_state"]
    expected = feature.build()
    expected_history = fit(expected, feature, epochs=1)
    model = kmirror.wrap(feature.build(), reducer="hierarchical_copy", devices=cpus(2))
    model.compile(optimizer=model.optimizer, run_eagerly=True)
    history = fit(model, feature, epochs=1)
    assert max_weight_difference(expected, model) < feature.tolerance
    for name, values in expected_history.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-4)
