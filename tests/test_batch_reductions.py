"""A reduction over the rows of a layer call that is not a sum or a mean over all of them (a
standard deviation over groups of rows, a maximum, a sort), and an op that combines the rows of
the call otherwise (a product over them, a softmax, a segment mean, a slice or a roll of them),
runs the layer's call on the whole batch on every replica: training equals one device, in
kmirror's step and in a model's own step, with a final batch smaller than the replica count.
Where the call's input holds the rows in another axis it is refused at the first step, naming
the layer and the operation, and the weights are left as they were. The sums and means over the
rows, and ops over the rows in a loop's body or a condition's branch and a convolution along the
rows, are in the exactness matrix (tests/batch_steps.py); `predict` reduces over the whole batch
too. In eager mode a reduction that may be over the rows is named in a warning."""

import functools
import warnings

import call_steps
import keras
import numpy as np
import pytest
import tensorflow as tf
from batch_steps import compiled_batch_statistics
from conftest import cpus
from global_steps import MeanSquareStep, labelled
from keras import layers as L
from keras import ops
from models import assert_same_history, max_weight_difference
from real_models import precision

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


class MaskedLargest(Largest):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True  # its output keeps its input's mask


class NoisyLargest(L.Layer):
    """Dropout, then a maximum over the rows: its seed generator is advanced once per step, as
    on one device, though its call's first attempt on the replica's rows drew too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dropout = L.Dropout(0.3, seed=4)

    def call(self, x, training=False):
        x = self.dropout(x, training=training)
        return x - ops.max(x, axis=0)


class Ranked(L.Layer):
    def call(self, x):
        return ops.sort(x, axis=0)


class CrossCorrelation(L.Layer):
    """The batch's cross-correlation `x^T x / n`, `n` its call's row count (a Barlow Twins-like
    loss term): a matrix product summing over the rows."""

    def call(self, x):
        count = ops.cast(ops.shape(x)[0], x.dtype)
        return ops.matmul(x, ops.matmul(ops.transpose(x), x) / count)


class RowAttention(L.Layer):
    """Each row attends to every row of the batch: rows paired, a softmax over the rows."""

    def call(self, x):
        return ops.matmul(ops.softmax(ops.matmul(x, ops.transpose(x)), axis=-1), x)


class Differences(L.Layer):
    """Each row less the row before it in the batch (slices by the rows' place)."""

    def call(self, x):
        return ops.concatenate([x[:1] * 0, x[1:] - x[:-1]], axis=0)


class SegmentCentred(L.Layer):
    """Each row less the mean of the rows in its segment (`tf.math.unsorted_segment_mean`)."""

    def call(self, x):
        segments = ops.cast(x[:, 0] > 0, "int32")
        means = tf.math.unsorted_segment_mean(x, segments, 2)
        return x - tf.gather(means, segments)


class Rolled(L.Layer):
    """Each row times the row before it, the first times the last (`tf.roll` over the rows)."""

    def call(self, x):
        return x * tf.roll(x, 1, axis=0)


class CountedCentred(L.Layer):
    """Each row less the batch's sum over its call's row count, cast to a number."""

    def call(self, x):
        return x - ops.sum(x, axis=0) / ops.cast(ops.shape(x)[0], x.dtype)


class Placed(L.Layer):
    """The batch's first row set to zeros (a scatter), plus its second row (a `gather_nd`)."""

    def call(self, x):
        first = tf.tensor_scatter_nd_update(x, [[0]], tf.zeros((1, 4), x.dtype))
        return first + tf.gather_nd(x, [[1]])


#: Layers combining the rows of their call, each in one network (a tanh `Dense` after each).
MIXING = (CrossCorrelation, RowAttention, Differences, SegmentCentred, Rolled)
MIXING += (CountedCentred, Placed)


class TransposedLargest(L.Layer):
    """Given the rows in axis 1 (by a `Lambda` before it), it takes each feature's maximum over
    them: its call cannot be joined from the replicas' rows, so the call around it runs whole."""

    def call(self, x):
        return ops.transpose(x - ops.max(x, axis=1, keepdims=True))


@tf.function
def _centred(x):
    return x - tf.reduce_mean(x, axis=0)


class TracedCentred(L.Layer):
    """Each row less the mean of the rows, in a `tf.function` of its own: traced by the model
    one device trains first, then reused (its ops not made again) by the replicas' calls."""

    def call(self, x):
        return _centred(x)


#: Each layer, and the global batches it trains on: 76 rows in batches of 36 (36, 36, 4: groups
#: of 4 rows on one device), else 74 (36, 36, 2: a replica without rows in the last).
WHOLE = {"GroupedSpread": (GroupedSpread, 76), "Largest": (Largest, 74), "Ranked": (Ranked, 74)}
WHOLE["NoisyLargest"] = (NoisyLargest, 74)
# Its input holds the rows in axis 1, where the replicas cannot join them: the call around it
# (the model) runs whole. Before, it was refused, though one device runs it.
WHOLE["TransposedLargest"] = (TransposedLargest, 74)
WHOLE["mixing ops"] = (MIXING, 74)
WHOLE["TracedCentred"] = (TracedCentred, 74)


def _network(layer_class) -> keras.Model:
    keras.utils.set_random_seed(3)
    if layer_class is TransposedLargest:
        middle = [L.Lambda(ops.transpose), layer_class(name="coupled")]
    elif layer_class is MIXING:
        middle = [layer for each in layer_class for layer in (each(), L.Dense(4, "tanh"))]
    else:
        middle = [layer_class(name="coupled")]
    return keras.Sequential([keras.Input((5,)), L.Dense(4), *middle, L.Dense(1)])


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
        return {"error": loss}  # logged as it is (Keras logs its own loss tracker for "loss")


def _model(layer_class, own_step: bool, built_on: int = 4) -> keras.Model:
    model = OwnStep(layer_class) if own_step else _network(layer_class)
    model.compile(optimizer="sgd", loss=None if own_step else "mse")
    model(np.zeros((built_on, 5), keras.config.floatx()))
    return model


def _data(rows):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 5)), rng.normal(size=(rows, 1))


@pytest.mark.parametrize("own_step", [False, True], ids=["compiled", "own step"])
@pytest.mark.parametrize("name", sorted(WHOLE))
def test_a_reduction_over_the_rows_that_is_not_a_sum_runs_the_call_whole(name, own_step):
    """3 replicas, float64, 2 epochs: weights and logs within 1e-10 of one device."""
    layer_class, rows = WHOLE[name]
    x, y = _data(rows)
    with precision("float64"):
        reference = _model(layer_class, own_step)
        expected = reference.fit(x, y, batch_size=36, epochs=2, shuffle=False, verbose=0)
        wrapped = kmirror.wrap(_model(layer_class, own_step), devices=cpus(3))
        history = wrapped.fit(x, y, batch_size=36, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, wrapped) < 1e-10
    assert_same_history(expected.history, history.history, rtol=1e-10, atol=1e-10)


class PlacedState(L.Layer):
    """Each row paired by its place in the batch with a row of a table the layer holds, as many
    as the batch's rows, and with a state it carries from batch to batch (as a stateful RNN)."""

    def build(self, shape):
        self.table = self.add_weight(shape=(35, shape[-1]), initializer="glorot_uniform")
        self.carried = self.add_weight(shape=(35, shape[-1]), initializer="zeros", trainable=False)

    def call(self, x):
        paired = x * self.table + self.carried
        self.carried.assign(ops.tanh(paired))
        return paired


@pytest.mark.parametrize("own_step", [False, True], ids=["compiled", "own step"])
def test_a_call_pairing_its_rows_with_held_values_by_place_runs_whole(own_step):
    """Batches of 35 (11, 12 and 12 rows on 3 replicas): row i of the batch is paired with row i
    of the table and of the carried state on one device, so the call runs on the whole batch.
    Float64, 2 epochs: weights, the carried state and the logs within 1e-10 of one device."""
    x, y = _data(70)
    with precision("float64"):
        reference, wrapped = (_model(PlacedState, own_step, built_on=35) for _ in range(2))
        expected = reference.fit(x, y, batch_size=35, epochs=2, shuffle=False, verbose=0)
        wrapped = kmirror.wrap(wrapped, devices=cpus(3))
        history = wrapped.fit(x, y, batch_size=35, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, wrapped) < 1e-10
    assert_same_history(expected.history, history.history, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("own_step", [False, True], ids=["compiled", "own step"])
def test_a_call_reading_its_row_count_is_exact_on_batches_of_a_known_size(own_step):
    """Batches of 36 rows the traced step knows (a dataset's `drop_remainder`): a replica's rows
    still do not know their count, so the layer's cast of it runs the call whole, as above."""
    x, y = _data(72)
    with precision("float64"):
        batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(36, drop_remainder=True)
        reference = _model(CountedCentred, own_step)
        expected = reference.fit(batches, epochs=2, verbose=0)
        wrapped = kmirror.wrap(_model(CountedCentred, own_step), devices=cpus(3))
        history = wrapped.fit(batches, epochs=2, verbose=0)
    assert max_weight_difference(reference, wrapped) < 1e-10
    assert_same_history(expected.history, history.history, rtol=1e-10, atol=1e-10)


class RowsCounted(L.Layer):
    """A running count of the rows its calls saw, with `aggregation`: a cast of its row count."""

    def __init__(self, aggregation, **kwargs):
        super().__init__(**kwargs)
        self.aggregation = aggregation

    def build(self, shape):
        self.counted = self.add_weight(
            shape=(), initializer="zeros", trainable=False, aggregation=self.aggregation
        )

    def call(self, x):
        self.counted.assign_add(ops.cast(ops.shape(x)[0], self.counted.dtype))
        return x


@pytest.mark.parametrize("own_step", [False, True], ids=["compiled", "own step"])
def test_what_a_call_run_whole_writes_is_written_once_whatever_its_aggregation(own_step):
    """3 replicas, 74 rows in batches of 36: every replica writes the batch's count, as one
    device does; a "sum" weight adds it once, not once per replica."""
    x, y = _data(74)
    for aggregation in ("sum", "mean", "only_first_replica", "none"):
        counted = []
        for wrapped in (False, True):
            model = _model(functools.partial(RowsCounted, aggregation), own_step)
            network = model.network if own_step else model
            model = kmirror.wrap(model, devices=cpus(3)) if wrapped else model
            model.fit(x, y, batch_size=36, epochs=2, shuffle=False, verbose=0)
            counted.append(float(network.get_layer("coupled").counted.numpy()))
        assert counted == [4 + 148.0] * 2, aggregation  # `_model`'s build call of 4 rows too


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


def test_a_call_run_whole_keeps_the_mask_of_its_rows():
    """Token rows with padding (`mask_zero`) through a call run whole (a maximum over the rows):
    the loss is masked as on one device (the mask joined with the rows, and taken with them)."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 6, size=(74, 7))
    tokens[:, 5:] = 0  # padding
    labels = rng.integers(0, 3, size=(74, 7))

    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((7,), dtype="int32"),
                L.Embedding(6, 4, mask_zero=True),
                MaskedLargest(),
                L.Dense(3),
            ]
        )
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
        return model

    with precision("float64"):
        reference = build()
        expected = reference.fit(tokens, labels, batch_size=36, epochs=2, shuffle=False, verbose=0)
        wrapped = kmirror.wrap(build(), devices=cpus(3))
        history = wrapped.fit(tokens, labels, batch_size=36, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, wrapped) < 1e-10
    assert_same_history(expected.history, history.history, rtol=1e-10, atol=1e-10)


class MeanOfRows(L.Layer):
    """The mean of the rows of its call added to each row."""

    def call(self, x):
        return x + ops.mean(x, axis=0)


class AttendingRows(L.Layer):
    """Each row attends to every row of its call: a product of the rows with each other, a
    softmax over them, a product summing over them (no reduction: `mixing`'s rules)."""

    def call(self, x):
        scores = ops.matmul(x, ops.transpose(x))
        return x + ops.matmul(ops.softmax(scores, axis=-1), x)


class OwnEvaluation(MeanSquareStep):
    """MeanSquareStep with its own test_step and predict_step too."""

    def test_step(self, data):
        x, y = data
        return {"loss": ops.mean(ops.square(self(x) - y))}

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return 2.0 * self(x)


#: Layers computing across the rows of their call, in ways a traced step's rules split (the
#: batch's moments, a mean of the rows), run whole (a product of the rows with each other, a
#: statistic of groups of rows) or, eagerly, cannot see (rows regrouped by a reshape, a
#: Keras softmax over the rows, computed on the rows moved to the last axis).
EAGER = {
    "statistics": lambda: [
        L.Dense(8),
        L.BatchNormalization(),
        MeanOfRows(),
        L.LayerNormalization(),
    ],
    "attention": lambda: [L.Dense(4), AttendingRows()],
    "groups": lambda: [L.Dense(8), GroupedSpread(), L.Softmax(axis=0)],
}


@pytest.mark.parametrize("own_step", [False, True], ids=["compiled", "own steps"])
@pytest.mark.parametrize("name", sorted(EAGER))
def test_eager_steps_are_one_devices_in_fit_evaluate_and_predict(name, own_step):
    """In eager mode (`run_eagerly=True`) no graph says what a call computes across its rows:
    every call runs whole on every replica, and `fit` (with validation), `evaluate` and
    `predict` give one device's values, with no warning. 3 replicas, batches of 16 of 37 rows
    (a final batch of 5: shares of 1 and 2 rows; of 32 for groups of 4), float64, within 1e-10.
    Before, each replica computed across its own rows, with a warning."""
    x, y = _data(32 if name == "groups" else 37)  # groups of 4 rows: batches of 16
    results = []
    for replicas in (None, 3):  # None: one device
        keras.utils.set_random_seed(1)
        with precision("float64"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layers = [keras.Input((x.shape[1],)), *EAGER[name](), L.Dense(y.shape[1])]
            model = OwnEvaluation(layers) if own_step else keras.Sequential(layers)
            model.compile(optimizer="sgd", loss=None if own_step else "mse", run_eagerly=True)
            if replicas:
                model = kmirror.wrap(model, devices=cpus(replicas))
            history = model.fit(
                x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, validation_data=(x, y)
            )
            evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
            predicted = model.predict(x, batch_size=16, verbose=0)
        named = [str(w.message) for w in caught if "kmirror" in str(w.message)]
        results.append((model.get_weights(), history.history, evaluated, predicted, named))
    (weights, history, evaluated, predicted, _), (*wrapped, named) = results
    assert named == []
    assert max(np.max(np.abs(a - b)) for a, b in zip(weights, wrapped[0])) < 1e-10
    assert_same_history(history, wrapped[1], rtol=1e-10, atol=1e-10)
    assert evaluated.keys() == wrapped[2].keys()
    assert all(abs(evaluated[k] - wrapped[2][k]) < 1e-10 for k in evaluated)
    assert np.max(np.abs(predicted - wrapped[3])) < 1e-10


def test_an_eager_step_calling_a_layer_on_data_the_model_holds_is_one_devices():
    """A model's own step calling its layer on a graph the model holds (40 nodes) for a batch
    of 9 node indices, in eager mode, on 2 replicas: the call runs whole, as traced (the
    exactness matrix's `own_step_held_graph`). Before, the call's rows were taken from its first
    input, each replica's part of the nodes, and the lookup of a node outside it failed."""
    nodes, labels, _ = call_steps.node_batches()
    weights = []
    for replicas in (None, 2):
        model = call_steps.node_classifier()
        model.compile(optimizer=model.optimizer, run_eagerly=True)
        if replicas:
            model = kmirror.wrap(model, devices=cpus(replicas))
        with precision("float64"):
            model.fit(nodes[:18], labels[:18], batch_size=9, epochs=1, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    assert max(np.max(np.abs(a - b)) for a, b in zip(*weights)) < 1e-10


def test_explain_says_which_calls_run_whole_and_why_and_counts_the_sums():
    """`explain` traces a step on a batch and reports what it does where, changing nothing: the
    model's call split over the replicas' rows, the call grouping its rows run whole (naming
    the statistic), BatchNormalization's two sums (its mean and variance) in training and none
    in inference; a model none of whose calls needs the whole batch runs none whole."""
    x, y = _data(36)
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            L.Dense(8),
            L.BatchNormalization(name="normalized"),
            GroupedSpread(name="grouped"),
            L.Dense(1),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    wrapped = kmirror.wrap(model, devices=cpus(2))
    before = [w.numpy().copy() for w in model.weights]
    report = wrapped.explain(x, y, batch_size=16)
    assert report.split == [f"{model.name} (Sequential)"]
    assert [name for name, _ in report.whole] == ["grouped (GroupedSpread)"]
    assert "a standard deviation" in report.whole[0][1] or "a mean" in report.whole[0][1]
    assert report.sums == {"normalized (BatchNormalization)": 2} and report.collectives == 2
    assert "calls on the whole batch, on every replica: 1" in str(report)
    assert wrapped.explain(x, batch_size=16, step="predict").sums == {}
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights))
    with pytest.raises(ValueError, match="step must be one of"):
        wrapped.explain(x, y, step="fit")
    plain = keras.Sequential([keras.Input((5,)), L.Dense(8), L.Dropout(0.2), L.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse")
    assert kmirror.wrap(plain, devices=cpus(3)).explain(x, y, batch_size=16).whole == []
