"""Programs whose layers reduce over the rows of their call: each builder returns a compiled model
in float64, seeded (tests/features.py lists them in the exactness matrix).

The layers, each computing from the whole batch of its call on one device:

- `BatchContext`: the batch's mean row, concatenated to each row;
- `BatchSpread`: the batch's standard deviation, averaged over the features, as one more feature
  of every row (a GAN discriminator's minibatch standard deviation, over the whole batch);
- `GroupedSpread`: the standard deviation over groups of rows, as a feature of each row of
  the group (kmirror runs its call whole: its groups hold rows of several replicas);
- `BatchStandardized`: a normalisation by the batch's moments (`tf.nn.moments` over axis 0),
  which adds a loss of the batch's mean activation (`add_loss` of a mean over its rows);
- `BatchAttention`: each row attends to every row of the batch (a product of the rows with
  each other, a softmax over the rows, a product summing over them; kmirror runs its call whole);
- `LoopCentred`: in a branch of `tf.cond`, its rows centred twice in a `tf.while_loop` by a
  layer the loop's body calls (a mean over the rows of the loop's variable), with the mean of the
  call's rows read by the body (no sum over the replicas can run there: kmirror runs the call of
  `LoopCentred` whole);
- `RowConvolution`: a convolution along the rows, the batch taken as one sequence, and a pooling
  of them (kmirror runs its call whole);
- an `LSTM` over each row's features as a sequence, whose outputs a `BatchNormalization`
  normalises by the batch's moments: rows that leave a loop through a tensor list;
- an `RNN` whose cell centres its input, read from a tensor list in the loop's body, by the
  mean of the rows (kmirror runs the recurrent layer's call whole);
- `Rescaled`: each feature divided by its range over the rows, which a layer it calls returns
  (a statistic of the whole batch, not rows: kmirror runs the inner call whole, and every
  replica takes all of its output);
- `Spectrum`: a Fourier transform along the rows, and `FirstRowRelative`: each row less the
  first, split from the rest (ops of TensorFlow that no rule of kmirror names: it runs their
  calls whole).

`compiled_batch_statistics` stacks them in a compiled model (with validation data: the layers
reduce in inference too); `own_step_batch_statistics` all but the recurrent layers in a model an
own step calls, which reads the added loss through `model.losses` (where kmirror finds a call's
rows in a loop is the call's own, whatever step calls it: the recurrent layers, the costliest
to trace on every replica, are traced in one of the two).

The dense layers before a normalisation have no bias: the normalisation removes it, which leaves
its gradient the rounding of a sum, and Adam's step turns any such value into a step of the
learning rate's size, on one device as well.
"""

import keras
import tensorflow as tf
from global_steps import FLOATX, WIDTH
from keras import layers as L
from keras import ops
from real_models import precision


def _built(build):
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        return build()


class BatchContext(L.Layer):
    def call(self, x):
        mean = ops.mean(x, axis=0, keepdims=True)
        return ops.concatenate([x, ops.broadcast_to(mean, ops.shape(x))], axis=-1)


class BatchSpread(L.Layer):
    def call(self, x):
        spread = ops.mean(tf.math.reduce_std(x, axis=0))
        return ops.concatenate([x, ops.ones_like(x[:, :1]) * spread], axis=-1)


class GroupedSpread(L.Layer):
    """Groups of 3 rows, or 2, or 1, whichever divides the batch first, as progressive GANs
    write a minibatch standard deviation (a reshape to (group, rows / group, features)). A
    statistic of rows of other replicas: kmirror runs this call on the whole batch."""

    def call(self, x):
        rows = ops.shape(x)[0]
        group = ops.where(rows % 3 == 0, 3, ops.where(rows % 2 == 0, 2, 1))
        groups = ops.reshape(x, [group, -1, x.shape[-1]])
        spread = ops.mean(ops.std(groups, axis=0), axis=-1, keepdims=True)
        spread = ops.reshape(ops.tile(spread, [group, 1]), [-1, 1])  # static width on Keras 3.12
        return ops.concatenate([x, spread], axis=-1)


class BatchStandardized(L.Layer):
    def call(self, x):
        mean, variance = tf.nn.moments(x, axes=[0])
        self.add_loss(0.01 * tf.reduce_mean(tf.square(x)))
        return (x - mean) / tf.sqrt(variance + 1e-3)


class BatchAttention(L.Layer):
    def call(self, x):
        scores = ops.matmul(x, ops.transpose(x)) / ops.sqrt(ops.cast(x.shape[-1], x.dtype))
        return x + ops.matmul(ops.softmax(scores, axis=-1), x)


class Centred(L.Layer):
    def call(self, x):
        return x - ops.mean(x, axis=0)


class LoopCentred(L.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.centred = Centred()

    def call(self, x):
        def centred(i, v):
            return i + 1, self.centred(v) + 0.5 * ops.mean(x, axis=0)

        def loop():
            return tf.while_loop(lambda i, v: i < 2, centred, (0, x))[1]

        return tf.cond(ops.sum(x) > -1e9, loop, lambda: x)


class RowConvolution(L.Layer):
    def build(self, shape):
        self.kernel = self.add_weight(shape=(3, shape[-1], shape[-1]), name="kernel")

    def call(self, x):
        sequence = ops.conv(x[None], self.kernel, padding="same")
        return x + ops.max_pool(sequence, 2, 1, padding="same")[0]


class CentringCell(L.Layer):
    state_size = 3

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 3), name="kernel")
        self.recurrent = self.add_weight(shape=(3, 3), name="recurrent")

    def call(self, x, states):
        x = x - ops.mean(x, axis=0)
        output = ops.tanh(ops.matmul(x, self.kernel) + ops.matmul(states[0], self.recurrent))
        return output, [output]


class Spectrum(L.Layer):
    def call(self, x):
        rows = tf.transpose(x)
        spectrum = tf.signal.fft(tf.complex(rows, tf.zeros_like(rows)))
        return x + 0.05 * tf.transpose(tf.math.real(spectrum))


class RangeOfRows(L.Layer):
    def call(self, x):
        return ops.max(x, axis=0) - ops.min(x, axis=0)


class Rescaled(L.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.range = RangeOfRows()

    def call(self, x):
        return x / (1.0 + self.range(x))


class FirstRowRelative(L.Layer):
    def call(self, x):
        first, _ = tf.split(x, [1, -1], axis=0)
        return x - 0.5 * first


def _network(recurrent: bool) -> keras.Model:
    """The layers above in one model; the recurrent layers where `recurrent` (the compiled
    model's: what they prove is where a layer call's rows are, the same in an own step)."""
    layers = [
        keras.Input((WIDTH,)),
        L.Dense(8, use_bias=False),
        BatchStandardized(),
        L.Activation("tanh"),
        GroupedSpread(),
        BatchContext(),
        L.Dense(6, "tanh"),
        BatchAttention(),
        LoopCentred(),
        RowConvolution(),
    ]
    if recurrent:
        layers += [
            L.Reshape((3, 2)),
            L.LSTM(4, return_sequences=True),
            L.BatchNormalization(),
            L.RNN(CentringCell(), return_sequences=True),
            L.Flatten(),
        ]
    layers += [Spectrum(), Rescaled(), FirstRowRelative(), BatchSpread(), L.Dense(2)]
    return keras.Sequential(layers)


def compiled_batch_statistics() -> keras.Model:
    def build():
        model = _network(recurrent=True)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        return model

    return _built(build)


class OwnStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.network = _network(recurrent=False)

    def train_step(self, data):
        x, y = data
        weights = self.network.trainable_variables
        with tf.GradientTape() as tape:
            error = ops.mean(ops.square(self.network(x, training=True) - y))
            added = ops.sum(self.network.losses)
            loss = error + added
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {"loss": loss, "added": added}


def own_step_batch_statistics() -> keras.Model:
    def build():
        model = OwnStep()
        model.compile(optimizer=keras.optimizers.Adam(0.01))
        return model

    return _built(build)
