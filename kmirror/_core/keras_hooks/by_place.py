"""Ops that take the rows of a layer call by their place in the batch, or by their count.

A replica's rows of a call are some of the batch's: the first of them is not the batch's first
row, and there are fewer of them. An op that takes rows by their place (a slice `x[1:]`, `x[0]`,
a padding of the rows, a gather or `gather_nd` by indices that are not per row, a scatter into
the rows) or computes with their count as a number (`ops.cast(ops.shape(x)[0], "float32")`, a
sum divided by it, `ops.size(x)`) would compute the replica's value, not one device's. Each rule
here says so from where its inputs hold the rows (`reductions.held`), and the call runs whole
(`mixing`, which installs these rules with its own). The count used as a shape (a reshape, a
draw of one value per row) is the replica's, as it should be: only its cast to a number asks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from kmirror._core.keras_hooks import reductions
from kmirror._core.keras_hooks.moves import shape_read
from kmirror._core.keras_hooks.row_axes import reduced_axes

__all__ = ["RULES", "held", "rank", "over", "named_axes", "static", "counts_rows"]


def held(tensor) -> frozenset:
    """The axes of `tensor` holding the rows of the call running (none: empty)."""
    return reductions.held(tensor) or frozenset()


def rank(tensor) -> int | None:
    return tensor.shape.rank if tf.is_tensor(tensor) else None


def static(value) -> np.ndarray | None:
    """`value`'s elements (flat), where they are all known (a list of tensors: each known)."""
    if isinstance(value, list | tuple):
        found = [static(v) for v in value]
        return None if any(v is None for v in found) else np.concatenate(found or [[]])
    return None if (found := tf.get_static_value(value)) is None else np.reshape(found, -1)


def named_axes(value, tensor) -> set | None:
    """The axes (non-negative) of `tensor` that `value` names, if known."""
    return reduced_axes(value, tensor) if tf.is_tensor(tensor) else None


def over(tensor, axes, what: str) -> str | None:
    """`what`, where `axes` (unknown: None) of `tensor` hold its call's rows."""
    rows = held(tensor)
    if rows and (axes is None or rows & axes):
        return f"{what} over axes {sorted(rows)} of a tensor holding the rows of its call"
    return None


def _elements(vector) -> list | None:
    """Each element of a 1-D `vector` where it is known, else None for it."""
    value = static(vector)
    if value is not None:
        return [int(v) for v in value]
    if getattr(vector, "op", None) is not None and vector.op.type == "Pack":
        return [None if (v := static(t)) is None else int(v[0]) for t in vector.op.inputs]
    return None


def _strided_slice(given) -> str | None:
    tensor = given["input"]
    rows, dims = held(tensor), rank(tensor)
    begin, strides = _elements(given["begin"]), _elements(given["strides"])
    if not rows or dims is None or begin is None or strides is None:
        return over(tensor, None, "takes a slice")
    masks = {name: given[f"{name}_mask"] for name in ("begin", "end", "ellipsis", "new_axis")}
    spanned = ~(masks["new_axis"] | masks["ellipsis"])  # the entries taking an axis each
    axis, partial = 0, set()
    for i in range(len(begin)):
        if masks["ellipsis"] >> i & 1:
            axis += dims - sum(spanned >> j & 1 for j in range(len(begin)))
        elif not masks["new_axis"] >> i & 1:
            whole = (
                (masks["begin"] >> i & 1 or begin[i] == 0)
                and masks["end"] >> i & 1
                and strides[i] == 1
                and not given["shrink_axis_mask"] >> i & 1
            )
            partial |= set() if whole else {axis}
            axis += 1
    return over(tensor, partial, "takes a slice") if partial else None


def _slice(given) -> str | None:
    tensor = given["input"]
    begin, size = _elements(given["begin"]), _elements(given["size"])
    if begin is None or size is None:
        return over(tensor, None, "takes a slice")
    partial = {a for a, (b, s) in enumerate(zip(begin, size)) if b != 0 or s != -1}
    return over(tensor, partial, "takes a slice") if partial else None


def _gather(given) -> str | None:
    params, indices = given["params"], given["indices"]
    if held(indices):  # rows selected per row of the call (by a mask, a row's own index)
        return None
    return over(params, named_axes(given["axis"], params), "gathers rows by index")


def _indexed(tensor, indices, what: str) -> str | None:
    """`what` (a `gather_nd` or a scatter) by `indices` whose last axis indexes `tensor`'s first
    axes; indices per row of the call (each row its own) take no other row."""
    if held(indices):
        return None
    depth = indices.shape[-1] if tf.is_tensor(indices) and indices.shape.rank else None
    return over(tensor, None if depth is None else set(range(depth)), what)


def _pad(given) -> str | None:
    tensor = given["input"]
    paddings = static(given["paddings"])
    if paddings is None:
        return over(tensor, None, "pads the values")
    padded = {a for a, pair in enumerate(paddings.reshape(-1, 2)) if pair.any()}
    return over(tensor, padded, "pads the values") if padded else None


#: The integer ops a count of the rows keeps being a count through (`n * 2`, `max(n, 1)`).
_COUNTING = {"StridedSlice", "Prod", "Pack", "Mul", "Add", "AddV2", "Sub", "Maximum", "Minimum"}
_COUNTING |= {"FloorDiv", "Cast", "Identity", "Range", "Squeeze", "Reshape", "ConcatV2"}


def counts_rows(tensor, depth: int = 8) -> bool:
    """Whether integer `tensor` is computed from the count of the call's rows: the size of a
    tensor holding them, or the dimension of its shape that holds them."""
    op = getattr(tensor, "op", None)
    if op is None or not tensor.dtype.is_integer:
        return False
    if op.type in ("Shape", "Size"):
        return bool(held(op.inputs[0]))
    read = shape_read(tensor)
    if read is not None:  # the dimensions of some axes: the rows' count if they hold the rows
        shaped, axes = read
        return bool(held(shaped) & axes) if axes is not None else bool(held(shaped))
    if depth == 0 or op.type not in _COUNTING:
        return False
    return any(counts_rows(source, depth - 1) for source in op.inputs)


def _cast(given) -> str | None:
    number = tf.as_dtype(given["DstT"])
    if not (number.is_floating or number.is_complex) or not counts_rows(given["x"]):
        return None
    return "computes with the count of the rows of its call as a number (ops.shape(x)[0])"


RULES: dict[str, Callable] = {
    "StridedSlice": _strided_slice,
    "Slice": _slice,
    "GatherV2": _gather,
    "GatherNd": lambda given: _indexed(given["params"], given["indices"], "gathers rows by index"),
    "TensorScatter": lambda given: _indexed(
        given["tensor"], given["indices"], "scatters values into rows by index"
    ),
    "Pad": _pad,
    "Cast": _cast,
}
