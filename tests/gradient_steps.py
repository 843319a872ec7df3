"""Programs that read the gradient their step takes, or whose optimizer overrides how it applies
it: each builder returns a compiled model in float64, seeded (tests/features.py lists them in the
exactness matrix).

- `sharpness_aware`: the gradient's global norm, the weights moved by `rho * grad / norm`, the
  gradient taken again there, the weights moved back, then applied;
- `clipped_by_hand`: an LSTM whose step clips by `tf.clip_by_global_norm`, the norm and one
  entry of the clipped gradient logged;
- `accumulated_by_hand`: the gradients added into variables of the model's own (raw
  `tf.Variable`s or Keras variables), a step counter, applied every 3 steps under `tf.cond` or
  every step times a 0/1 flag; the counter and the pending accumulators logged;
- `centralized`: an optimizer that overrides `apply_gradients` (gradient centralization), on a
  compiled model;
- `two_optimizers`: two models trained from one persistent tape asked twice, one optimizer that
  overrides `apply_gradients` and one that overrides `apply`; compiled again with new
  optimizers between two `fit` calls (`recompile`).
"""

import keras
import numpy as np
import tensorflow as tf
from global_steps import FLOATX, LATENT, WIDTH
from keras import layers as L
from keras import ops
from real_models import precision


def _regression(model_class, *args, optimizer=None, **kwargs):
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        model = model_class(
            [keras.Input((WIDTH,)), L.Dense(8, "tanh"), L.Dense(2)], *args, **kwargs
        )
        model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss="mse")
    return model


class SharpnessAware(keras.Sequential):
    """Sharpness-aware minimisation: the update is the gradient at the weights moved uphill."""

    rho = 0.05

    def train_step(self, data):
        x, y = data
        weights = self.trainable_variables
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, weights)
        norm = tf.linalg.global_norm(grads)
        moves = [self.rho * g / (norm + 1e-12) for g in grads]
        for weight, move in zip(weights, moves):
            weight.assign_add(move)
        with tf.GradientTape() as tape:
            sharp = self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(sharp, weights)
        for weight, move in zip(weights, moves):
            weight.assign_sub(move)
        self.optimizer.apply_gradients(zip(grads, weights))
        return {"loss": loss, "sharp_loss": sharp, "norm": norm}


def sharpness_aware():
    return _regression(SharpnessAware)


class ClippedByHand(keras.Sequential):
    """Clips its gradient by its global norm itself, and logs the norm and a gradient."""

    clip = 0.5

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        clipped, norm = tf.clip_by_global_norm(grads, self.clip)
        self.optimizer.apply_gradients(zip(clipped, self.trainable_variables))
        return {"loss": loss, "norm": norm, "gradient": clipped[0][0, 0]}


def clipped_by_hand():
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        model = ClippedByHand([keras.Input((5, 3)), L.LSTM(6), L.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    return model


def sequences():
    x = np.random.default_rng(8).normal(size=(101, 5, 3))
    return x, np.stack([x[:, :, 0].sum(1), x[:, -1, 1]], axis=1), None


class AccumulatedByHand(keras.Sequential):
    """Adds each step's gradient into accumulators of its own and applies their mean every
    `STEPS` steps: under `tf.cond` (`conditional`), or every step times a 0/1 flag."""

    STEPS = 3  # 4 steps an epoch: the epochs end with 1, 2 and 0 steps pending

    def __init__(self, layers, conditional: bool, raw: bool):
        super().__init__(layers)
        self.conditional = conditional
        make = tf.Variable if raw else keras.Variable
        self.counter = make(0.0, trainable=False, dtype=FLOATX, name="counter")
        self.accumulators = [
            make(np.zeros(w.shape), trainable=False, dtype=FLOATX, name=f"pending_{i}")
            for i, w in enumerate(self.trainable_variables)
        ]

    def train_step(self, data):
        x, y = data
        weights = self.trainable_variables
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, weights)
        self.counter.assign_add(1.0)
        for pending, gradient in zip(self.accumulators, grads):
            pending.assign_add(gradient / self.STEPS)
        due = tf.equal(tf.math.floormod(self.counter, self.STEPS), 0.0)
        if self.conditional:
            tf.cond(due, self._apply, lambda: tf.constant(False))
        else:
            flag = tf.cast(due, FLOATX)
            self.optimizer.apply_gradients(
                [(pending * flag, w) for pending, w in zip(self.accumulators, weights)]
            )
            for pending in self.accumulators:
                pending.assign(pending * (1.0 - flag))
        pending = tf.add_n([tf.reduce_sum(tf.abs(p)) for p in self.accumulators])
        return {"loss": loss, "counter": self.counter + 0.0, "pending": pending}

    def _apply(self):
        pairs = [(tf.identity(p), w) for p, w in zip(self.accumulators, self.trainable_variables)]
        self.optimizer.apply_gradients(pairs)
        for pending in self.accumulators:
            pending.assign(tf.zeros_like(pending))
        return tf.constant(True)


def accumulated_by_hand(conditional: bool, raw: bool):
    return _regression(
        AccumulatedByHand,
        conditional,
        raw,
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
    )


class Centralized(keras.optimizers.RMSprop):
    """Gradient centralization: each kernel's gradient less its mean over the kernel's inputs."""

    def apply_gradients(self, grads_and_vars):
        centred = []
        for gradient, variable in grads_and_vars:
            if len(gradient.shape) > 1:
                axes = tuple(range(len(gradient.shape) - 1))
                gradient = gradient - ops.mean(gradient, axis=axes, keepdims=True)
            centred.append((gradient, variable))
        return super().apply_gradients(centred)


class Halved(keras.optimizers.SGD):
    """An optimizer that overrides `apply`: it applies half of each gradient."""

    def apply(self, grads, trainable_variables=None):
        return super().apply([g * 0.5 for g in grads], trainable_variables)


def centralized():
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        model = keras.Sequential([keras.Input((WIDTH,)), L.Dense(8, "tanh"), L.Dense(2)])
        model.compile(optimizer=Centralized(0.01), loss="mse", metrics=["mae"])
    return model


class TwoOptimizers(keras.Model):
    """An encoder and a decoder trained from one persistent tape, each by its own optimizer."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.Sequential([keras.Input((WIDTH,)), L.Dense(LATENT, "tanh")])
        self.decoder = keras.Sequential([keras.Input((LATENT,)), L.Dense(8), L.Dense(WIDTH)])

    def compile(self, encoder_optimizer, decoder_optimizer):
        super().compile()
        self.encoder_optimizer = encoder_optimizer
        self.decoder_optimizer = decoder_optimizer

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        with tf.GradientTape(persistent=True) as tape:
            code = self.encoder(x)
            decoded = ops.mean(ops.square(self.decoder(code) - x))
            spread = ops.mean(ops.square(ops.mean(code, axis=0)))  # codes centred over the batch
            loss = decoded + 0.1 * spread
        encoder_grads = tape.gradient(loss, self.encoder.trainable_weights)
        decoder_grads = tape.gradient(decoded, self.decoder.trainable_weights)
        del tape
        self.encoder_optimizer.apply_gradients(zip(encoder_grads, self.encoder.trainable_weights))
        self.decoder_optimizer.apply_gradients(zip(decoder_grads, self.decoder.trainable_weights))
        return {"loss": loss, "decoded": decoded}


def two_optimizers():
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        model = TwoOptimizers()
        model.compile(Centralized(0.01), Halved(0.1))
    return model


def recompile(model: keras.Model) -> None:
    """The second phase of a program trained in phases: new optimizers of Keras' own."""
    with precision(FLOATX):
        model.compile(keras.optimizers.Adam(0.005), keras.optimizers.SGD(0.05))
