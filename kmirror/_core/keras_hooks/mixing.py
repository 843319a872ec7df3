"""An op that combines different rows of a layer call runs the call whole.

Beside reductions (`reductions`), a layer's call can combine its rows with ops whose value at
one row reads others: a matrix product or einsum summing over the rows (a Gram matrix or a
cross-correlation of the batch) or pairing rows with each other (attention over the batch), a
softmax, a segment reduction or a count over the rows, a roll or reversal of them, a convolution
or pooling along them, a slice, a padding or a gather that takes rows by their place in the batch
(`x[1:] - x[:-1]`, `x[0]`). A replica would compute these over its share of the rows only: each
asks for the layer whose call makes it to run on the whole batch (`reductions.ask_whole`,
`whole_calls`), where it is exact.

Each rule says, from where its inputs hold the rows (`reductions.held`), whether the op combines
them; an op over other axes (a `Dense` layer's product with its kernel, attention within each
row, a slice of the features, a gather of the rows a mask selects) is TensorFlow's own, as is
every op outside a call on a replica's rows or while kmirror computes its own (`paused`).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

from kmirror._core.keras_hooks import by_place, reductions
from kmirror._core.keras_hooks.by_place import held, named_axes, over, rank
from kmirror._core.tf_hooks import graphs

__all__ = ["install"]


def _labels(subscripts: str, dims: int | None) -> list[str] | None:
    """An einsum operand's label for each of its axes; those `...` stands for labelled by their
    place from its end (`.0` the last), as broadcasting aligns them."""
    if "..." not in subscripts or dims is None:
        return None if "..." in subscripts else list(subscripts)
    before, after = subscripts.split("...")
    covered = dims - len(before) - len(after)
    return [*before, *(f".{covered - 1 - i}" for i in range(covered)), *after]


def _product(operands, output: str) -> str | None:
    """Whether a product of `operands` ((tensor, subscripts) as an einsum writes them) into
    `output`'s subscripts sums over the rows, or pairs rows held in different axes."""
    labelled = []  # each operand's labels of the axes holding the rows
    for tensor, subscripts in operands:
        axes = held(tensor)
        if axes:
            labels = _labels(subscripts, rank(tensor))
            if labels is None:
                return "takes a product of a tensor holding the rows of its call"
            labelled.append(frozenset(labels[a] for a in axes))
    if not labelled:
        return None
    kept = set(output) | ({"."} if "..." in output else set())
    if any((lb[0] if lb[0] == "." else lb) not in kept for ls in labelled for lb in ls):
        return "takes a product that sums over the rows of its call (a matrix product or einsum)"
    if len(set(labelled)) > 1:
        return "takes a product that pairs the rows of its call with each other"
    return None


def _mat_mul(given) -> str | None:
    a = "ki" if given["transpose_a"] else "ik"
    b = "jk" if given["transpose_b"] else "kj"
    return _product([(given["a"], a), (given["b"], b)], "ij")


def _batch_mat_mul(given) -> str | None:
    x = "...ki" if given["adj_x"] else "...ik"
    y = "...jk" if given["adj_y"] else "...kj"
    return _product([(given["x"], x), (given["y"], y)], "...ij")


def _einsum(given) -> str | None:
    equation = given["equation"].replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    if not arrow:  # the output implied: the labels written once
        output = "".join(c for c in inputs if c.isalpha() and inputs.count(c) == 1)
        output += "..." if "..." in inputs else ""
    return _product(list(zip(given["inputs"], inputs.split(","))), output)


def _last(tensor) -> set | None:
    dims = rank(tensor)
    return None if dims is None else {dims - 1}


def _softmax(given) -> str | None:
    return over(given["logits"], _last(given["logits"]), "takes a softmax")


def _segment(given) -> str | None:
    ids = given["segment_ids"]
    dims = rank(ids)
    axes = None if dims is None else set(range(dims))
    return over(given["data"], axes, "takes a segment reduction") or over(
        ids, None, "takes a segment reduction by segment ids"
    )


def _sparse_segment(given) -> str | None:
    what = "takes a segment reduction"
    return over(given["data"], {0}, what) or over(given["indices"], None, what)


def _dense_bincount(given) -> str | None:
    return over(given["input"], _last(given["input"]), "counts values")


def _window(argument: str, channels: bool, what: str) -> Callable:
    """A convolution or pooling of `argument` (`avg_pool` calls it `value`): over every axis
    but the batch's (the first `batch_dims`), or over its spatial axes only (`channels` False: a
    depthwise convolution, a pooling), which the data format places after or before the
    channels."""

    def rule(given) -> str | None:
        tensor, batch = given.get(argument, given.get("value")), given.get("batch_dims", 1)
        dims = rank(tensor)
        if dims is None:
            return over(tensor, None, what)
        axes = set(range(batch, dims))
        if not channels:
            axes -= {1 if str(given.get("data_format", "")).startswith("NC") else dims - 1}
        return over(tensor, axes, what)

    return rule


def _along(argument: str, what: str) -> Callable:
    def rule(given) -> str | None:
        return over(given[argument], named_axes(given["axis"], given[argument]), what)

    return rule


_RULES: dict[str, Callable] = {
    "MatMul": _mat_mul,
    "BatchMatMulV2": _batch_mat_mul,
    "BatchMatMulV3": _batch_mat_mul,
    "Einsum": _einsum,
    "Softmax": _softmax,
    "Segment": _segment,
    "SparseSegment": _sparse_segment,
    "Bincount": lambda given: over(given["arr"], None, "counts values"),
    "DenseBincount": _dense_bincount,
    "Roll": _along("input", "rolls the values"),
    "ReverseV2": _along("tensor", "reverses the values"),
    "Conv": _window("input", True, "convolves the values"),
    "ConvTranspose": _window("out_backprop", True, "convolves the values (transposed)"),
    "DepthwiseConv": _window("input", False, "convolves the values"),
    "Pool": _window("input", False, "pools the values"),
    **by_place.RULES,
}


def _replacement(original: Callable, rule: Callable) -> Callable:
    signature = inspect.signature(original)

    def op(*args, **kwargs):
        if not reductions.watching():
            return original(*args, **kwargs)
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        what = rule(given.arguments)
        if what is not None:
            reductions.combined(what)  # runs the call whole
        with reductions.paused():  # checked (`other_ops` need not)
            return original(*args, **kwargs)

    op.__name__ = original.__name__
    return op


_installed: list = []
_install_lock = threading.Lock()


def install() -> None:
    """Puts the rules in place, once per process."""
    with _install_lock:
        if _installed:
            return
        for module, name, op_type in graphs.mixing_functions():
            if hasattr(module, name):  # `segment_sum_v2` is newer than some TensorFlow releases
                setattr(module, name, _replacement(getattr(module, name), _RULES[op_type]))
                _installed.append(name)
