"""Programs whose layers leave something behind from their call, which the step reads: each
builder returns a compiled model in float64, seeded (tests/features.py lists them in the
exactness matrix).

- `vector_quantized`: a vector-quantized autoencoder (its quantizer adds its codebook and
  commitment losses with `add_loss`, each a mean over the call's rows), trained by an own step
  that adds `sum(self.autoencoder.losses)` to its reconstruction loss and logs them.
"""

import keras
import tensorflow as tf
from global_steps import FLOATX, LATENT, WIDTH
from keras import layers as L
from keras import ops
from real_models import precision


class Quantizer(L.Layer):
    """Each row's nearest code of a codebook; the codebook and commitment losses added."""

    def __init__(self, codes: int = 5, beta: float = 0.25, **kwargs):
        super().__init__(**kwargs)
        self.codes, self.beta = codes, beta

    def build(self, shape):
        initializer = keras.initializers.RandomUniform(-1.0, 1.0, seed=4)
        self.codebook = self.add_weight(shape=(shape[-1], self.codes), initializer=initializer)

    def call(self, x):
        distances = (
            ops.sum(ops.square(x), axis=1, keepdims=True)
            + ops.sum(ops.square(self.codebook), axis=0)
            - 2 * ops.matmul(x, self.codebook)
        )
        chosen = ops.one_hot(ops.argmin(distances, axis=1), self.codes, dtype=x.dtype)
        quantized = ops.matmul(chosen, ops.transpose(self.codebook))
        self.add_loss(self.beta * ops.mean(ops.square(ops.stop_gradient(quantized) - x)))
        self.add_loss(ops.mean(ops.square(quantized - ops.stop_gradient(x))))
        return x + ops.stop_gradient(quantized - x)


class VectorQuantized(keras.Model):
    def __init__(self):
        super().__init__()
        self.autoencoder = keras.Sequential(
            [
                keras.Input((WIDTH,)),
                L.Dense(LATENT),
                Quantizer(),
                L.Dense(8, "tanh"),
                L.Dense(WIDTH),
            ]
        )

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        weights = self.autoencoder.trainable_variables
        with tf.GradientTape() as tape:
            reconstruction = ops.mean(ops.square(self.autoencoder(x, training=True) - x))
            quantization = ops.sum(self.autoencoder.losses)
            loss = reconstruction + quantization
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {"loss": loss, "quantization": quantization}


def vector_quantized():
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        model = VectorQuantized()
        model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model
