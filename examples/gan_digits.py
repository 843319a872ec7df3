"""A GAN with its own train_step (two sub-models, two optimizers), trained on 2 devices with kmirror
and on one device, side by side: the logged losses and the weights are the same.

    python examples/gan_digits.py [--epochs 5] [--devices 2]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import kmirror  # noqa: E402

LATENT = 8


def build_gan():
    import keras
    import tensorflow as tf
    from keras import ops

    class GAN(keras.Model):
        """The Keras guide's GAN, as written for one device."""

        def __init__(self, discriminator, generator):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.seed_generator = keras.random.SeedGenerator(1337)

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn
            self.d_loss_metric = keras.metrics.Mean(name="d_loss")
            self.g_loss_metric = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss_metric, self.g_loss_metric]

        def train_step(self, real):
            if isinstance(real, tuple):
                real = real[0]
            batch_size = ops.shape(real)[0]
            latent = keras.random.normal((batch_size, LATENT), seed=self.seed_generator)
            combined = ops.concatenate([self.generator(latent), real], axis=0)
            labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], 0)
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

    keras.utils.set_random_seed(0)
    discriminator = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)]
    )
    generator = keras.Sequential(
        [
            keras.Input((LATENT,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="sigmoid"),
        ]
    )
    gan = GAN(discriminator, generator)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(0.001),
        g_optimizer=keras.optimizers.Adam(0.001),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return gan


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    kmirror.devices.simulate(args.devices)

    import numpy as np
    from sklearn.datasets import load_digits

    x = (load_digits().data / 16.0).astype("float32")  # bundled with scikit-learn
    fit_args = dict(batch_size=100, epochs=args.epochs, shuffle=False, verbose=0)
    single = build_gan()
    expected = single.fit(x, **fit_args).history
    model = kmirror.wrap(build_gan(), reducer="auto")
    history = model.fit(x, **fit_args).history

    print(f"{model.reducer} over {model.num_replicas} replicas")
    print("| epoch | d_loss one device | d_loss kmirror | g_loss one device | g_loss kmirror |")
    print("|---|---|---|---|---|")
    for epoch in range(args.epochs):
        print(
            f"| {epoch + 1} | {expected['d_loss'][epoch]:.6f} | {history['d_loss'][epoch]:.6f} "
            f"| {expected['g_loss'][epoch]:.6f} | {history['g_loss'][epoch]:.6f} |"
        )
    difference = max(
        float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), single.get_weights())
    )
    print(f"largest weight difference to one device: {difference:.2e}")


if __name__ == "__main__":
    main()
