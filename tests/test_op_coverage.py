"""Coverage measured against the op set, not against programs: every public function of
`keras.ops` (tests/op_coverage.py) applied to a tensor holding the rows of a layer call, each in a
layer of its own, all in one compiled model, traced: its `predict` on 2 and 3 replicas, on 34 rows
in batches of 17 (shares of 8 and 9 rows on 2 replicas, of 5, 6 and 6 on 3), gives each op's values
as one device's in float64 within 1e-10; an op one device cannot run in a traced model fails with
the same error. The totals (calls kmirror splits over the replicas' rows, runs whole, and errors)
are printed, and docs/concepts.md gives them.

What each op gives is turned into one value per row: an output with the batch's rows in axis 0
gives each row its own values' mean (a row paired with another's value, as an op over the rows
computed on a replica's rows would pair them, is caught); one with a multiple of the rows in all its
values (`ravel`) is read as rows the same way; one of a fixed size (a statistic over the rows) is
weighed entry by entry, so an entry computed in the wrong place is caught; any other, its mean,
given to every row.

`make test` checks the table names every function; `make test-ops` runs the rest (on 3 replicas
it finds a fault not fixed yet: `count_nonzero`'s sums over the replicas are not matched).
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

import kmirror
from kmirror._core.keras_hooks.explaining import recording

ROWS, BATCH = 34, 17
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
    """(the variants one device runs: label -> (apply, each output's kind), the variants one
    device cannot run in a traced model: label -> apply), from one device's run of each, traced
    with the row count unknown, on 5 and 11 rows."""
    runs, errors = {}, {}
    spec = tf.TensorSpec((None, WIDTH), "float64")
    with precision("float64"):
        for label, apply in _variants().items():

            @tf.function(input_signature=[spec])
            def outputs(h, apply=apply):  # traced as a layer call is, its row count unknown
                return [_float(t) for t in tf.nest.flatten(apply(Values(h)))]

            shapes = {}
            try:
                for rows in (5, 11):
                    h = tf.constant(np.tanh(np.random.default_rng(rows).normal(size=(rows, WIDTH))))
                    found = outputs(h)
                    shapes[rows] = [tuple(t.shape) for t in found]
                    assert all(np.all(np.isfinite(t.numpy())) for t in found), label
            except Exception:  # one device cannot run it in a traced model
                errors[label] = apply
                continue
            runs[label] = (apply, [_kind({5: f, 11: s}) for f, s in zip(shapes[5], shapes[11])])
    return runs, errors


class Probe(L.Layer):
    """One op of the table over the rows of its call, read as one value per row."""

    def __init__(self, apply, kinds, **kwargs):
        super().__init__(**kwargs)
        self.apply, self.kinds = apply, kinds

    def call(self, h):
        outputs = tf.nest.flatten(self.apply(Values(h)))
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


def _layer_names(labels) -> dict:
    return {label: f"op_{i}" for i, label in enumerate(labels)}


def _network(labels) -> keras.Model:
    """A model giving each op's values per row, one output per op, in `labels`' order."""
    runs, errors = _table()
    keras.utils.set_random_seed(2)
    x = keras.Input((WIDTH,))
    h = L.Dense(WIDTH, activation="tanh")(x)
    named = _layer_names(labels)
    outputs = []
    for label in labels:
        apply, kinds = runs[label] if label in runs else (errors[label], [])
        outputs.append(Probe(apply, kinds, name=named[label])(h))
    return keras.Model(x, outputs)


def _predicted(model) -> list:
    x, _ = _data()
    with precision("float64"):
        predicted = model.predict(x, batch_size=BATCH, verbose=0)
    return predicted if isinstance(predicted, list) else [predicted]


def _model(labels) -> keras.Model:
    with precision("float64"):
        return _network(labels)


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, WIDTH)), rng.normal(size=(ROWS, 1))


@functools.cache
def _one_device() -> list:
    return _predicted(_model(sorted(_table()[0])))


def test_the_table_names_every_function_of_keras_ops():
    """A Keras release that adds a function fails here until the table names it."""
    named = set(OPS) | set(NOT_A_TENSOR_MAP)
    assert sorted(set(names()) - named) == [], "functions of keras.ops the table does not name"
    assert sorted(named - set(names())) == [], "names in the table keras.ops does not have"


@pytest.mark.ops
@pytest.mark.parametrize("replicas", [2, 3])
def test_every_op_is_one_devices(replicas, capsys):
    labels = sorted(_table()[0])
    expected = _one_device()
    model = kmirror.wrap(_model(labels), devices=cpus(replicas))
    with recording() as report:  # what the traced step did where
        predicted = _predicted(model)
    named = {name: label for label, name in _layer_names(labels).items()}
    whole = {named[n.split(" (")[0]] for n, _ in report.whole if n.split(" (")[0] in named}
    with capsys.disabled():
        print(
            f"\nkeras.ops coverage on {replicas} replicas: {len(labels) - len(whole)} split, "
            f"{len(whole)} whole, {len(_table()[1])} error, of the "
            f"{len(names()) - len(NOT_A_TENSOR_MAP)} functions of keras.ops that take a tensor "
            f"({len(NOT_A_TENSOR_MAP)} take none); whole: {', '.join(sorted(whole))}"
        )
    different = [
        (label, float(np.max(np.abs(a - b))))
        for label, a, b in zip(labels, expected, predicted)
        if not np.allclose(a, b, rtol=1e-10, atol=1e-10)
    ]
    assert different == [], "ops whose values differ from one device's"


@pytest.mark.ops
@pytest.mark.parametrize("replicas", [2, 3])
def test_an_op_one_device_cannot_run_fails_the_same_way(replicas):
    for label in sorted(_table()[1]):
        with pytest.raises(Exception) as raised:
            _predicted(_model([label]))
        with pytest.raises(type(raised.value)):
            _predicted(kmirror.wrap(_model([label]), devices=cpus(replicas)))
