"""Coverage measured against the op set, not against programs: every public function of
`keras.ops` (tests/op_coverage.py) applied to a tensor holding the rows of a layer call, each in a
layer of its own, its column of one model's output, in float64: trained by `fit`, then
`evaluate`d and `predict`ed, on 37 rows in batches of 17 (a final batch of 3: shares of 8 and 9
rows, then 2 and 1, on 2 replicas; of 5, 6 and 6, then 1 each, on 3). Each op scales the call's
values by a weight of its layer's own, which its gradient alone trains. In a compiled model and in
one with its own `train_step`, `test_step` and `predict_step`, traced on 3 replicas and eager on 2
and 3, every op's trained weight and predicted column, and the loss `fit` logs and `evaluate`'s,
equal one device's within 1e-10; an op one device cannot run in a traced model fails with the
same error on 2 and 3 replicas.

Traced, an op's rule (split over the replicas' rows, or run whole) does not depend on how many
replicas there are; on 3 the shares are uneven and one replica's rows lie between two others'.
Splitting a batch over 2 replicas is in the feature matrix (tests/test_features.py).

The totals (calls kmirror splits over the replicas' rows, runs whole, and errors) are printed at
the end of `make test-ops` (tests/conftest.py), and docs/concepts.md gives them.

What each op gives is turned into one value per row: an output with the batch's rows in axis 0
gives each row its own values' mean (a row paired with another's value, as an op over the rows
computed on a replica's rows would pair them, is caught); one with a multiple of the rows in all its
values (`ravel`) is read as rows the same way; one of a fixed size (a statistic over the rows) is
weighed entry by entry, so an entry computed in the wrong place is caught; any other, its mean,
given to every row.

`make test` checks the table names every function; `make test-ops` (which `.ci/run` runs) the
rest.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from keras import layers as L
from keras import ops
from op_coverage import NOT_A_TENSOR_MAP, OPS, Values, names
from real_models import precision
from shared_cache import shared

import kmirror
from kmirror._core.keras_hooks.explaining import recording

ROWS, BATCH = 37, 17
WIDTH = 8


def _variants() -> dict:
    """Every op variant of the table, by label."""
    found = {}
    for name, entry in sorted(OPS.items()):
        for variant, apply in (entry if isinstance(entry, dict) else {"": entry}).items():
            found[f"{name} ({variant})" if variant else name] = apply
    return found


def _float(tensor):
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype.is_complex:
        return tf.cast(tf.math.real(tensor) + tf.math.imag(tensor), "float64")
    return tf.cast(tensor, "float64")


def _kind(shapes: dict) -> str:
    """How an output is read, from its shapes on 5 and 11 rows (one device; more rows than
    features too)."""
    five, eleven = shapes[5], shapes[11]
    if len(five) and five[0] == 5 and eleven[0] == 11:
        return "rows"
    size5, size11 = int(np.prod(five)), int(np.prod(eleven))
    if size5 and size5 % 5 == 0 and size11 % 11 == 0 and size5 // 5 == size11 // 11:
        return "spread"
    return f"fixed {size5}" if five == eleven else "other"


@functools.cache
def _table() -> tuple[dict, dict]:
    """(the variants one device runs: label -> (apply, each output's kind, whether its values
    have a finite gradient), the variants one device cannot run in a traced model: label ->
    apply), from one device's run of each, traced with the row count unknown, on 5 and 11 rows
    (once in the run, by whichever test process asks first: tests/shared_cache.py)."""
    variants = _variants()
    found = shared("op-coverage-table", lambda: _measured(variants))
    runs = {label: (variants[label], *read) for label, read in found.items() if read is not None}
    errors = {label: variants[label] for label, read in found.items() if read is None}
    return runs, errors


def _measured(variants: dict) -> dict:
    """label -> (each output's kind, whether its values have a finite gradient), or None for a
    variant one device cannot run in a traced model."""
    measured = {}
    spec = tf.TensorSpec((None, WIDTH), "float64")
    rng = np.random.default_rng
    given = {rows: tf.constant(np.tanh(rng(rows).normal(size=(rows, WIDTH)))) for rows in (5, 11)}
    with precision("float64"):
        for label, apply in variants.items():

            @tf.function(input_signature=[spec])
            def outputs(h, apply=apply):  # traced as a layer call is, its row count unknown
                return [_float(t) for t in tf.nest.flatten(apply(Values(h)))]

            @tf.function(input_signature=[spec])
            def gradient(h, apply=apply):
                with tf.GradientTape() as tape:
                    tape.watch(h)
                    total = tf.add_n([tf.reduce_sum(t) for t in outputs(h)])
                found = tape.gradient(total, h)
                return tf.zeros_like(h) if found is None else found

            shapes, finite = {}, True
            try:
                for rows, h in given.items():
                    found = outputs(h)
                    shapes[rows] = [tuple(t.shape) for t in found]
                    assert all(np.all(np.isfinite(t.numpy())) for t in found), label
            except Exception:  # one device cannot run it in a traced model
                measured[label] = None
                continue
            try:
                for h in given.values():
                    finite = finite and bool(np.all(np.isfinite(gradient(h).numpy())))
            except Exception:  # no gradient: trained through `stop_gradient`
                finite = False
            kinds = [_kind({5: f, 11: s}) for f, s in zip(shapes[5], shapes[11])]
            measured[label] = (kinds, finite)
    return measured


class Probe(L.Layer):
    """One op of the table over the rows of its call, read as one value per row. The call's
    values are scaled by a weight of the layer's own, which the op's gradient alone trains (an op
    with no finite gradient gets none)."""

    def __init__(self, apply, kinds, differentiable, **kwargs):
        super().__init__(**kwargs)
        self.apply, self.kinds, self.differentiable = apply, kinds, differentiable

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, h):
        h = h * self.scale
        outputs = tf.nest.flatten(
            self.apply(Values(h if self.differentiable else ops.stop_gradient(h)))
        )
        per_row = ops.zeros_like(h[:, 0])
        for output, kind in zip(outputs, self.kinds):
            value = _float(output)
            if kind == "rows":
                per_row = per_row + tf.reduce_mean(tf.reshape(value, [tf.shape(value)[0], -1]), 1)
            elif kind == "spread":
                per_row = per_row + ops.mean(ops.reshape(value, (ops.shape(h)[0], -1)), axis=1)
            elif kind.startswith("fixed"):  # a shape the trace may not know: its size, known
                weights = np.linspace(0.5, 1.5, max(int(kind.split()[1]), 1))
                weighed = tf.reshape(value, [-1]) * tf.constant(weights, value.dtype)
                per_row = per_row + tf.reduce_sum(weighed) / weights.size
            else:
                per_row = per_row + ops.mean(value)
        return ops.expand_dims(per_row, -1)


class OwnSteps(keras.Model):
    """The same model with its own steps: the squared error trained by hand in `train_step` and
    logged by it and by `test_step`; its own `predict_step`."""

    def _error(self, data, training):
        x, y = data
        return ops.mean((self(x, training=training) - y) ** 2)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            error = self._error(data, training=True)
        weights = self.trainable_variables
        gradients = tape.gradient(error, weights)
        self.optimizer.apply_gradients(
            [(gradient, w) for gradient, w in zip(gradients, weights) if gradient is not None]
        )
        return {"loss": error}

    def test_step(self, data):
        return {"loss": self._error(data, training=False)}

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return self(x, training=False)


def _layer_names(labels) -> dict:
    return {label: f"op_{i}" for i, label in enumerate(labels)}


def _network(labels, own: bool) -> keras.Model:
    """A model giving each op's values per row, one column per op, in `labels`' order."""
    runs, errors = _table()
    keras.utils.set_random_seed(2)
    x = keras.Input((WIDTH,))
    h = L.Dense(WIDTH, activation="tanh", trainable=False)(x)
    named = _layer_names(labels)
    columns = []
    for label in labels:
        apply, kinds, finite = runs[label] if label in runs else (errors[label], [], False)
        columns.append(Probe(apply, kinds, finite, name=named[label])(h))
    outputs = L.Concatenate()(columns) if len(columns) > 1 else columns[0]
    return (OwnSteps if own else keras.Model)(x, outputs)


def _model(labels, own: bool = False, eager: bool = False) -> keras.Model:
    with precision("float64"):
        model = _network(labels, own)
        loss = None if own else "mse"
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, run_eagerly=eager)
    return model


def _data(labels):
    """Rows, and a target for each op's column."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, WIDTH)), rng.normal(size=(ROWS, len(labels)))


def _predicted(model, labels) -> np.ndarray:
    x, _ = _data(labels)
    with precision("float64"):
        return model.predict(x, batch_size=BATCH, verbose=0)


def _run(model, labels) -> dict:
    """What `fit`, `evaluate` and `predict` give: each op's weight trained by its gradient alone
    and its column predicted after, by label; the loss `fit` logs and `evaluate`'s, of all ops
    (an op's error shows in them too)."""
    x, y = _data(labels)
    with precision("float64"):
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
        evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    predicted = _predicted(model, labels)
    found = {"every op": {"fit's logged loss": history["loss"], "evaluate": evaluated["loss"]}}
    for i, (label, name) in enumerate(_layer_names(labels).items()):
        found[label] = {
            "trained weight": model.get_layer(name).scale.numpy(),
            "predict": predicted[:, i],
        }
    return found


CONFIGS = {
    "compiled": (False, False),
    "compiled, eager": (False, True),
    "own steps": (True, False),
    "own steps, eager": (True, True),
}


#: The ops are checked in this many models of their own, each with every `CHUNKS`-th op: a model's
#: trace costs more than in proportion to its ops.
CHUNKS = 4


def _chunk(chunk: int) -> list[str]:
    return sorted(_table()[0])[chunk::CHUNKS]


@functools.cache
def _one_device(own: bool, chunk: int) -> dict:
    """One device's values, traced (its eager values are the same but for rounding)."""
    return _run(_model(_chunk(chunk), own), _chunk(chunk))


def test_the_table_names_every_function_of_keras_ops():
    """A Keras release that adds a function fails here until the table names it."""
    named = set(OPS) | set(NOT_A_TENSOR_MAP)
    assert sorted(set(names()) - named) == [], "functions of keras.ops the table does not name"
    assert sorted(named - set(names())) == [], "names in the table keras.ops does not have"


#: (replicas, config): traced on 3 replicas, eager on 2 and 3.
RUNS = [(3, config) for config in CONFIGS] + [(2, c) for c in CONFIGS if CONFIGS[c][1]]


@pytest.mark.ops
@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("replicas, config", RUNS)
def test_every_op_is_one_devices(replicas, config, chunk, record_property):
    own, eager = CONFIGS[config]
    labels = _chunk(chunk)
    expected = _one_device(own, chunk)
    model = kmirror.wrap(_model(labels, own, eager), devices=cpus(replicas))
    with recording() as report:  # what the steps did where
        found = _run(model, labels)
    named = {name: label for label, name in _layer_names(labels).items()}
    whole = {named[n.split(" (")[0]] for n, _ in report.whole if n.split(" (")[0] in named}
    if eager:  # every call runs whole on every replica (`whole_calls.eager`)
        whole = set(labels)
    # Printed at the end of the run, summed over the chunks (tests/conftest.py).
    record_property("op coverage", (replicas, config, len(labels) - len(whole), len(whole)))
    different = [
        (label, what, float(np.max(np.abs(np.subtract(values, expected[label][what])))))
        for label in found
        for what, values in found[label].items()
        if not np.allclose(values, expected[label][what], rtol=1e-10, atol=1e-10, equal_nan=True)
    ]
    assert different == [], "ops whose values differ from one device's"


@pytest.mark.ops
@pytest.mark.parametrize("replicas", [2, 3])
def test_an_op_one_device_cannot_run_fails_the_same_way(replicas, record_property):
    record_property("op coverage errors", (replicas, len(_table()[1])))
    for label in sorted(_table()[1]):
        with pytest.raises(Exception) as raised:
            _predicted(_model([label]), [label])
        with pytest.raises(type(raised.value)):
            _predicted(kmirror.wrap(_model([label]), devices=cpus(replicas)), [label])
