"""Programs that compute where kmirror's rules used to end: each builder returns a compiled model
in float64, seeded (tests/features.py lists them in the exactness matrix), trained on
`global_steps`' data (101 rows in batches of 33: a final batch of 2).

- `quantized`: a vector quantizer between a convolutional encoder and a transposed
  convolution, in a model's own `train_step` (keras.io's VQ-VAE pattern): the quantizer flattens
  its input to one code vector per entry (`tf.reshape(x, [-1, d])`), looks each up in a codebook
  and reshapes the codes back to its input's shape (`tf.reshape(q, tf.shape(x))`), with a
  straight-through gradient; the rows stay in axis 0 through both reshapes.
- `kernel_distance`: an own `test_step` computing a metric from a sub-model's output with its
  static row count (`features.shape[0]`, `ops.eye(n)`: keras.io's DDIM kernel inception
  distance), validated on batches of a size the trace knows.
- `centred_evaluation`: a layer centring its call's rows (`x - mean(x, axis=0)`) in a model
  with its own `test_step` and `predict_step`, validated.
- `eager_minibatch_spread`: a critic with a minibatch standard deviation over groups of 2 rows
  and a generator, trained by a GAN step with `run_eagerly=True` (keras.io's StyleGAN sets it).
"""

import keras
import numpy as np
import tensorflow as tf
from global_steps import FLOATX, WIDTH, labelled
from keras import layers as L
from keras import ops
from real_models import precision


def _built(model_class, **compile_args):
    """`model_class()` seeded, in float64, compiled with Adam."""
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        model = model_class()
        model.compile(optimizer=keras.optimizers.Adam(0.01), **compile_args)
    return model


class CodeLookup(L.Layer):
    """Each entry's nearest code, straight through; the codebook and commitment losses added."""

    def build(self, shape):
        self.width = shape[-1]
        initializer = keras.initializers.RandomUniform(-1.0, 1.0, seed=3)
        self.codebook = self.add_weight(shape=(self.width, 6), initializer=initializer)

    def call(self, x):
        flat = tf.reshape(x, [-1, self.width])
        distances = (
            tf.reduce_sum(flat**2, axis=1, keepdims=True)
            + tf.reduce_sum(self.codebook**2, axis=0)
            - 2 * tf.matmul(flat, self.codebook)
        )
        codes = tf.one_hot(tf.argmin(distances, axis=1), 6, dtype=x.dtype)
        quantized = tf.reshape(tf.matmul(codes, self.codebook, transpose_b=True), tf.shape(x))
        self.add_loss(tf.reduce_mean((tf.stop_gradient(quantized) - x) ** 2))
        self.add_loss(0.25 * tf.reduce_mean((quantized - tf.stop_gradient(x)) ** 2))
        return x + tf.stop_gradient(quantized - x)


class Quantized(keras.Model):
    def __init__(self):
        super().__init__()
        self.encoder = keras.Sequential(
            [keras.Input((4, 4, 1)), L.Conv2D(3, 3, strides=2, padding="same", activation="tanh")]
        )
        self.quantizer = CodeLookup()
        self.decoder = keras.Sequential(
            [keras.Input((2, 2, 3)), L.Conv2DTranspose(1, 3, strides=2, padding="same")]
        )

    def call(self, x):
        return self.decoder(self.quantizer(self.encoder(x)))

    def train_step(self, data):
        x = data
        with tf.GradientTape() as tape:
            reconstruction = ops.mean((x - self(x)) ** 2)
            loss = reconstruction + sum(self.losses)
        weights = self.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {"reconstruction": reconstruction, "total": loss}


def quantized() -> keras.Model:
    return _built(Quantized)


def pictures():
    x, _, _ = labelled()
    tiles = np.random.default_rng(5).normal(size=(len(x), 4, 4, 1))
    return tiles, None, None


class KernelDistance(keras.Model):
    """An own `test_step` whose metric is computed with the batch's static row count."""

    def __init__(self):
        super().__init__()
        self.network = keras.Sequential([keras.Input((WIDTH,)), L.Dense(4), L.Dense(2)])
        self.features = keras.Sequential([keras.Input((2,)), L.Dense(3, activation="tanh")])
        self.distance = keras.metrics.Mean("distance")

    def call(self, x):
        return self.network(x)

    def test_step(self, data):
        x, y = data
        predicted = self(x)
        features = self.features(predicted)
        n = features.shape[0]  # a Python number in one device's trace
        kernel = ops.matmul(features, ops.transpose(features))
        off_diagonal = kernel * (1.0 - ops.eye(n, dtype=kernel.dtype))
        self.distance.update_state(ops.sum(off_diagonal) / (n * (n - 1)))
        return {"distance": self.distance.result(), "error": ops.mean((predicted - y) ** 2)}


def kernel_distance() -> keras.Model:
    return _built(KernelDistance, loss="mse")


def whole_batches():
    """Validation in batches of 33 rows, each of a size the trace knows."""
    x, y, _ = labelled()
    return tf.data.Dataset.from_tensor_slices((x[:66], y[:66])).batch(33, drop_remainder=True)


class Centre(L.Layer):
    def call(self, x):
        return x - ops.mean(x, axis=0)


class CentredEvaluation(keras.Model):
    """A layer centring its call's rows, in a model with its own test and predict steps."""

    def __init__(self):
        super().__init__()
        self.network = keras.Sequential([keras.Input((WIDTH,)), L.Dense(4), Centre(), L.Dense(2)])

    def call(self, x):
        return self.network(x)

    def test_step(self, data):
        x, y = data
        return {"error": ops.mean((self(x) - y) ** 2)}

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return 2.0 * self(x)


def centred_evaluation() -> keras.Model:
    return _built(CentredEvaluation, loss="mse")


class MinibatchSpread(L.Layer):
    """The standard deviation over groups of 2 rows (1 where the rows are odd), averaged over
    the features, one more feature of each row of its group."""

    def call(self, x):
        rows = tf.shape(x)[0]
        group = tf.where(rows % 2 == 0, 2, 1)
        grouped = tf.reshape(x, [group, -1, x.shape[-1]])
        spread = tf.sqrt(tf.math.reduce_variance(grouped, axis=0) + 1e-8)
        spread = tf.tile(tf.reduce_mean(spread, axis=-1, keepdims=True), [group, 1])
        return tf.concat([x, spread], axis=-1)


class EagerCritic(keras.Model):
    def __init__(self):
        super().__init__()
        self.critic = keras.Sequential(
            [keras.Input((WIDTH,)), L.Dense(4), MinibatchSpread(), L.Dense(1)]
        )
        self.generator = keras.Sequential([keras.Input((3,)), L.Dense(WIDTH)])
        self.seeds = keras.random.SeedGenerator(5)

    def call(self, x):
        return self.critic(x)

    def train_step(self, data):
        x = data
        noise = keras.random.normal((tf.shape(x)[0], 3), seed=self.seeds, dtype=x.dtype)
        with tf.GradientTape() as tape:
            real, fake = self.critic(x), self.critic(self.generator(noise))
            loss = ops.mean(ops.softplus(-real)) + ops.mean(ops.softplus(fake))
        weights = self.critic.trainable_variables + self.generator.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {"critic_loss": loss}


def eager_minibatch_spread() -> keras.Model:
    return _built(EagerCritic, run_eagerly=True)
