"""Models kmirror must wrap as they are: custom layers and subclassed models without get_config,
and models with their own train_step (the Keras guides' patterns: a custom step, a GAN, a VAE).

Each builder returns a compiled model, seeded, so that a wrapped copy and a single-device copy
train side by side (tests/features.py lists them in the exactness matrix).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from models import N_SAMPLES, optimizer

LATENT, PIXELS = 4, 16


class Scale(keras.layers.Layer):
    """A custom layer written the usual way: constructor arguments, no get_config."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.scale * self.factor


def custom_layer():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            Scale(0.5),
            keras.layers.Dense(3),
        ]
    )
    return _compiled(model)


class Net(keras.Model):
    """A subclassed model with constructor arguments and no get_config."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden = keras.layers.Dense(hidden, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


def subclassed_without_config():
    keras.utils.set_random_seed(1)
    return _compiled(Net(16))


def _compiled(model, opt="sgd"):
    model.compile(
        optimizer=optimizer(opt),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class GuideStep(keras.Model):
    """The "Customizing what happens in fit()" guide's train_step."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def guide_step():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = keras.layers.Dropout(0.2)(hidden)
    return _compiled(GuideStep(inputs, keras.layers.Dense(3)(hidden)), opt="adam")


class OwnEvaluation(keras.Model):
    """A model with its own test_step and predict_step."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred) + ops.mean(ops.abs(y_pred))
        self.loss_tracker.update_state(loss)
        self.accuracy.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "accuracy": self.accuracy.result()}

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return ops.softmax(self(x, training=False))

    @property
    def metrics(self):
        return [self.loss_tracker, self.accuracy]


def own_evaluation():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    model = OwnEvaluation(inputs, keras.layers.Dense(3)(keras.layers.Dense(16)(inputs)))
    model.loss_tracker = keras.metrics.Mean(name="loss")
    model.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    model.compile(
        optimizer=optimizer("sgd"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class GAN(keras.Model):
    """The Keras guide's GAN: two sub-models, two optimizers, two gradient steps per batch."""

    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def label_noise(self, shape):
        """The guide's noise on the labels, drawn with the model's seed generator."""
        return keras.random.uniform(shape, seed=self.seed_generator)

    def train_step(self, real):
        if isinstance(real, tuple):
            real = real[0]
        batch_size = ops.shape(real)[0]
        latent = keras.random.normal((batch_size, LATENT), seed=self.seed_generator)
        generated = self.generator(latent)
        combined = ops.concatenate([generated, real], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * self.label_noise(ops.shape(labels))
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        latent = keras.random.normal((batch_size, LATENT), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(latent))
            g_loss = self.loss_fn(ops.zeros((batch_size, 1)), predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def gan(model_class=None):
    keras.utils.set_random_seed(1)
    discriminator = keras.Sequential(
        [keras.Input((PIXELS,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    generator = keras.Sequential(
        [
            keras.Input((LATENT,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(PIXELS),
        ]
    )
    model = (model_class or GAN)(discriminator, generator)
    model.compile(
        d_optimizer=keras.optimizers.Adam(0.01),
        g_optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return model


class Sampling(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, inputs):
        mean, log_variance = inputs
        noise = keras.random.normal(ops.shape(mean), seed=self.seed_generator)
        return mean + ops.exp(0.5 * log_variance) * noise


class VAE(keras.Model):
    """The Keras guide's VAE: a reconstruction loss plus a KL term, three loss trackers."""

    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        if isinstance(data, tuple):
            data = data[0]
        with tf.GradientTape() as tape:
            mean, log_variance, latent = self.encoder(data)
            reconstruction = self.decoder(latent)
            reconstruction_loss = ops.mean(
                ops.sum(
                    keras.losses.binary_crossentropy(data[..., None], reconstruction[..., None]),
                    axis=1,
                )
            )
            kl = -0.5 * (1 + log_variance - ops.square(mean) - ops.exp(log_variance))
            kl_loss = ops.mean(ops.sum(kl, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {m.name: m.result() for m in self.metrics}


def vae():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((PIXELS,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    mean, log_variance = keras.layers.Dense(LATENT)(hidden), keras.layers.Dense(LATENT)(hidden)
    encoder = keras.Model(inputs, [mean, log_variance, Sampling()([mean, log_variance])])
    decoder = keras.Sequential(
        [
            keras.Input((LATENT,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(PIXELS, activation="sigmoid"),
        ]
    )
    model = VAE(encoder, decoder)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def images():
    """Pixels in [0, 1], no labels."""
    x = np.random.default_rng(4).uniform(size=(N_SAMPLES, PIXELS)).astype("float32")
    return x, None, None
