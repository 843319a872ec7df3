"""Where the rows of a layer call sit in the tensors it computes (`keras_hooks.row_axes`), on a
traced graph whose rows are as many as a lookup's tokens (8): the axis a rule keeps is the one
the op keeps, not a dimension of the same size."""

import types

import keras
import tensorflow as tf

from kmirror._core.keras_hooks import mixing, reductions
from kmirror._core.keras_hooks.row_axes import NONE, RowAxes


def test_the_axes_holding_the_rows():
    found = {}

    @tf.function
    def trace(x, tokens):
        axes = RowAxes([x, tokens])
        looked_up = tf.gather(tf.ones((50, 4)), tokens)  # (rows, tokens, features)
        centred = x - tf.reduce_mean(x, axis=0)
        cases = {
            "lookup": looked_up,
            "pooled over the tokens": tf.reduce_mean(looked_up, axis=1),
            "tokens flattened into the rows": tf.reshape(looked_up, [-1, 4]),
            "transposed": tf.transpose(x),
            "groups of 4 rows": tf.reshape(x, [4, -1, 6]),
            "rows kept by their count": tf.reshape(x, [tf.shape(x)[0], 3, 2]),
            "a statistic": tf.reduce_mean(x, axis=0),
            "centred": centred,
            "expanded": tf.expand_dims(x, 1),
            "some of the rows": x[2:5],
            "the rows padded": tf.pad(x, [[3, 4], [0, 0]]),
            "one row": x[0],
            "one step, steps first": tf.transpose(looked_up, [1, 0, 2])[0],
            "a new first axis": x[None],
            "a new last axis": x[..., None],
            "held by the model": tf.ones((8, 6)),
        }
        found.update({name: axes.of(tensor) for name, tensor in cases.items()})
        return x

    trace.get_concrete_function(tf.TensorSpec((8, 6)), tf.TensorSpec((8, 8), tf.int32))
    assert found == {
        "lookup": {0},
        "pooled over the tokens": {0},
        "tokens flattened into the rows": {0},
        "transposed": {1},
        "groups of 4 rows": {0, 1},
        "rows kept by their count": {0},
        "a statistic": NONE,
        "centred": {0},
        "expanded": {0},
        "some of the rows": {0},
        "the rows padded": {0},
        "one row": NONE,
        "one step, steps first": {0},
        "a new first axis": {1},
        "a new last axis": {0},
        "held by the model": None,
    }


def test_one_step_of_steps_first_rows_of_unknown_shape():
    """A recurrent layer's step of its time-major input (`inputs[0]` of `(steps, rows, features)`)
    holds the rows in axis 0, whatever the dimensions are known to be."""
    found = {}

    @tf.function
    def trace(x):
        found["step"] = RowAxes([x]).of(tf.transpose(x, [1, 0, 2])[0])
        return x

    trace.get_concrete_function(tf.TensorSpec((None, None, None)))
    assert found == {"step": {0}}


def test_a_number_made_of_the_dimensions_of_other_axes_leaves_the_call_on_its_rows():
    """A layer's cast of its input's shape to a number (`tf.shape(x)[1:]`: a row's size, as a
    layer normalises by it) reads no count of the rows unless the axes it reads hold them: then
    the call runs whole (a replica's count is not the batch's)."""
    mixing.install()
    reads = {
        "a row's dimensions": lambda x: tf.shape(x)[1:],
        "the last dimension": lambda x: tf.shape(x)[-1],
        "the features' dimensions": lambda x: tf.shape(x)[1::2],
        "the row count": lambda x: tf.shape(x)[0],
        "the first two dimensions": lambda x: tf.shape(x)[:2],
        "the whole shape": lambda x: tf.shape(x)[:],
    }
    runs_whole = {}

    @tf.function
    def trace(x):
        rows = types.SimpleNamespace(global_statistics=True)
        with reductions.over_rows(keras.layers.Identity(name="probe"), [x], rows):
            for name, read in reads.items():
                try:
                    tf.cast(read(x), tf.float32)
                    runs_whole[name] = False
                except reductions.RunWhole:
                    runs_whole[name] = True
        return x

    trace.get_concrete_function(tf.TensorSpec((None, 3, 2)))
    assert runs_whole == {
        "a row's dimensions": False,
        "the last dimension": False,
        "the features' dimensions": False,
        "the row count": True,
        "the first two dimensions": True,
        "the whole shape": True,
    }
