"""The gradient a model's own step reads is one device's gradient of the whole batch.

In a model's own step each layer call computes on the replica's rows (`_core.global_batch`), so
the gradient TensorFlow computes for a weight is `n` times the part its replica's rows give (and
what the step computed from the weight outside its calls, a regulariser, gives it whole). While an
own step runs, `tf.GradientTape.gradient` and `tf.gradients` therefore take the sum over the
replicas of every variable's gradient they return, through the chosen reducer, and divide it by
`n`: every replica then holds one device's gradient, where the step asks for it. Whatever the step
does with it is one device's computation: its global norm, a perturbation of the weights by it
(sharpness-aware minimisation), clipping by hand, logging it, adding it into accumulators and
applying them under a `tf.cond`. `apply_gradients` applies what it is given, with no second sum.

Gradients with respect to tensors (an input, interpolated images of a gradient penalty) are
whole already: a call's input gradient is every replica's rows joined. A tape used inside a layer
call computes on the replica's rows, as the layer does, and is left as it is.

One reduction per gradient the step asks for: a step that takes one gradient and applies it pays
what it paid when the sum was taken at `apply_gradients`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import keras
import tensorflow as tf

from kmirror._core import keras_hooks, sparse_gradients

__all__ = ["install"]

_original: dict[str, Callable] = {}
_install_lock = threading.Lock()


def install() -> None:
    """Makes `tf.GradientTape.gradient` and `tf.gradients` give one device's gradients of the
    variables inside a model's own step (elsewhere, and on other threads, they are TensorFlow's
    own)."""
    with _install_lock:
        if _original:
            return
        _original["tape"] = tf.GradientTape.gradient
        _original["gradients"] = tf.gradients
        tf.GradientTape.gradient = _tape_gradient
        tf.gradients = _gradients


def _tape_gradient(tape, target, sources, output_gradients=None, unconnected_gradients=None):
    unconnected = unconnected_gradients or tf.UnconnectedGradients.NONE
    grads = _original["tape"](tape, target, sources, output_gradients, unconnected)
    return _one_devices(sources, grads)


def _gradients(ys, xs, *args, **kwargs):
    return _one_devices(xs, _original["gradients"](ys, xs, *args, **kwargs))


def _one_devices(sources, grads):
    """`grads` of `sources`, each variable's summed over the replicas and divided by their count
    when an own step runs on this thread (outside its layer calls)."""
    own = keras_hooks.current_step()
    if own is None or keras_hooks.inside_layer_call():
        return grads
    flat_sources, flat = tf.nest.flatten(sources), tf.nest.flatten(grads)
    chosen = [
        i for i, (s, g) in enumerate(zip(flat_sources, flat)) if g is not None and _variable(s)
    ]
    if not chosen:
        return grads
    variables = [flat_sources[i] for i in chosen]
    part = [flat[i] for i in chosen]
    shared = sparse_gradients.shared_lookups(part, own.split_inputs, variables)
    sent, lookups = sparse_gradients.apart(part, shared)
    try:
        summed = sparse_gradients.together(own.reduce_gradients(sent), lookups)
    except RuntimeError as error:
        if "merge_call" not in str(error):
            raise
        raise ValueError(
            "kmirror: the model's own step takes a gradient of its weights inside a condition or "
            "loop of the step (tf.cond, tf.while_loop, or Python if/for on tensors under "
            "autograph) or inside a nested tf.function; the sum of the gradient over the "
            "replicas cannot run there. Take the gradient at the top level of the step; what you "
            "do with it (apply it, accumulate it) may then be conditional."
        ) from None
    flat = list(flat)
    for i, gradient in zip(chosen, summed):
        flat[i] = _divided(gradient, own.replicas)
    return tf.nest.pack_sequence_as(grads, flat)


def _variable(source) -> bool:
    return isinstance(source, tf.Variable | keras.Variable)


def _divided(gradient, replicas: int):
    """A summed gradient divided by the replica count: each replica's layer calls gave its
    weights `replicas` times their rows' part (`_core.global_batch`), and what the step computed
    from the weights outside the calls, every replica gave whole."""
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values / tf.cast(replicas, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient / tf.cast(replicas, gradient.dtype)
