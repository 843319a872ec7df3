"""A replica that gets no rows changes nothing: a global batch with fewer rows than replicas (the
final batch of an epoch) trains, evaluates and predicts as on one device, whatever TensorFlow's
kernels return for an empty batch.

Every layer family trains on 3 replicas, 2 Horovod ranks and 2 ring workers with a final batch of
1 row (tests/features.py: "every_layer_family_*"); MobileNetV2 and the transfer-learning flow
likewise (tests/real_models.py). Here: TensorFlow's kernel bug itself, the depthwise convolutions
through every way kmirror computes a step, evaluate and predict, and the error a non-finite loss
gets in such a batch.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from features import FEATURES, ONE_ROW_LEFT, every_layer_family
from models import NAN_BATCH, assert_same_history, max_weight_difference
from own_steps import GuideStep
from real_models import precision

import kmirror

BATCH = 33  # ONE_ROW_LEFT rows: batches of 33, 33, 33 and 1


def test_tensorflow_returns_uninitialised_memory_for_an_empty_batchs_depthwise_filter_gradient():
    """TensorFlow's CPU kernel of `tf.nn.depthwise_conv2d`'s filter gradient leaves its output
    unwritten for a batch of 0 rows (TensorFlow 2.19 and 2.21): a buffer the allocator handed out
    before, filled here with 7.0, comes back as the gradient instead of 0. kmirror does not rely
    on it (`Rows.only_with_rows`); when this fails, TensorFlow returns 0: say so in
    docs/troubleshooting.md."""
    images = tf.zeros((0, 6, 6, 8), "float64")
    kernel = tf.Variable(tf.ones((3, 3, 8, 1), "float64"))
    found = []
    for _ in range(5):
        del found[:]
        filled = tf.fill((3, 3, 8, 1), tf.constant(7.0, "float64")) + 0.0
        del filled  # its buffer is free for the gradient's
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.depthwise_conv2d(images, kernel, [1, 1, 1, 1], "SAME"))
        found.append(tape.gradient(loss, kernel).numpy())
        if np.any(found[-1] != 0):
            break
    assert np.any(found[-1] != 0), (
        f"TensorFlow {tf.__version__} now returns 0 for an empty batch's depthwise filter "
        "gradient: update docs/troubleshooting.md (kmirror's masking stays for older versions)"
    )


def _depthwise(model_class=keras.Model, jit_compile=False):
    """MobileNet's and Xception's layers, in float64, with SGD."""
    keras.utils.set_random_seed(2)
    with precision("float64"):
        inputs = keras.Input((8, 8, 4))
        x = keras.layers.DepthwiseConv2D(3, padding="same")(inputs)
        x = keras.layers.SeparableConv2D(6, 3, strides=2)(x)
        x = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(x))
        model = model_class(inputs, keras.layers.Dense(3)(x))
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
    return model


def _images(rows=ONE_ROW_LEFT):
    rng = np.random.default_rng(7)
    return rng.normal(size=(rows, 8, 8, 4)), rng.integers(0, 3, rows)


def _fit(model, x, y):
    with precision("float64"):
        return model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0).history


STEPS = {
    "compiled": dict(),
    "own_train_step": dict(model_class=GuideStep),
    "xla": dict(jit_compile=True),
}


@functools.cache
def _depthwise_reference(step: str):
    """The depthwise model of `step` trained on one device: (model, history), once per process
    (the cases that split the rows and prefetch them share it)."""
    x, y = _images()
    reference = _depthwise(**STEPS[step])
    return reference, _fit(reference, x, y)


@pytest.mark.parametrize("prefetch", [False, True], ids=["split", "prefetched"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_depthwise_convolutions_train_as_on_one_device_when_replicas_get_no_rows(step, prefetch):
    """3 replicas, a final batch of 1 row (2 replicas without rows), 3 epochs: within 1e-10 of
    one device in float64 (measured 1e-16), in kmirror's step, a model's own train_step, each
    replica's pass compiled with XLA, rows split in the step or prefetched to the replicas."""
    x, y = _images()
    reference, expected = _depthwise_reference(step)
    model = kmirror.wrap(_depthwise(**STEPS[step]), devices=cpus(3), prefetch=prefetch)
    history = _fit(model, x, y)

    assert max_weight_difference(reference, model) < 1e-10
    assert_same_history(expected, history, rtol=1e-10, atol=1e-10)


def test_evaluate_and_predict_with_replicas_without_rows_equal_one_device():
    """Every layer family, a final batch of 1 row on 3 replicas."""
    build = FEATURES["every_layer_family_adam"]
    x, y, _ = build.data()
    reference = every_layer_family("adam")
    model = kmirror.wrap(every_layer_family("adam"), devices=cpus(3))
    with precision("float64"):
        kwargs = dict(batch_size=BATCH, verbose=0)
        expected = reference.evaluate(x, y, return_dict=True, **kwargs)
        actual = model.evaluate(x, y, return_dict=True, **kwargs)
        predicted, predicted_alone = model.predict(x, **kwargs), reference.predict(x, **kwargs)
    assert sorted(actual) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(actual[key], expected[key], rtol=1e-10, err_msg=key)
    assert predicted.shape == predicted_alone.shape == (ONE_ROW_LEFT, 3)
    np.testing.assert_allclose(predicted, predicted_alone, rtol=1e-10, atol=1e-12)


def test_a_non_finite_loss_in_a_batch_with_replicas_without_rows_says_they_added_nothing():
    """The final batch's 1 row is infinite: the error says the batch's rows and the replicas
    without rows, that those added nothing, and what avoids such batches."""
    x, y = _images(NAN_BATCH + 1)
    x[-1, 0, 0, 0] = np.inf
    model = kmirror.wrap(_depthwise(), devices=cpus(3))
    first_batch_only = _depthwise()
    kwargs = dict(batch_size=NAN_BATCH, epochs=1, shuffle=False, verbose=0)
    with precision("float64"):
        first_batch_only.fit(x[:NAN_BATCH], y[:NAN_BATCH], **kwargs)
        with pytest.raises(kmirror.errors.NonFiniteLoss) as error:
            model.fit(x, y, **kwargs)
    message = str(error.value)
    assert "at epoch 1, batch 2, a batch of 1 row(s) on 3 replicas" in message
    assert "The 2 replica(s) without rows added nothing" in message
    assert "drop_remainder=True" in message
    assert max_weight_difference(first_batch_only, model) < 1e-10, "the failed step updated nothing"


def _eager_model():
    keras.utils.set_random_seed(1)
    with precision("float64"):
        inputs = keras.Input((5, 3))
        lstm = keras.layers.LSTM(4, return_sequences=True)(inputs)
        x = keras.layers.Conv1D(3, 2)(lstm)
        hidden = keras.layers.GlobalMaxPooling1D()(x)
        model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    return model


def test_eager_steps_train_as_on_one_device_when_replicas_get_no_rows():
    """Eagerly (`run_eagerly=True`), Keras' LSTM cell and global max pooling fail on an empty
    batch of a known shape, and a float32 convolution on CPUs returns its input: a replica
    without rows computes on a row of zeros that is not its own (`placement.one_row_at_least`)."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(BATCH + 1, 5, 3)), rng.normal(size=(BATCH + 1, 2))
    reference = _eager_model()
    model = kmirror.wrap(_eager_model(), devices=cpus(3))
    histories = [_fit(m, x, y) for m in (reference, model)]
    assert max_weight_difference(reference, model) < 1e-10
    assert_same_history(*histories, rtol=1e-10, atol=1e-10)
    with precision("float64"):
        np.testing.assert_allclose(
            model.predict(x, batch_size=BATCH, verbose=0),
            reference.predict(x, batch_size=BATCH, verbose=0),
            atol=1e-10,
        )
