"""A reduction over the rows of a layer call that is not a sum or a mean over all of them (a
standard deviation over groups of rows, a maximum, a sort) runs the layer's call on the whole
batch on every replica: training equals one device, in kmirror's step and in a model's own step,
with a final batch smaller than the replica count. Where the call's input holds the rows in
another axis it is refused at the first step, naming the layer and the operation, and the
weights are left as they were. The sums and means over the rows are in the exactness matrix
(tests/batch_steps.py); `predict` reduces over the whole batch too."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from batch_steps import compiled_batch_statistics
from conftest import cpus
from global_steps import labelled
from keras import layers as L
from keras import ops
from models import Weights, assert_same_history, max_weight_difference
from real_models import precision

import kmirror


class GroupedSpread(L.Layer):
    """The standard deviation over groups of 4 rows (a GAN discriminator's minibatch standard
    deviation, as progressive GANs write it): which rows a group holds depends on the replica."""

    def call(self, x):
        groups = tf.reshape(x, [4, -1, x.shape[-1]])
        spread = tf.reduce_mean(tf.math.reduce_std(groups, axis=0), axis=-1, keepdims=True)
        return ops.concatenate([x, tf.tile(spread, [4, 1])], axis=-1)


class Largest(L.Layer):
    def call(self, x):
        return x - ops.max(x, axis=0)


class Ranked(L.Layer):
    def call(self, x):
        return ops.sort(x, axis=0)


class TransposedLargest(L.Layer):
    """Given the rows in axis 1: its call cannot be joined from the replicas' rows."""

    def call(self, x):
        return ops.transpose(x - ops.max(x, axis=1, keepdims=True))


#: Each layer, and the global batches it trains on: 76 rows in batches of 36 (36, 36, 4: groups
#: of 4 rows on one device), else 74 (36, 36, 2: a replica without rows in the last).
WHOLE = {"GroupedSpread": (GroupedSpread, 76), "Largest": (Largest, 74), "Ranked": (Ranked, 74)}


def _network(layer_class) -> keras.Model:
    keras.utils.set_random_seed(3)
    if layer_class is TransposedLargest:
        middle = [L.Lambda(ops.transpose), layer_class(name="coupled")]
    else:
        middle = [layer_class(name="coupled")]
    return keras.Sequential([keras.Input((5,)), L.Dense(4), *middle, L.Dense(1)])


class OwnStep(keras.Model):
    def __init__(self, layer_class):
        super().__init__()
        self.network = _network(layer_class)

    def call(self, x):
        return self.network(x)

    def train_step(self, data):
        x, y = data
        weights = self.network.trainable_variables
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(self.network(x, training=True) - y))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {"loss": loss}


def _model(layer_class, own_step: bool) -> keras.Model:
    model = OwnStep(layer_class) if own_step else _network(layer_class)
    model.compile(optimizer="sgd", loss=None if own_step else "mse")
    model(np.zeros((4, 5), keras.config.floatx()))
    return model


def _data(rows):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 5)), rng.normal(size=(rows, 1))


@pytest.mark.parametrize("own_step", [False, True], ids=["compiled", "own step"])
@pytest.mark.parametrize("name", sorted(WHOLE))
def test_a_reduction_over_the_rows_that_is_not_a_sum_runs_the_call_whole(name, own_step):
    """3 replicas, float64, 2 epochs: weights and logs within 1e-10 of one device."""
    layer_class, rows = WHOLE[name]
    x, y = _data(rows)
    with precision("float64"):
        reference = _model(layer_class, own_step)
        expected = reference.fit(x, y, batch_size=36, epochs=2, shuffle=False, verbose=0)
        wrapped = kmirror.wrap(_model(layer_class, own_step), devices=cpus(3))
        history = wrapped.fit(x, y, batch_size=36, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, wrapped) < 1e-10
    assert_same_history(expected.history, history.history, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("own_step", [False, True], ids=["compiled", "own step"])
def test_a_call_whose_input_holds_the_rows_in_another_axis_is_refused(own_step):
    x, y = (part.astype("float32") for part in _data(72))
    model = _model(TransposedLargest, own_step)
    before = Weights(model.get_weights())
    wrapped = kmirror.wrap(model, devices=cpus(3))
    with pytest.raises(ValueError, match="a maximum over axes") as raised:
        wrapped.fit(x, y, batch_size=36, epochs=1, verbose=0)
    message = str(raised.value)
    assert "layer 'coupled' (TransposedLargest)" in message
    assert "holds the rows in axes [1], not in axis 0" in message
    assert max_weight_difference(model, before) == 0.0


def test_predict_reduces_over_the_whole_batch():
    """`predict` of layers reducing over the rows of their call (tests/batch_steps.py): each
    batch's statistics are the whole batch's, with a batch of 2 rows on 3 replicas too."""
    x, _, _ = labelled()
    reference = compiled_batch_statistics()
    wrapped = kmirror.wrap(compiled_batch_statistics(), devices=["/cpu:0", "/cpu:1", "/cpu:2"])
    for batch_size in (33, 2):
        expected = reference.predict(x, batch_size=batch_size, verbose=0)
        predicted = wrapped.predict(x, batch_size=batch_size, verbose=0)
        np.testing.assert_allclose(predicted, expected, rtol=0, atol=1e-12)
