"""Own steps that work per row of the batch, as differentially private training (DP-SGD) does:
each builder returns a compiled model in float64, seeded (tests/features.py lists them in the
exactness matrix).

The private models (a dense layer, dropout, a dense layer) take each row's gradient (or each
group of rows'), clip it to a norm of 1, sum the clipped gradients, add noise drawn from a seed
generator the model holds, divide by the row count and apply the result; they log the mean
loss, the mean of the rows' gradient norms and the norm of the clipped sum. They differ in how
the per-row gradients are made:

- `vectorized`: `tf.vectorized_map` of a function calling the model on one row (`x[None]`) under
  a tape of its own, returning `tape.gradient`;
- `compiled`: the same in a nested `tf.function(jit_compile=True)` (TensorFlow Privacy's
  default);
- `mapped`: the same function through `tf.map_fn` (a loop over the rows);
- `jacobian`: the model called on the whole batch, `tape.jacobian` of the per-row losses;
- `microbatched`: rows grouped in fours (`tf.reshape(x, [-1, 4, d])`), each group's gradient by
  `keras.ops.vectorized_map` (trained on `grouped`: batches whose row counts divide by 4).

`tracked` is `vectorized` whose mapped function also updates a metric with its row's gradient norm
(state written with a value of the row: TensorFlow writes it once, with the first row's).

`carried` is a step whose loop (`tf.while_loop`) carries a state from row to row: a cell called
on each row and the state the previous row left, its outputs stacked and read by a head called on
them all, the gradient taken outside the loop.
"""

import keras
import numpy as np
import tensorflow as tf
from global_steps import FLOATX, WIDTH, unlabelled
from keras import layers as L
from keras import ops
from real_models import precision

CLIP, NOISE = 1.0, 0.05
GROUP = 4
STATE = 4


class Private(keras.Sequential):
    """DP-SGD: per-row gradients (`per_row`, of the subclass) clipped, summed, noised, applied."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.noise = keras.random.SeedGenerator(5)

    def _loss(self, x, y):
        """The squared error of each row of `x` (a batch)."""
        return ops.mean((self(x, training=True) - y) ** 2, axis=-1)

    def per_row(self, x, y, weights):
        """Each row's (or group's) gradient of its loss, stacked, and the losses."""
        raise NotImplementedError

    def _row(self, pair, weights):
        """One row's gradient of its loss, under a tape of its own, and the loss."""
        xi, yi = pair
        with tf.GradientTape() as tape:
            loss = self._loss(xi[None], yi[None])[0]
        return tape.gradient(loss, weights), loss

    def train_step(self, data):
        x, y = data
        weights = self.trainable_variables
        grads, losses = self.per_row(x, y, weights)
        squares = [tf.reduce_sum(tf.reshape(g, [tf.shape(g)[0], -1]) ** 2, 1) for g in grads]
        norms = tf.sqrt(tf.add_n(squares))
        factors = 1.0 / tf.maximum(norms / CLIP, 1.0)
        count = tf.cast(tf.shape(norms)[0], FLOATX)
        summed, noisy = [], []
        for grad, weight in zip(grads, weights):
            factor = tf.reshape(factors, [-1] + [1] * len(weight.shape))
            total = tf.reduce_sum(grad * factor, axis=0)
            draw = keras.random.normal(weight.shape, stddev=NOISE * CLIP, seed=self.noise)
            summed.append(total)
            noisy.append((total + tf.cast(draw, FLOATX)) / count)
        self.optimizer.apply_gradients(zip(noisy, weights))
        return {
            "loss": ops.mean(losses),
            "norm": ops.mean(norms),
            "clipped_norm": tf.linalg.global_norm(summed),
        }


class Vectorized(Private):
    def per_row(self, x, y, weights):
        def row(pair):
            return self._row(pair, weights)

        return tf.vectorized_map(row, (x, y))


class Tracked(Vectorized):
    """The mapped function updates a metric with its row's gradient norm."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.row_norm = keras.metrics.Mean(name="row_norm", dtype=FLOATX)

    def _row(self, pair, weights):
        grads, loss = super()._row(pair, weights)
        self.row_norm.update_state(tf.linalg.global_norm(grads))
        return grads, loss


class Compiled(Vectorized):
    """The per-row gradients in a nested `tf.function` compiled with XLA (TensorFlow Privacy's
    default)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.xla_per_row = tf.function(
            lambda x, y: super(Compiled, self).per_row(x, y, self.trainable_variables),
            jit_compile=True,
        )

    def per_row(self, x, y, weights):
        return self.xla_per_row(x, y)


class Mapped(Private):
    def per_row(self, x, y, weights):
        signature = ([tf.TensorSpec(w.shape, FLOATX) for w in weights], tf.TensorSpec((), FLOATX))

        def row(pair):
            return self._row(pair, weights)

        return tf.map_fn(row, (x, y), fn_output_signature=signature)


class Jacobian(Private):
    def per_row(self, x, y, weights):
        with tf.GradientTape() as tape:
            losses = self._loss(x, y)
        return tape.jacobian(losses, weights), losses


class Microbatched(Private):
    def per_row(self, x, y, weights):
        def group(pair):
            xg, yg = pair
            with tf.GradientTape() as tape:
                loss = ops.mean(self._loss(xg, yg))
            return tape.gradient(loss, weights), loss

        groups = (tf.reshape(x, [-1, GROUP, WIDTH]), tf.reshape(y, [-1, GROUP, 2]))
        return ops.vectorized_map(group, groups)


def private_model(model_class):
    """A model of `model_class` (a `Private`), seeded and compiled, in float64."""
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        model = model_class(
            [keras.Input((WIDTH,)), L.Dense(8, "tanh"), L.Dropout(0.25), L.Dense(2)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.5))
    return model


def vectorized():
    return private_model(Vectorized)


def mapped():
    return private_model(Mapped)


def tracked():
    return private_model(Tracked)


def compiled():
    return private_model(Compiled)


def jacobian():
    return private_model(Jacobian)


def microbatched():
    return private_model(Microbatched)


def grouped():
    """80 rows in batches of 36 (`GROUPED_BATCH`): a final batch of 8, groups of 4 rows."""
    x, _, _ = unlabelled(rows=80)
    return x, x @ np.linspace(-1, 1, WIDTH * 2).reshape(WIDTH, 2), None


GROUPED_BATCH = 36


class Carried(keras.Model):
    """A state carried from row to row through a loop of the step."""

    def __init__(self):
        super().__init__()
        self.cell = L.Dense(STATE, "tanh")
        self.head = L.Dense(2)
        self.cell.build((None, WIDTH + STATE))
        self.head.build((None, STATE))

    def call(self, x):
        return self.head(self._states(x)[0])

    def _states(self, x):
        rows = tf.shape(x)[0]

        def body(i, state, states):
            joined = tf.concat([x[i][None], state[None]], axis=-1)
            state = self.cell(joined)[0]
            return i + 1, state, states.write(i, state)

        start = (tf.constant(0), tf.zeros([STATE], FLOATX), tf.TensorArray(FLOATX, size=rows))
        _, last, states = tf.while_loop(lambda i, *_: i < rows, body, start)
        return states.stack(), last

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            states, last = self._states(x)
            loss = ops.mean((self.head(states) - y) ** 2)
        weights = self.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {"loss": loss, "last_state": ops.mean(last)}


def carried():
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        model = Carried()
        model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model
