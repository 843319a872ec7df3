"""The reducer chosen is the reducer that runs, whether the model asks for XLA or not.

Keras turns XLA on by default when a GPU is visible, and TensorFlow then silently swaps a
MirroredStrategy's cross-device ops for its collective ops. kmirror compiles only each replica's
forward and backward pass with XLA; the reduction and the update run outside it.
"""

import keras
import pytest
import tensorflow as tf
from conftest import cpus
from models import BATCH, assert_same_history, dense_data, dense_model, max_weight_difference

import kmirror


class CountingReduction(tf.distribute.ReductionToOneDevice):
    """Reduction to one device that counts the batch reductions it is asked to build."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.calls += 1
        return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)


@pytest.mark.parametrize("jit_compile", [False, True, "auto"])
def test_the_chosen_reducer_runs_with_and_without_xla(jit_compile):
    x, y = dense_data()
    reference = dense_model(jit_compile=jit_compile)
    reference_history = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    counting = CountingReduction()
    model = kmirror.wrap(dense_model(jit_compile=jit_compile), reducer=counting, devices=cpus(3))
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    assert counting.calls > 0, "the gradients were not reduced by the chosen reducer"
    # "auto" resolves to no XLA on a machine without GPUs, as in Keras.
    assert model.replica_jit_compile is (jit_compile is True)
    assert model.jit_compile is False, "the step around the reduction is never XLA-compiled"
    assert max_weight_difference(reference, model) < 1e-5
    assert_same_history(reference_history.history, history.history)


class HostOnly(keras.layers.Layer):
    """A layer XLA cannot compile: it runs a Python function on the host, on a number it holds
    (on the rows of its call, a host function would run the call whole: it may combine them)."""

    def call(self, x):
        scale = tf.ensure_shape(tf.numpy_function(lambda a: a, [tf.constant(1.0)], tf.float32), [])
        return x * scale


def host_only_model(jit_compile):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), HostOnly(), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    return model


@pytest.mark.parametrize("jit_compile", [False, True])
def test_replica_passes_are_xla_compiled_exactly_when_asked(jit_compile):
    x, _ = dense_data()
    y = x[:, :3]
    model = kmirror.wrap(host_only_model(jit_compile), reducer="one_device", devices=cpus(2))
    if jit_compile:
        # XLA refuses the host function in the replica's gradient pass: it was compiled.
        with pytest.raises(
            tf.errors.InvalidArgumentError,
            match="unsupported operations when trying to compile graph __inference_gradients.*"
            "XLA_CPU_JIT: PyFunc",
        ):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        return
    # Without XLA the host function runs, and training is one device's.
    reference = host_only_model(False)
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-6
