"""An op that combines different rows of a layer call runs the call whole.

Beside reductions (`reductions`), a layer's call can combine its rows with ops whose value at
one row reads others: a matrix product or einsum summing over the rows (a Gram matrix or a
cross-correlation of the batch) or pairing rows with each other (attention over the batch), a
softmax, a segment reduction or a count over the rows, a roll or reversal of them, a slice, a
padding or a gather that takes rows by their place in the batch (`x[1:] - x[:-1]`, `x[0]`). A
replica would compute these over its share of the rows only: each asks for the layer whose call
makes it to run on the whole batch (`reductions.ask_whole`, `whole_calls`), where it is exact.

Each rule says, from where its inputs hold the rows (`reductions.held`), whether the op combines
them; an op over other axes (a `Dense` layer's product with its kernel, attention within each
row, a slice of the features, a gather of the rows a mask selects) is TensorFlow's own, as is
every op outside a call on a replica's rows or while kmirror computes its own (`paused`).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from kmirror._core import tf_hooks
from kmirror._core.keras_hooks import reductions
from kmirror._core.keras_hooks.row_axes import reduced_axes

__all__ = ["install"]


def _held(tensor) -> frozenset:
    return reductions.held(tensor) or frozenset()


def _rank(tensor) -> int | None:
    return tensor.shape.rank if tf.is_tensor(tensor) else None


def _static(value) -> np.ndarray | None:  # flat
    return None if (found := tf.get_static_value(value)) is None else np.reshape(found, -1)


def _axes(value, tensor) -> set | None:
    """The axes (non-negative) of `tensor` that `value` names, if known."""
    return reduced_axes(value, tensor) if tf.is_tensor(tensor) else None


def _labels(subscripts: str, rank: int | None) -> list[str] | None:
    """An einsum operand's label for each of its axes; those `...` stands for labelled by their
    place from its end (`.0` the last), as broadcasting aligns them."""
    if "..." not in subscripts or rank is None:
        return None if "..." in subscripts else list(subscripts)
    before, after = subscripts.split("...")
    covered = rank - len(before) - len(after)
    return [*before, *(f".{covered - 1 - i}" for i in range(covered)), *after]


def _product(operands, output: str) -> str | None:
    """Whether a product of `operands` ((tensor, subscripts) as an einsum writes them) into
    `output`'s subscripts sums over the rows, or pairs rows held in different axes."""
    held = []
    for tensor, subscripts in operands:
        axes = _held(tensor)
        if axes:
            labels = _labels(subscripts, _rank(tensor))
            if labels is None:
                return "takes a product of a tensor holding the rows of its call"
            held.append(frozenset(labels[a] for a in axes))
    if not held:
        return None
    kept = set(output) | ({"."} if "..." in output else set())
    if any((label[0] if label[0] == "." else label) not in kept for ls in held for label in ls):
        return "takes a product that sums over the rows of its call (a matrix product or einsum)"
    if len(set(held)) > 1:
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


def _over(tensor, axes, what: str) -> str | None:
    """`what`, where `axes` (unknown: None) of `tensor` hold its call's rows."""
    held = _held(tensor)
    if held and (axes is None or held & axes):
        return f"{what} over axes {sorted(held)} of a tensor holding the rows of its call"
    return None


def _last(tensor) -> set | None:
    rank = _rank(tensor)
    return None if rank is None else {rank - 1}


def _softmax(given) -> str | None:
    return _over(given["logits"], _last(given["logits"]), "takes a softmax")


def _segment(given) -> str | None:
    ids = given["segment_ids"]
    rank = _rank(ids)
    axes = None if rank is None else set(range(rank))
    return _over(given["data"], axes, "takes a segment reduction") or _over(
        ids, None, "takes a segment reduction by segment ids"
    )


def _sparse_segment(given) -> str | None:
    what = "takes a segment reduction"
    return _over(given["data"], {0}, what) or _over(given["indices"], None, what)


def _dense_bincount(given) -> str | None:
    return _over(given["input"], _last(given["input"]), "counts values")


def _along(argument: str, what: str) -> Callable:
    def rule(given) -> str | None:
        return _over(given[argument], _axes(given["axis"], given[argument]), what)

    return rule


def _elements(vector) -> list | None:
    """Each element of a 1-D `vector` where it is known, else None for it."""
    value = _static(vector)
    if value is not None:
        return [int(v) for v in value]
    if getattr(vector, "op", None) is not None and vector.op.type == "Pack":
        return [None if (v := _static(t)) is None else int(v[0]) for t in vector.op.inputs]
    return None


def _strided_slice(given) -> str | None:
    tensor = given["input"]
    held, rank = _held(tensor), _rank(tensor)
    begin, strides = _elements(given["begin"]), _elements(given["strides"])
    if not held or rank is None or begin is None or strides is None:
        return _over(tensor, None, "takes a slice")
    masks = {name: given[f"{name}_mask"] for name in ("begin", "end", "ellipsis", "new_axis")}
    spanned = ~(masks["new_axis"] | masks["ellipsis"])  # the entries taking an axis each
    axis, partial = 0, set()
    for i in range(len(begin)):
        if masks["ellipsis"] >> i & 1:
            axis += rank - sum(spanned >> j & 1 for j in range(len(begin)))
        elif not masks["new_axis"] >> i & 1:
            whole = (
                (masks["begin"] >> i & 1 or begin[i] == 0)
                and masks["end"] >> i & 1
                and strides[i] == 1
                and not given["shrink_axis_mask"] >> i & 1
            )
            partial |= set() if whole else {axis}
            axis += 1
    return _over(tensor, partial, "takes a slice") if partial else None


def _slice(given) -> str | None:
    tensor = given["input"]
    begin, size = _elements(given["begin"]), _elements(given["size"])
    if begin is None or size is None:
        return _over(tensor, None, "takes a slice")
    partial = {a for a, (b, s) in enumerate(zip(begin, size)) if b != 0 or s != -1}
    return _over(tensor, partial, "takes a slice") if partial else None


def _gather(given) -> str | None:
    params, indices = given["params"], given["indices"]
    if _held(indices):  # rows selected per row of the call (by a mask, a row's own index)
        return None
    return _over(params, _axes(given["axis"], params), "gathers rows by index")


def _pad(given) -> str | None:
    tensor = given["input"]
    paddings = _static(given["paddings"])
    if paddings is None:
        return _over(tensor, None, "pads the values")
    padded = {a for a, pair in enumerate(paddings.reshape(-1, 2)) if pair.any()}
    return _over(tensor, padded, "pads the values") if padded else None


_RULES: dict[str, Callable] = {
    "MatMul": _mat_mul,
    "BatchMatMulV2": _batch_mat_mul,
    "BatchMatMulV3": _batch_mat_mul,
    "Einsum": _einsum,
    "Softmax": _softmax,
    "Segment": _segment,
    "SparseSegment": _sparse_segment,
    "Bincount": lambda given: _over(given["arr"], None, "counts values"),
    "DenseBincount": _dense_bincount,
    "Roll": _along("input", "rolls the values"),
    "ReverseV2": _along("tensor", "reverses the values"),
    "StridedSlice": _strided_slice,
    "Slice": _slice,
    "GatherV2": _gather,
    "Pad": _pad,
}


def _replacement(original: Callable, rule: Callable) -> Callable:
    signature = inspect.signature(original)

    def op(*args, **kwargs):
        if reductions.watching():
            given = signature.bind(*args, **kwargs)
            given.apply_defaults()
            what = rule(given.arguments)
            if what is not None:
                reductions.ask_whole(what)
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
        for module, name, op_type in tf_hooks.mixing_functions():
            if hasattr(module, name):  # `segment_sum_v2` is newer than some TensorFlow releases
                setattr(module, name, _replacement(getattr(module, name), _RULES[op_type]))
                _installed.append(name)
