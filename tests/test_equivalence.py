"""The central promise: N-replica training equals single-device training with the same global batch.

Batches are 33 rows of 101 samples: 33 is not divisible by 2, and the final batch of 2 rows is
split 1/1 on 2 replicas and 0/1/1 on 3 (a replica with no rows at all).
"""

import functools

import keras
import numpy as np
import pytest
from conftest import cpus
from models import (
    BATCH,
    assert_same_history,
    dense_data,
    dense_model,
    max_weight_difference,
    multi_io_data,
    multi_io_model,
    subclassed_model,
)

import kmirror

EPOCHS = 3
TOLERANCE = {"sgd": 1e-5, "adam": 1e-4}
CASES = [
    pytest.param(reducer, n, opt, id=f"{reducer}-{n}-{opt}")
    # "auto" is hierarchical_copy without GPUs (tests/test_reducers.py): not run twice.
    for reducer in ("one_device", "hierarchical_copy")
    for n in (2, 3)
    for opt in ("sgd", "adam")
]


def fit(model, x, y, epochs=EPOCHS, **kwargs):
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **kwargs)


@functools.cache
def multi_io_reference(opt):
    x, y, sample_weight = multi_io_data()
    model = multi_io_model(opt)
    history = fit(model, x, y, sample_weight=sample_weight).history
    return model, history


@pytest.mark.parametrize("reducer, n, opt", CASES)
def test_multi_input_embedding_with_sample_weights_equals_single_device(reducer, n, opt):
    reference, reference_history = multi_io_reference(opt)
    x, y, sample_weight = multi_io_data()
    model = kmirror.wrap(multi_io_model(opt), reducer=reducer, devices=cpus(n))
    history = fit(model, x, y, sample_weight=sample_weight).history

    assert model.num_replicas == n
    assert max_weight_difference(reference, model) < TOLERANCE[opt]
    # loss, label_loss, value_loss, label_accuracy, value_mae: all global values
    assert {"loss", "label_loss", "value_loss", "label_accuracy", "value_mae"} <= set(history)
    assert_same_history(reference_history, history)


@functools.cache
def trained_reference(opt):
    x, y = dense_data()
    model = dense_model(opt)
    history = fit(model, x, y).history
    return model, history


@pytest.mark.parametrize("reducer, n, opt", CASES)
def test_model_wrapped_after_an_epoch_continues_with_its_optimizer_state(reducer, n, opt):
    reference, reference_history = trained_reference(opt)
    x, y = dense_data()
    model = dense_model(opt)
    first = fit(model, x, y, epochs=1).history
    iterations = int(model.optimizer.iterations.numpy())

    wrapped = kmirror.wrap(model, reducer=reducer, devices=cpus(n))
    assert int(wrapped.optimizer.iterations.numpy()) == iterations == 4
    rest = fit(wrapped, x, y, epochs=EPOCHS - 1).history

    assert max_weight_difference(reference, wrapped) < TOLERANCE[opt]
    joined = {key: first[key] + rest[key] for key in first}
    assert_same_history(reference_history, joined)
    assert int(wrapped.optimizer.iterations.numpy()) == 4 * EPOCHS


class InitialWeights(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.weights = self.model.get_weights()


@pytest.mark.parametrize("reducer, n, opt", CASES)
def test_model_wrapped_before_it_was_built_equals_single_device(reducer, n, opt):
    x, y = dense_data()
    unbuilt = subclassed_model(opt)
    assert not unbuilt.built
    model = kmirror.wrap(unbuilt, reducer=reducer, devices=cpus(n))
    initial = InitialWeights()
    history = fit(model, x, y, callbacks=[initial]).history

    reference = subclassed_model(opt)
    reference(x[:1])
    reference.set_weights(initial.weights)
    reference_history = fit(reference, x, y).history

    assert max_weight_difference(reference, model) < TOLERANCE[opt]
    assert_same_history(reference_history, history)
    assert unbuilt.built and max_weight_difference(model, unbuilt) == 0, "the user's model trained"


@pytest.mark.parametrize("n", [2, 3])
def test_evaluate_and_predict_equal_single_device(n):
    x, y, sample_weight = multi_io_data()
    reference = multi_io_model()
    model = kmirror.wrap(multi_io_model(), reducer="one_device", devices=cpus(n))

    expected = reference.evaluate(x, y, sample_weight=sample_weight, batch_size=7, verbose=0)
    actual = model.evaluate(x, y, sample_weight=sample_weight, batch_size=7, verbose=0)
    np.testing.assert_allclose(actual, expected, rtol=1e-6)

    expected = reference.predict(x, batch_size=10, verbose=0)
    actual = model.predict(x, batch_size=10, verbose=0)
    for key in expected:
        assert actual[key].shape == expected[key].shape == (101, 1 if key == "value" else 3)
        np.testing.assert_allclose(actual[key], expected[key], atol=1e-6)


def test_batch_smaller_than_the_replica_count_equals_single_device():
    x, y = dense_data(n=20)
    reference = dense_model()
    model = kmirror.wrap(dense_model(), reducer="hierarchical_copy", devices=cpus(5))
    reference_history = reference.fit(x, y, batch_size=3, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=3, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-5
    assert_same_history(reference_history.history, history.history)


def test_the_users_own_model_is_what_trains():
    """No copy: the user's layers, optimizer and variables are the wrapped model's."""
    x, y = dense_data()
    user = dense_model("adam")
    layers, optimizer = list(user.layers), user.optimizer
    variables = list(user.weights)
    model = kmirror.wrap(user, reducer="one_device", devices=cpus(2))
    fit(model, x, y)
    reference, _ = trained_reference("adam")

    assert model.layers == layers and all(a is b for a, b in zip(model.layers, layers))
    assert model.optimizer is optimizer
    assert all(a is b for a, b in zip(model.weights, variables, strict=True))
    assert max_weight_difference(reference, user) < TOLERANCE["adam"]
    assert int(optimizer.iterations.numpy()) == 4 * EPOCHS
