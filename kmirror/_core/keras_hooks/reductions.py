"""A reduction over the rows of a layer call is the whole batch's, as on one device.

While a replica computes a layer call on its rows (kmirror's step: the model's call; a model's
own step: each call the step makes), a layer that reduces over the rows of its call (the mean of
the batch, its moments, a standard deviation over its rows, a loss it adds as a mean over them)
would see only the replica's rows. Every reduction TensorFlow, Keras and NumPy-like code makes
ends in a few of TensorFlow's functions (`tf_hooks.reduction_functions`), which kmirror replaces
once. While a call runs on a replica's rows they ask where the reduced tensor holds the rows
(`row_axes`):

- a sum or a mean over every axis holding the rows is the whole batch's: the sum over every
  replica of its rows' sum (and count), computed as one device computes it. Going backward, each
  replica's rows get the gradient of every replica's use of the value. BatchNormalization's
  statistics (`tf.nn.moments`, two means) are one case of it;
- a sum or a mean over some of the axes holding the rows but not all (rows regrouped: groups of
  4 rows, each group's statistic) depends on which rows a replica holds: refused, naming the layer;
- the other reductions over the rows (max, min, product, norm, arg-max, cumulative sums, top-k
  and sorts) are not sums: refused, naming the layer and the operation.

Anything else (a reduction over other axes, over a weight, over data the model holds) is Keras'
own. Outside such a call, and while kmirror computes its own values (a loss' normaliser, the
replicas' sums), reductions are TensorFlow's own: a loss function's mean is weighted by the
replica's share of the rows instead (`replica`). In eager mode (`run_eagerly=True`) a tensor
does not say where it comes from, and reductions stay the replica's own.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import tensorflow as tf

from kmirror._core import tf_hooks
from kmirror._core.keras_hooks.row_axes import RowAxes, reduced_axes
from kmirror._core.keras_hooks.rows import Rows

__all__ = ["over_rows", "within", "active", "paused", "from_whole_batch", "install"]


@dataclass
class _Call:
    axes: RowAxes
    rows: Rows
    layers: list = field(default_factory=list)  # the calls running, outermost first
    #: The ops computing the whole batch's reductions, and which ops are computed from them.
    whole: dict = field(default_factory=dict)


_state = threading.local()  # `call`: the replica's call on its rows; `paused`


def active() -> bool:
    """Whether this thread runs a layer call on a replica's rows."""
    return getattr(_state, "call", None) is not None


@contextlib.contextmanager
def over_rows(layer, seeds, rows: Rows) -> Iterator[None]:
    """Within this block (on this thread) `layer` is called on the replica's rows: `seeds` (the
    tensors of the call that are rows of the batch) and what is computed from them."""
    install()
    previous = getattr(_state, "call", None)
    _state.call = _Call(RowAxes(seeds), rows, [layer])
    try:
        yield
    finally:
        _state.call = previous


@contextlib.contextmanager
def within(layer) -> Iterator[None]:
    """A layer called inside the call on the replica's rows (named in an error)."""
    call = _state.call
    call.layers.append(layer)
    try:
        yield
    finally:
        call.layers.pop()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Within this block reductions are TensorFlow's own (kmirror's own values)."""
    previous = getattr(_state, "paused", False)
    _state.paused = True
    try:
        yield
    finally:
        _state.paused = previous


def from_whole_batch(value) -> bool:
    """Whether `value` (written to a layer's state in the call) is computed from a reduction
    made the whole batch's: every replica writes it alike."""
    call = getattr(_state, "call", None)
    if call is None or not call.whole or not tf.is_tensor(value) or not hasattr(value, "op"):
        return False
    known, stack = call.whole, [value.op]
    while stack:
        op = stack[-1]
        if op in known:
            stack.pop()
            continue
        missing = [t.op for t in op.inputs if t.op not in known]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        known[op] = any(known[t.op] for t in op.inputs)
    return known[value.op]


def _current() -> _Call | None:
    call = getattr(_state, "call", None)
    if call is None or getattr(_state, "paused", False) or not call.rows.global_statistics:
        return None
    return call


def _replacement(original: Callable, op_type: str) -> Callable:
    signature = inspect.signature(original)
    names = list(signature.parameters)

    def reduction(*args, **kwargs):
        call = _current()
        if call is None:
            return original(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        tensor = given[names[0]]
        held = call.axes.of(tensor)
        if not held:
            return original(*args, **kwargs)
        if op_type == "TopKV2":
            axes = {tensor.shape.rank - 1} if tensor.shape.rank else None
        else:
            axes = reduced_axes(given[names[1]], tensor)
        if axes is not None and not held & axes:
            return original(*args, **kwargs)
        if op_type in ("Sum", "Mean") and axes is not None and held <= axes:
            keepdims = bool(given.get("keep_dims", False))
            value = _whole_batch(op_type, tensor, sorted(axes), keepdims, call.rows)
            call.whole[value.op] = True
            return value
        raise ValueError(_refusal(call, op_type, held, axes))

    reduction.__name__ = original.__name__
    return reduction


def _whole_batch(op_type, tensor, axes: list, keepdims: bool, rows: Rows):
    """The sum (or mean) over `axes` of the whole batch's `tensor`, from this replica's rows.

    One packed sum over the replicas (the replica's sum, and its count for a mean) going forward;
    going backward, the sum over the replicas of the value's gradient, spread over the replica's
    rows. Written as one custom gradient: TensorFlow's own gradients of the packing would add
    tens of ops per reduction, hundreds of reductions in a deep model's step."""
    with paused():
        tensor = tf.convert_to_tensor(tensor)
        dtype = tensor.dtype
        work = tensor if dtype.is_floating or dtype.is_complex else tf.cast(tensor, tf.float64)
        local = _ORIGINAL["_sum"](work, axes, keep_dims=True)
        kept = _static_or_dynamic(local)
        final = _without(local.shape, axes) if not keepdims else local.shape.as_list()
        if None in final:  # reshaped as the replica's sum is, then squeezed
            final = None
        packed = tf.reshape(local, [-1])
        if op_type == "Mean":
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(work), axes)), work.dtype)
            packed = tf.concat([packed, [count]], 0)
        if rows.padded:  # a replica without rows computed on a row not its own
            has_rows = tf.cast(rows.count > 0, work.dtype)
            packed = tf.math.multiply_no_nan(packed, has_rows)
        total = rows.all_sum(packed)  # its gradient is `whole`'s, not the sum's

        @tf.custom_gradient
        def whole(work, total):
            value = total[:-1] / total[-1] if op_type == "Mean" else total
            value = tf.reshape(value, kept if final is None else final)

            def gradient(upstream):
                spread = tf.reshape(rows.all_sum(upstream), kept)
                if op_type == "Mean":
                    spread = spread / total[-1]
                spread = tf.broadcast_to(spread, tf.shape(work))
                if rows.padded:
                    spread = tf.math.multiply_no_nan(spread, has_rows)
                return spread, None

            return value, gradient

        value = whole(work, total)
        if final is None and not keepdims:
            value = tf.squeeze(value, axes)
        value.set_shape(local.shape if keepdims else _without(local.shape, axes))
        return tf.cast(value, dtype)


def _static_or_dynamic(tensor):
    """`tensor`'s shape: a list of ints where it is known, else the tensor of it."""
    return tensor.shape.as_list() if tensor.shape.is_fully_defined() else tf.shape(tensor)


def _without(shape, axes: list):
    return [d for i, d in enumerate(shape) if i not in axes]


_NAMES = {
    "Sum": "a sum",
    "Mean": "a mean",
    "Max": "a maximum",
    "Min": "a minimum",
    "Prod": "a product",
    "EuclideanNorm": "a norm",
    "ArgMax": "an arg-max",
    "ArgMin": "an arg-min",
    "Cumsum": "a cumulative sum",
    "Cumprod": "a cumulative product",
    "TopKV2": "a top-k or a sort",
}


def _refusal(call: _Call, op_type: str, held, axes) -> str:
    layer = call.layers[-1]
    where = f"layer '{layer.name}' ({type(layer).__name__})"
    if op_type in ("Sum", "Mean"):
        return (
            f"kmirror: {where} takes {_NAMES[op_type]} over some of the axes that hold the rows "
            f"of its call (axes {sorted(axes)} of a tensor holding them in axes {sorted(held)}: "
            "the rows regrouped, as groups of rows each with its own statistic). Which rows a "
            "group holds depends on which rows each replica holds, so no replica can compute "
            "one device's value. Reduce over all the rows (a statistic of the whole batch), or "
            "over axes that do not hold them."
        )
    return (
        f"kmirror: {where} takes {_NAMES[op_type]} over the rows of its call (axes "
        f"{sorted(axes) if axes is not None else 'unknown'} of a tensor holding them in axes "
        f"{sorted(held)}). Each replica holds only its rows of the batch, and kmirror makes "
        "only sums and means over the rows the whole batch's, so the replicas would not compute "
        "one device's value. Write it with sums or means over the rows, or compute it in the "
        "model's own train_step outside the layer's call, on the whole batch."
    )


_ORIGINAL: dict = {}
_install_lock = threading.Lock()


def install() -> None:
    """Puts kmirror's reductions in place (once per process); outside a call on a replica's rows
    they are TensorFlow's."""
    with _install_lock:
        if _ORIGINAL:
            return
        for module, name, op_type in tf_hooks.reduction_functions():
            original = getattr(module, name)
            _ORIGINAL[name] = original
            setattr(module, name, _replacement(original, op_type))
