"""A reduction over the rows of a layer call is the whole batch's, as on one device.

While a replica computes a layer call on its rows (kmirror's step: the model's call; a model's own
step: each call the step makes), a layer that reduces over the rows of its call (the batch's mean,
its moments, a loss it adds as a mean over them) would see only the replica's rows. Every reduction
of TensorFlow, Keras and NumPy-like code ends in a few of TensorFlow's functions
(`tf_hooks.graphs.reduction_functions`), replaced once. In a call on a replica's rows they ask
where the reduced tensor holds the rows (`row_axes`):

- a sum or a mean over every axis holding the rows is the whole batch's: the sum over every
  replica of its rows' sum (and count). Going backward, each replica's rows get the gradient of
  every replica's use of the value. BatchNormalization's statistics are one case of it;
- a sum or a mean over some of the axes holding the rows (a statistic per group of rows) and
  the other reductions over the rows (max, min, product, norm, arg-max, any, cumulative sums,
  top-k and sorts) run the layer's call again on the whole batch (`RunWhole`, `whole_calls`).

Anything else (over other axes, a weight, data the model holds) is Keras' own; so is every
reduction outside such a call, or while kmirror computes its own values (`paused`: a loss'
normaliser, weighted by the replica's share of the rows instead, `replica`). No call runs on a
replica's rows in eager mode (`run_eagerly=True`), where no graph says what it computes over
them: it runs whole (`whole_calls.eager`). In a loop's body or a branch a call builds, a sum
over the rows runs the call whole (`nested`).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NoReturn

from kmirror._core.keras_hooks import batch_sums, explaining, nested
from kmirror._core.keras_hooks.row_axes import RowAxes, reduced_axes
from kmirror._core.keras_hooks.rows import Rows
from kmirror._core.tf_hooks import graphs

__all__ = ["over_rows", "within", "active", "paused", "outside", "whole_ops", "install"]
__all__ += ["RunWhole", "whole_asked", "ask_whole", "combined", "watching", "rows", "held"]
__all__ += ["taken", "running"]


class RunWhole(Exception):  # noqa: N818 (not an error: the call runs again, whole)
    """Raised by a reduction over the rows that is not a sum: the innermost layer's call runs
    again on the whole batch (`whole_calls`). Keras may raise it again as another exception
    with its own message on the way out: `whole_asked` says which layer asked, and why."""


@dataclass
class _Call:
    axes: RowAxes
    rows: Rows
    layers: list = field(default_factory=list)  # the calls running, outermost first
    #: The ops computing the whole batch's reductions, and which ops are computed from them.
    whole: dict = field(default_factory=dict)
    #: (layer, what it does over its rows, the sentence naming both): a call asked to run on
    #: the whole batch.
    asked: tuple | None = None


_state = threading.local()  # `call`: the replica's call on its rows; `paused`


def active() -> bool:
    """Whether this thread runs a layer call on a replica's rows."""
    return getattr(_state, "call", None) is not None


@contextlib.contextmanager
def _set(name: str, value, owner=_state) -> Iterator[None]:
    """Within this block `owner`'s (this thread's) `name` is `value`."""
    previous = getattr(owner, name, None)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


def over_rows(layer, seeds, rows: Rows) -> contextlib.AbstractContextManager:
    """Within this block (on this thread) `layer` is called on the replica's rows: `seeds` (the
    tensors of the call that are rows of the batch) and what is computed from them."""
    install()
    return _set("call", _Call(RowAxes(seeds), rows, [layer]))


def within(layer) -> contextlib.AbstractContextManager:
    """A layer called inside the call on the replica's rows (named in an error, and run whole);
    not one called in a function graph the call builds, a loop's body: the call around it."""
    call = _state.call
    kept = [] if nested.inside(call.axes.graph) else [layer]
    return _set("layers", call.layers + kept, owner=call)


def paused() -> contextlib.AbstractContextManager:
    """Within this block reductions and other ops are TensorFlow's own (kmirror's own values,
    an op its rule has checked)."""
    return _set("paused", True)


def outside() -> contextlib.AbstractContextManager:
    """In this block no call runs on the replica's rows (a call run whole: `whole_calls`)."""
    return _set("call", None)


def whole_asked(layer) -> tuple[str, str] | None:
    """If `layer`'s call asked to run on the whole batch (once): what it does over its rows,
    and the sentence that names the layer and says it."""
    call = getattr(_state, "call", None)
    if call is None or call.asked is None or call.asked[0] is not layer:
        return None
    asked, call.asked = call.asked[1:], None
    return asked


def watching() -> bool:
    """Whether kmirror follows the ops over the rows of a call on this thread (not paused)."""
    return _current() is not None


def ask_whole(what: str, layer=None) -> NoReturn:
    """The innermost call (or `layer`, one of the calls running: `running`) asks to run on the
    whole batch: `what` it does over its rows."""
    call = _state.call
    layer = layer or call.layers[-1]
    call.asked = (
        layer,
        what,
        f"kmirror: layer '{layer.name}' ({type(layer).__name__}) {what}. A replica holds only "
        "its rows of the batch, so it cannot compute one device's value.",
    )
    raise RunWhole(call.asked[2])


def running() -> list:
    """The layer calls running on the replica's rows, outermost first."""
    return _state.call.layers


def rows() -> Rows:
    """The replica's rows of the call running."""
    return _state.call.rows


def held(tensor) -> frozenset | None:
    """The axes of `tensor` that hold the rows of the call running (`RowAxes.of`)."""
    return _state.call.axes.of(tensor)


def combined(what: str) -> NoReturn:
    """An op of the call running combines its rows (`what` it does): the call runs whole."""
    ask_whole(what)


def taken(tensor) -> None:
    """`tensor` holds the rows of the call running in axis 0: kmirror took them for it (its rows
    of a call run on the whole batch, whose rows it joined through its own collectives)."""
    _state.call.axes.seed(tensor)


def whole_ops() -> dict | None:
    """The ops of the call running that compute the whole batch's reductions, and whether each
    other op seen is computed from them (None: no call runs)."""
    call = getattr(_state, "call", None)
    return None if call is None else call.whole


def _current() -> _Call | None:
    call = getattr(_state, "call", None)
    off = call is None or getattr(_state, "paused", False) or not call.rows.global_statistics
    return None if off else call


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
            with paused():  # not over the rows (`other_ops` need not check it)
                return original(*args, **kwargs)
        inside = nested.inside(call.axes.graph)  # no collective can run there
        if op_type in _SUMS and axes is not None and held <= axes and not inside:
            keepdims = bool(given.get("keep_dims", False))
            with paused():
                value = batch_sums.whole_batch(
                    op_type, tensor, sorted(axes), keepdims, call.rows, _ORIGINAL["_sum"]
                )
            call.whole[value.op] = True
            explaining.summed(call.layers[-1])
            return value
        ask_whole(_described(op_type, held, axes, inside))

    reduction.__name__ = original.__name__
    return reduction


_SUMS = ("Sum", "Mean")
# fmt: off
_NAMES = {
    "Sum": "a sum", "Mean": "a mean", "Max": "a maximum", "Min": "a minimum",
    "Prod": "a product", "EuclideanNorm": "a norm", "ArgMax": "an arg-max",
    "ArgMin": "an arg-min", "Cumsum": "a cumulative sum", "Cumprod": "a cumulative product",
    "TopKV2": "a top-k or a sort", "Any": "an any", "All": "an all",
}
# fmt: on


def _described(op_type: str, held, axes, inside: bool) -> str:
    known = sorted(axes) if axes is not None else "unknown"
    grouped = " (the rows regrouped: a statistic per group of rows)" if op_type in _SUMS else ""
    grouped = " in a loop's body or a condition's branch it builds" if inside else grouped
    return (
        f"takes {_NAMES[op_type]} over axes {known} of a tensor holding the rows of its call in "
        f"axes {sorted(held)}{grouped}"
    )


_ORIGINAL: dict = {}
_install_lock = threading.Lock()


def install() -> None:
    """Puts kmirror's reductions in place (once per process); outside a call on a replica's rows
    they are TensorFlow's."""
    with _install_lock:
        if _ORIGINAL:
            return
        for module, name, op_type in graphs.reduction_functions():
            original = getattr(module, name)
            _ORIGINAL[name] = original
            setattr(module, name, _replacement(original, op_type))
