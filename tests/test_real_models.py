"""The models users train: every `keras.applications` family wraps, its variables mirrored where
they are; deep models train 2 epochs as on one device (float64: tests/real_models.py says why);
the keras.io transfer-learning flow trains as on one device. The multi-process reducers run a deep
model and the flow in tests/test_horovod.py and tests/test_multi_worker.py."""

import keras
import numpy as np
import pytest
from conftest import cpus
from models import assert_same_history
from real_models import (
    DEEP,
    FAMILIES,
    TRANSFER_TOLERANCE,
    application,
    deep_reference,
    precision,
    transfer_flow,
    transfer_model,
    transfer_reference,
)

import kmirror
from kmirror._core import mirroring, tf_hooks


def test_the_families_are_every_family_keras_applications_has():
    models = [getattr(keras.applications, name) for name in dir(keras.applications)]
    families = {model.__module__.rsplit(".", 1)[-1] for model in models if callable(model)}
    assert families == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_keras_applications_family_wraps_in_place(family):
    name, size = FAMILIES[family]
    model = application(name, size)
    layers, values = list(model.layers), model.get_weights()
    reducer = kmirror.reducers.HierarchicalCopy()
    wrapped = kmirror.wrap(model, reducer, devices=cpus(2))

    state = mirroring.state(model)
    assert len(state) >= len(model.weights) > 0
    for variable in state:
        assert tf_hooks.strategy_of(variable.value) is reducer.strategy, variable.path
        assert len(reducer.strategy.experimental_local_results(variable.value)) == 2
    assert len(wrapped.layers) == len(layers) and all(
        a is b for a, b in zip(wrapped.layers, layers)
    ), "the user's own layers"
    for a, b in zip(wrapped.get_weights(), values, strict=True):
        np.testing.assert_array_equal(a, b)

    assert wrapped.unwrap() is model
    assert all(tf_hooks.strategy_of(v.value) is None for v in state)


CASES = [(name, n, reducer) for name in DEEP for n, reducer in DEEP[name].replicas]


@pytest.fixture
def cleared_after():
    """Keras' and TensorFlow's state of a deep model's test cleared after it: what a deep model
    leaves in the process (Keras' global state, TensorFlow's graphs and kernel caches) slows every
    test the process runs after it (21 features: 45-47 s after DenseNet121, 40-41 s before it or
    after `clear_session`)."""
    yield
    keras.backend.clear_session()  # and a garbage collection


@pytest.mark.usefixtures("cleared_after")
@pytest.mark.parametrize("name, n, reducer", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_deep_model_trains_as_on_one_device(name, n, reducer):
    """2 epochs of batches of 7 rows (not divisible by 2 or 3: uneven shares), MobileNetV2's with
    a final batch of 1 row (`Deep.replicas`: the replica counts and reducers each model trains
    on)."""
    deep = DEEP[name]
    weights, history = deep_reference(name)
    with precision(deep.floatx):
        model = kmirror.wrap(deep.build(), reducer, devices=cpus(n))
        trained = deep.fit(model)
    assert {w.dtype for w in model.weights if "float" in w.dtype} == {deep.floatx}
    difference = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), weights))
    assert difference < deep.tolerance
    assert_same_history(history, trained, rtol=deep.tolerance, atol=deep.tolerance)


@pytest.mark.parametrize("n", [2, 3])
def test_transfer_learning_flow_trains_as_on_one_device(n):
    """Freeze the base, train the head, unfreeze the base through the user's reference, compile
    the wrapped model again with a small learning rate, fine-tune: the base trains."""
    weights, history, base_weights = transfer_reference()
    model, base = transfer_model()
    frozen = base.get_weights()
    wrapped = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(n))
    trained = transfer_flow(wrapped, base)

    difference = max(float(np.abs(a - b).max()) for a, b in zip(wrapped.get_weights(), weights))
    assert difference < TRANSFER_TOLERANCE
    assert_same_history(history, trained, rtol=TRANSFER_TOLERANCE, atol=TRANSFER_TOLERANCE)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(base.get_weights(), frozen))
    assert moved > 1e-4, "fine-tuning trained the user's base"
    for a, b in zip(base.get_weights(), base_weights, strict=True):
        np.testing.assert_allclose(a, b, atol=TRANSFER_TOLERANCE)
