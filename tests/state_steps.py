"""Programs keeping state where no walk of the model looks: each builder returns a compiled model in
float64, seeded (tests/features.py lists them in the exactness matrix, which compares every
optimizer's variables too, an optimizer's inner one included).

- `lookahead`: an optimizer of the user's holding another (Lookahead: an inner Adam it makes and
  builds at its first update, slow weights of its own pulled towards the fast ones every 3 steps
  under `tf.cond`), compiled;
- `lookahead_own_step`: the same applied by a model's own `train_step`;
- `raw_buffers`: an optimizer keeping raw `tf.Variable`s among its variables (a running average of
  each weight, tracked with `_track_variable`, as a Ranger optimizer keeps its slow buffers);
- `noisy_gradients`: annealed gradient noise from an object that is not a layer, holding its own
  `keras.random.SeedGenerator`, added in a model's own `train_step`;
- `added_loss`: `self.add_loss` in a model's own `train_step`, outside any layer call, read back
  through `compute_loss` with an L2 regularizer's loss;
- `python_draws` (compiled) and `python_draws_own_step`: a layer of the user's drawing from
  Python's `random` and NumPy's global generator while its call is traced (as Keras' AugMix
  picks its chains), with Adam: one device traces the step twice (its first trace builds Adam),
  and the graph that runs holds the second trace's draws; `aug_mix`: Keras' AugMix itself, in
  float32 on 8 x 8 RGB images (`pictures`), with the accuracy metric.
"""

import contextlib
import random

import keras
import numpy as np
import tensorflow as tf
from global_steps import FLOATX, WIDTH
from keras import layers as L
from keras import ops
from models import Crash, CrashAt
from real_models import precision

SYNC_EVERY = 3


class Lookahead(keras.optimizers.Optimizer):
    """Slow weights pulled halfway towards an inner Adam's fast weights every `SYNC_EVERY` steps;
    the inner Adam is made and built at the first update."""

    def __init__(self, name="lookahead", **kwargs):
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self.inner = None

    def build(self, variables):
        super().build(variables)
        self.slow = [self.add_variable_from_reference(v, "slow") for v in variables]
        for slow, variable in zip(self.slow, variables):
            slow.assign(variable)

    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables)
        if not self.built:
            self.build(variables)
        if self.inner is None:
            self.inner = keras.optimizers.Adam(0.02)
        self.inner.apply(list(grads), variables)
        self.iterations.assign_add(1)

        def sync():
            for slow, variable in zip(self.slow, variables):
                slow.assign(slow + 0.5 * (variable - slow))
                variable.assign(slow)
            return tf.constant(True)

        tf.cond(self.iterations % SYNC_EVERY == 0, sync, lambda: tf.constant(False))


class RawBuffers(keras.optimizers.SGD):
    """SGD keeping a running average of each weight in a raw `tf.Variable` it tracks."""

    def build(self, variables):
        super().build(variables)
        self.average = []
        for variable in variables:
            raw = tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False)
            self._track_variable(raw)
            self.average.append(raw)

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)
        average = self.average[self._get_variable_index(variable)]
        average.assign(0.9 * average + 0.1 * variable)


class GradientNoise:
    """Annealed Gaussian noise for gradients: not a layer, it holds its own seed generator."""

    def __init__(self, stddev, seed):
        self.stddev = stddev
        self.seed = keras.random.SeedGenerator(seed)

    def __call__(self, grads, step):
        scale = self.stddev / (1.0 + tf.cast(step, FLOATX)) ** 0.55
        draw = [keras.random.normal(g.shape, dtype=FLOATX, seed=self.seed) for g in grads]
        return [g + scale * d for g, d in zip(grads, draw)]


class OwnStep(keras.Sequential):
    """A model's own step: the compiled loss, the gradients through `gradients`, applied."""

    def gradients(self, grads):
        return grads

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            predicted = self(x, training=True)
            loss = self.compute_loss(x, y, predicted)
        weights = self.trainable_variables
        grads = self.gradients(tape.gradient(loss, weights))
        self.optimizer.apply_gradients(zip(grads, weights))
        return {"objective": loss, "step": ops.cast(self.optimizer.iterations, FLOATX)}


class NoisyGradients(OwnStep):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.noise = GradientNoise(0.3, seed=4)

    def gradients(self, grads):
        return self.noise(grads, self.optimizer.iterations)


class AddedLoss(OwnStep):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            predicted = self(x, training=True)
            self.add_loss(0.1 * ops.mean(ops.square(predicted)))
            loss = self.compute_loss(x, y, predicted)
        weights = self.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {"objective": loss, "losses": ops.sum(ops.stack(self.losses))}


class TraceTimeDraws(L.Layer):
    """Scales its features, in an order: both drawn while its call is traced, fixed in the graph
    (an order from NumPy's global generator, a scale from Python's `random`)."""

    def call(self, x, training=False):
        if not training:
            return x
        order = np.random.permutation(WIDTH)
        scale = random.choice([0.5, 2.0, 3.0])
        return ops.take(x, order, axis=1) * scale


def _model(model_class, optimizer, regularizer=None, first=()):
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        model = model_class(
            [
                keras.Input((WIDTH,)),
                *first,
                L.Dense(8, "tanh", kernel_regularizer=regularizer),
                L.Dense(2),
            ]
        )
        model.compile(optimizer=optimizer, loss="mse")
    return model


def lookahead():
    return _model(keras.Sequential, Lookahead())


def lookahead_own_step():
    return _model(OwnStep, Lookahead())


def raw_buffers():
    return _model(keras.Sequential, RawBuffers(0.1))


def noisy_gradients():
    return _model(NoisyGradients, keras.optimizers.SGD(0.1))


def added_loss():
    return _model(AddedLoss, keras.optimizers.SGD(0.1), regularizer="l2")


def python_draws():
    return _model(keras.Sequential, keras.optimizers.Adam(0.01), first=[TraceTimeDraws()])


def python_draws_own_step():
    return _model(OwnStep, keras.optimizers.Adam(0.01), first=[TraceTimeDraws()])


def aug_mix():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            L.AugMix(seed=5),
            L.Rescaling(1 / 255.0),
            L.Conv2D(4, 3),
            L.Flatten(),
            L.Dense(4),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def pictures():
    rng = np.random.default_rng(5)
    return rng.uniform(0, 255, size=(47, 8, 8, 3)).astype("float32"), rng.integers(0, 4, 47), None


def fit_backed_up(model, feature, backup_dir, crash=None):
    """2 epochs of the feature's batches with kmirror's BackupAndRestore every 2 batches (each
    step its own call: the batches skipped on resume); `crash` (epoch, batch) stops it there."""
    import kmirror

    x, y, _ = feature.data()
    callbacks = [kmirror.callbacks.BackupAndRestore(backup_dir, save_freq=2)]
    callbacks += [CrashAt(*crash)] if crash else []
    with precision(FLOATX), contextlib.suppress(Crash):
        model.fit(x, y, batch_size=feature.batch_size, epochs=2, verbose=0, callbacks=callbacks)
    return model


def everything(model: keras.Model) -> list:
    """The weights, every optimizer's variables, and the noise's seed generator state."""
    from features import trained_state

    noise = getattr(model, "noise", None)
    seed = [] if noise is None else [noise.seed.state.numpy()]
    return trained_state(model) + seed
