"""A reduction over the rows of a layer call that kmirror cannot make the whole batch's is refused
at the first step, naming the layer and the operation, in kmirror's step and in a model's own
step, and leaves the model's weights as they were. The reductions it makes the whole batch's are
in the exactness matrix (tests/batch_steps.py); `predict` reduces over the whole batch too."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from batch_steps import compiled_batch_statistics
from global_steps import labelled
from keras import layers as L
from keras import ops
from models import Weights, max_weight_difference

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


REFUSED = {
    "GroupedSpread": (GroupedSpread, "a mean over some of the axes that hold the rows"),
    "Largest": (Largest, "a maximum over the rows of its call"),
    "Ranked": (Ranked, "a top-k or a sort over the rows of its call"),
}


def _network(layer_class) -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [keras.Input((5,)), L.Dense(4), layer_class(name="coupled"), L.Dense(1)]
    )


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
    model(np.zeros((4, 5), "float32"))
    return model


@pytest.mark.parametrize("own_step", [False, True], ids=["compiled", "own step"])
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_reduction_over_the_rows_that_is_not_a_sum_is_refused(name, own_step):
    layer_class, message = REFUSED[name]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(72, 5)).astype("float32"), rng.normal(size=(72, 1)).astype("float32")
    model = _model(layer_class, own_step)
    # One device trains it (a batch of 36 rows: 9 groups of 4).
    model.fit(x, y, batch_size=36, epochs=1, verbose=0)
    before = Weights(model.get_weights())
    wrapped = kmirror.wrap(model, devices=["/cpu:0", "/cpu:1", "/cpu:2"])  # 12 rows each
    with pytest.raises(ValueError, match=message) as raised:
        wrapped.fit(x, y, batch_size=36, epochs=1, verbose=0)
    assert "layer 'coupled'" in str(raised.value)
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
