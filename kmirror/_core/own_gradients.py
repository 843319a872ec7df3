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
call computes on the replica's rows, as the layer does, and is left as it is; so is one inside a
function of the step's own (a function mapped over rows, a loop's body, a nested `tf.function`:
`keras_hooks.in_function`), whose layer calls ran as on one device: each row's gradient there is
that row's. A Jacobian of weights the step takes at its top level (`tape.jacobian`,
`batch_jacobian`) is summed over the replicas as a gradient is, in one reduction.

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
    """Makes `tf.GradientTape.gradient`, `jacobian`, `batch_jacobian` and `tf.gradients` give
    one device's gradients of the variables inside a model's own step (elsewhere, and on other
    threads, they are TensorFlow's own)."""
    with _install_lock:
        if _original:
            return
        tape = tf.GradientTape
        for name in ("gradient", "jacobian", "batch_jacobian", "__enter__", "__exit__"):
            _original[name] = getattr(tape, name)
        _original["gradients"] = tf.gradients
        tape.gradient, tape.__enter__, tape.__exit__ = _tape_gradient, _enter, _exit
        tape.jacobian = lambda *args, **kwargs: _jacobian("jacobian", *args, **kwargs)
        tape.batch_jacobian = lambda *args, **kwargs: _jacobian("batch_jacobian", *args, **kwargs)
        tf.gradients = _gradients


_jacobians = threading.local()  # `depth`: inside a Jacobian the step takes at its top level


def _enter(tape):
    """A tape the step enters notes the calls on the replica's rows made before it."""
    own = keras_hooks.current_step()
    if own is not None and not keras_hooks.inside_layer_call():
        own.tapes[id(tape)] = [tape, own.split_calls, None]
    return _original["__enter__"](tape)


def _exit(tape, *exc):
    own = keras_hooks.current_step()
    if own is not None and id(tape) in own.tapes:
        own.tapes[id(tape)][2] = own.split_calls
    return _original["__exit__"](tape, *exc)


def _recorded_split_calls(tape) -> bool:
    """Whether `tape` recorded a layer call the step made on the replica's rows."""
    own = keras_hooks.current_step()
    _, before, by_end = own.tapes.get(id(tape), (None, own.split_calls, None))
    return (own.split_calls if by_end is None else by_end) > before


def _tape_gradient(tape, target, sources, output_gradients=None, unconnected_gradients=None):
    unconnected = unconnected_gradients or tf.UnconnectedGradients.NONE
    grads = _original["gradient"](tape, target, sources, output_gradients, unconnected)
    return _one_devices(sources, grads, tape)


def _gradients(ys, xs, *args, **kwargs):
    return _one_devices(xs, _original["gradients"](ys, xs, *args, **kwargs))


def _jacobian(method: str, tape, target, sources, *args, **kwargs):
    """A Jacobian the step takes at its top level: each row of it is the gradient of one entry
    of `target`, summed over the replicas (of weights) as a gradient is, all in one reduction.
    TensorFlow takes those gradients in a function it maps over the entries, where nothing is
    summed (`keras_hooks.in_function`)."""
    original = _original[method]
    own = keras_hooks.current_step()
    if own is None or keras_hooks.inside_layer_call() or keras_hooks.in_function() is not None:
        return original(tape, target, sources, *args, **kwargs)
    if _recorded_split_calls(tape) and not all(map(_variable, tf.nest.flatten(sources))):
        raise ValueError(
            f"kmirror: the model's own step takes `tape.{method}` with respect to a tensor of "
            "values its layer calls computed on each replica's rows; kmirror sums a Jacobian over "
            "the replicas with respect to weights only. Take each row's gradient with respect to "
            "the tensor inside `tf.vectorized_map` (or `tf.map_fn`), with a tape made inside the "
            "mapped function: the layer calls made there run as on one device."
        )
    _jacobians.depth = getattr(_jacobians, "depth", 0) + 1
    try:
        found = original(tape, target, sources, *args, **kwargs)
    finally:
        _jacobians.depth -= 1
    return _summed(own, sources, found, sparse=False)


def _one_devices(sources, grads, tape=None):
    """`grads` of `sources`, each variable's summed over the replicas and divided by their count
    when an own step runs on this thread (outside its layer calls). In a function of the step's
    own (`keras_hooks.in_function`: a function mapped over rows, a loop's body) the layer calls
    ran as on one device, and the gradient is TensorFlow's, unless its tape recorded calls made
    on the replica's rows outside the function."""
    own = keras_hooks.current_step()
    if own is None or keras_hooks.inside_layer_call():
        return grads
    where = keras_hooks.in_function()
    if where is None:
        return _summed(own, sources, grads)
    if getattr(_jacobians, "depth", 0) or tape is None or not _recorded_split_calls(tape):
        return grads
    pairs = zip(tf.nest.flatten(sources), tf.nest.flatten(grads))
    if not any(_variable(s) and g is not None for s, g in pairs):
        return grads
    raise ValueError(
        f"kmirror: the model's own step takes a gradient of its weights inside {where} from a "
        "tape that recorded layer calls made outside it, on each replica's rows; the sum of the "
        "gradient over the replicas cannot run there. Take the gradient at the top level of the "
        "step (what you do with it, applying or accumulating it, may then be conditional), or "
        "make the tape and the layer calls it records inside that function (they run as on one "
        "device there): a per-row gradient inside `tf.vectorized_map` or `tf.map_fn`."
    )


def _summed(own, sources, grads, sparse: bool = True):
    """`grads` of `sources`, each variable's summed over the replicas and divided by their count
    (a Jacobian's rows too, `sparse` False: each row dense)."""
    flat_sources, flat = tf.nest.flatten(sources), tf.nest.flatten(grads)
    chosen = [
        i for i, (s, g) in enumerate(zip(flat_sources, flat)) if g is not None and _variable(s)
    ]
    if not chosen:
        return grads
    variables = [flat_sources[i] for i in chosen]
    part = [flat[i] for i in chosen]
    if not sparse:
        flat = list(flat)
        for i, gradient in zip(chosen, own.reduce_gradients(part)):
            flat[i] = _divided(gradient, own.replicas)
        return tf.nest.pack_sequence_as(grads, flat)
    shared = sparse_gradients.shared_lookups(part, own.split_inputs, variables)
    sent, lookups = sparse_gradients.apart(part, shared)
    summed = sparse_gradients.together(own.reduce_gradients(sent), lookups)
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
