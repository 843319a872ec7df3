"""Where the rows of a layer call sit in the tensors it computes (`keras_hooks.row_axes`), on a
traced graph whose rows are as many as a lookup's tokens (8): the axis a rule keeps is the one
the op keeps, not a dimension of the same size."""

import types

import keras
import tensorflow as tf

from kmirror._core.keras_hooks import mixing, other_ops, reductions
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
            # each row's 8 tokens as entries of axis 0, and back: the rows stay in axis 0
            "to each token's features and back": tf.reshape(
                tf.reshape(looked_up, [-1, 4]) * 2.0, [-1, 8, 2, 2]
            ),
            "back to the shape of the rows": tf.reshape(
                tf.reshape(looked_up, [-1, 4]), tf.shape(looked_up)
            ),
            "a product over the features of each token": tf.tensordot(
                looked_up, tf.ones((4, 3)), axes=1
            ),
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
        "to each token's features and back": {0},
        "back to the shape of the rows": {0},
        "a product over the features of each token": {0},
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


def test_rows_through_loops_conditions_and_tensor_lists():
    """What a loop, a condition or a tensor list gives back holds the rows where its body, its
    branches or its elements do: a recurrent layer's outputs, collected in a `tf.TensorArray`,
    and its last state."""
    found = {}

    @tf.function
    def trace(x):
        axes = RowAxes([x])
        steps = tf.TensorArray(x.dtype, size=3).unstack(tf.transpose(x, [1, 0, 2]))

        def step(t, state, outputs):
            state = tf.tanh(steps.read(t) + state)
            return t + 1, state, outputs.write(t, state)

        collected = tf.TensorArray(x.dtype, size=3)
        _, last, collected = tf.while_loop(
            lambda t, *_: t < 3, step, (0, tf.zeros_like(x[:, 0]), collected)
        )
        cases = {
            "a step read in the loop": steps.read(1),
            "the last state": last,
            "the outputs, stacked": collected.stack(),
            "a branch's rows": tf.cond(tf.reduce_sum(x) > 0, lambda: x * 2, lambda: x),
            "an element of a list of the rows": tf.TensorArray(x.dtype, size=4).unstack(x).read(0),
        }
        found.update({name: axes.of(tensor) for name, tensor in cases.items()})
        return x

    trace.get_concrete_function(tf.TensorSpec((None, 3, 2)))
    assert found == {
        "a step read in the loop": {0},
        "the last state": {0},
        "the outputs, stacked": {1},
        "a branch's rows": {0},
        "an element of a list of the rows": NONE,
    }


def runs_whole(ops: dict) -> dict:
    """For each op (of a tensor of shape `(rows, 3, 2)`) made in a layer call on a replica's
    rows: whether it runs the call whole, asked in the layer's name."""
    found = {}

    @tf.function
    def trace(x):
        rows = types.SimpleNamespace(global_statistics=True)
        with reductions.over_rows(keras.layers.Identity(name="probe"), [x], rows):
            for name, op in ops.items():
                try:
                    op(x)
                    found[name] = False
                except reductions.RunWhole as asked:
                    found[name] = "layer 'probe' (Identity) " in str(asked)
        return x

    trace.get_concrete_function(tf.TensorSpec((None, 3, 2)))
    return found


def test_an_op_no_rule_names_runs_the_call_whole_where_it_combines_the_rows():
    """Every op of a call over its rows is checked as it is made: one computing each row on its
    own is TensorFlow's; any other runs the call whole, named by its kind."""
    mixing.install()  # the ops with rules of their own, as a step installs them
    other_ops.install()
    ops = {
        "each element": lambda x: tf.exp(x) * x,
        "each row's image resized": lambda x: tf.image.resize(x[..., None], (4, 4)),
        "a Fourier transform of each row": lambda x: tf.signal.fft(tf.complex(x, x)),
        "a Fourier transform along the rows": lambda x: tf.signal.fft(
            tf.complex(tf.transpose(x), 0.0)
        ),
        "split along the features": lambda x: tf.split(x, [1, -1], axis=1),
        "split along the rows": lambda x: tf.split(x, [1, -1], axis=0),
        "rows joined with rows": lambda x: tf.concat([x, 2 * x], axis=0),
        "rows joined with values held": lambda x: tf.concat([x, tf.zeros((1, 3, 2))], axis=0),
        "a cumulative log-sum-exp of each row": lambda x: tf.math.cumulative_logsumexp(x, 1),
        "a cumulative log-sum-exp of the rows": lambda x: tf.math.cumulative_logsumexp(x, 0),
        "an element of a list of the rows": lambda x: tf.TensorArray(x.dtype, 4).unstack(x).read(0),
        "an op of a kind no rule names": lambda x: tf.raw_ops.L2Loss(t=x),
    }
    assert runs_whole(ops) == {
        "each element": False,
        "each row's image resized": False,
        "a Fourier transform of each row": False,
        "a Fourier transform along the rows": True,
        "split along the features": False,
        "split along the rows": True,
        "rows joined with rows": False,
        "rows joined with values held": True,
        "a cumulative log-sum-exp of each row": False,
        "a cumulative log-sum-exp of the rows": True,
        "an element of a list of the rows": True,
        "an op of a kind no rule names": True,
    }


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
    casts = {
        name: lambda x, read=read: tf.cast(read(x), tf.float32) for name, read in reads.items()
    }
    assert runs_whole(casts) == {
        "a row's dimensions": False,
        "the last dimension": False,
        "the features' dimensions": False,
        "the row count": True,
        "the first two dimensions": True,
        "the whole shape": True,
    }
