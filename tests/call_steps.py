"""Programs whose layers leave something behind from their call, which the step reads: each
builder returns a compiled model in float64, seeded (tests/features.py lists them in the
exactness matrix).

- `vector_quantized`: a vector-quantized autoencoder (its quantizer adds its codebook and
  commitment losses with `add_loss`, each a mean over the call's rows), trained by an own step
  that adds `sum(self.autoencoder.losses)` to its reconstruction loss and logs them.
- `gated`: a layer keeps its gates on itself (`self.gates = ...` in `call`), appends them to a
  list it holds (`self.seen`, every call's) and puts each row's spread in a dict it sets in the
  call (`self.latest = {}`); it also keeps statistics over the call's rows (each gate's mean on
  itself, their mean in the dict). Two more layers return statistics of their call's rows to the
  step: their mean (a scalar), each feature's standard deviation over them (a vector). The step
  adds them all to its loss.
- `node_classifier`: a graph the model holds (its nodes' features and its edges, in constants),
  passed whole through message passing on every step; the batch is node indices, gathered from
  the call's output. The layer also adds a loss of the nodes' states.
- `prototypes`: a call whose inputs mix the batch's rows and a table the model holds with as many
  rows as the batch (33 prototypes, batches of 33).
- `stateful_rnn`: a stateful LSTM (cross-batch statefulness, as Keras' RNN guide trains it): row
  i of each batch continues row i of the batch before, from states the layer holds in Keras
  variables it does not track, paired with the call's rows entry by entry; a compiled model.
"""

import keras
import numpy as np
import tensorflow as tf
from global_steps import FLOATX, LATENT, ROWS, WIDTH
from keras import layers as L
from keras import ops
from real_models import precision


def _built(model_class):
    """`model_class()` seeded, in float64, compiled with Adam."""
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        model = model_class()
        model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


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
    return _built(VectorQuantized)


class Gate(L.Layer):
    """Each row scaled by its gates; the gates kept on the layer, in a list and a dict."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []  # every call's gates (a Keras TrackedList)

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], shape[-1]), initializer="glorot_uniform")

    def call(self, x):
        self.gates = ops.sigmoid(ops.matmul(x, self.kernel))
        self.seen.append(self.gates)
        self.latest = {}
        self.latest["spread"] = ops.std(x, axis=-1)
        self.centre = ops.mean(self.gates, axis=0)  # over the call's rows: the whole batch's
        self.latest["centre"] = ops.mean(self.gates)
        return x * self.gates


class Summary(L.Layer):
    """Returns a statistic of its call's rows: their mean, or each feature's spread over them."""

    def __init__(self, statistic, **kwargs):
        super().__init__(**kwargs)
        self.statistic = statistic

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 3), initializer="glorot_uniform")

    def call(self, x):
        projected = ops.matmul(x, self.kernel)
        return ops.mean(projected) if self.statistic == "mean" else ops.std(projected, axis=0)


class Gated(keras.Model):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.net = keras.Sequential([keras.Input((WIDTH,)), self.gate, L.Dense(2)])
        self.mean_of_rows, self.spread_of_rows = Summary("mean"), Summary("std")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            error = ops.mean(ops.square(self.net(x, training=True) - y))
            openness = ops.mean(self.gate.gates)
            recent = ops.mean(self.gate.seen[-1]) + ops.mean(self.gate.latest["spread"])
            kept = ops.sum(ops.square(self.gate.centre)) + self.gate.latest["centre"]
            summary = self.mean_of_rows(x) + ops.sum(self.spread_of_rows(x))
            loss = error + 0.1 * openness + 0.05 * recent + 0.1 * kept + 0.01 * summary
        weights = self.trainable_variables  # the summaries' built by their first call
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {
            "loss": loss,
            "openness": openness,
            "recent": recent,
            "kept": kept,
            "summary": summary,
        }


def gated():
    return _built(Gated)


NODES, CLASSES = 40, 3


def _graph():
    rng = np.random.default_rng(5)
    features = rng.normal(size=(NODES, WIDTH))
    edges = rng.integers(0, NODES, size=(3 * NODES, 2))
    labels = np.argmax(features[:, :CLASSES], axis=1)
    return features, edges, labels


class MessagePassing(L.Layer):
    """Each node's state from its own features and the sum of its neighbours'."""

    def build(self, shapes):
        width = shapes[0][-1]
        self.own = self.add_weight(shape=(width, 8), initializer="glorot_uniform")
        self.neighbours = self.add_weight(shape=(width, 8), initializer="glorot_uniform")
        self.out = self.add_weight(shape=(8, CLASSES), initializer="glorot_uniform")

    def call(self, inputs):
        features, edges = inputs
        sent = ops.take(ops.matmul(features, self.neighbours), edges[:, 0], axis=0)
        received = tf.math.unsorted_segment_sum(sent, edges[:, 1], NODES)
        states = ops.tanh(ops.matmul(features, self.own) + received)
        self.add_loss(0.01 * ops.mean(ops.square(states)))
        return ops.matmul(states, self.out)


class NodeClassifier(keras.Model):
    def __init__(self):
        super().__init__()
        features, edges, _ = _graph()
        self.features = tf.constant(features, FLOATX)
        self.edges = tf.constant(edges, "int32")
        self.passing = MessagePassing()

    def train_step(self, data):
        nodes, labels = data
        with tf.GradientTape() as tape:
            logits = ops.take(self.passing([self.features, self.edges]), nodes, axis=0)
            error = ops.mean(
                keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            )
            states = ops.sum(self.passing.losses)
            loss = error + states
        weights = self.passing.trainable_variables  # built by its first call
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {"loss": loss, "states": states}


def node_classifier():
    return _built(NodeClassifier)


def node_batches():
    """Node indices (the batch) and their labels."""
    _, _, labels = _graph()
    nodes = np.random.default_rng(6).integers(0, NODES, size=ROWS)
    return nodes, labels[nodes], None


PROTOTYPES = 33


class Matcher(L.Layer):
    """Each row's logits: its similarity to every prototype, both projected alike."""

    def build(self, shapes):
        self.projection = self.add_weight(shape=(shapes[0][-1], 4), initializer="glorot_uniform")

    def call(self, inputs):
        rows, prototypes = inputs
        return ops.matmul(
            ops.matmul(rows, self.projection),
            ops.transpose(ops.matmul(prototypes, self.projection)),
        )


class Prototypes(keras.Model):
    def __init__(self):
        super().__init__()
        table = np.random.default_rng(7).normal(size=(PROTOTYPES, WIDTH))
        self.table = tf.constant(table, FLOATX)
        self.matcher = Matcher()

    def train_step(self, data):
        x, labels = data
        with tf.GradientTape() as tape:
            logits = self.matcher([x, self.table])
            loss = ops.mean(
                keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            )
        weights = self.matcher.trainable_variables  # built by its first call
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {"loss": loss}


def prototypes():
    return _built(Prototypes)


def nearest_prototype():
    """Rows labelled by their nearest prototype."""
    x = np.random.default_rng(8).normal(size=(ROWS, WIDTH))
    table = np.random.default_rng(7).normal(size=(PROTOTYPES, WIDTH))
    distances = ((x[:, None, :] - table[None]) ** 2).sum(-1)
    return x, np.argmin(distances, axis=1), None


STREAMS, STEPS = 7, 4  # batches of 7 streams (uneven over 2 and 3 replicas), every batch full


def stateful_rnn():
    keras.utils.set_random_seed(1)
    with precision(FLOATX):
        inputs = keras.Input((STEPS, 2), batch_size=STREAMS)
        carried = L.LSTM(6, stateful=True)(inputs)
        model = keras.Model(inputs, L.Dense(1)(carried))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def streams():
    """4 batches of 7 streams of 4 steps; each stream's target half its last step's first
    feature plus its first step's second feature."""
    x = np.random.default_rng(9).normal(size=(4 * STREAMS, STEPS, 2))
    return x, x[:, -1, :1] * 0.5 + x[:, 0, 1:], None
