"""Which axes of a tensor computed in a layer call hold the rows of the call.

A replica computes a layer call on its rows of the batch. A tensor of the call holds those rows in
some of its axes: its inputs in axis 0; a `Dense` or a convolution's output in axis 0 as well; a
transpose moves them; a reshape may merge them with other values (`(rows, T, D)` to `(rows*T, D)`,
still in axis 0) or part them into groups over two axes (`(rows, D)` to `(4, rows/4, D)`, in axes 0
and 1). A statistic over the rows holds none: it is one value for all of them. `RowAxes.of` says
which, from the traced graph: each op's rule, from where its inputs hold the rows. An op computing
each element from its inputs' (`elementwise`) holds them where its inputs do, aligned from the last
axis. An op with no rule of its own keeps an input's row axis where its output has the same
dimension there (unknown in both, or equal): at the same axis, else aligned from the last axis.

The tensors a call is given are the seeds: rows in axis 0. A tensor the call's graph does not
compute from them (a weight, a constant, a captured table) holds no rows (`None`). In a function
graph the call builds, a loop's variable may hold them (`nested.loop_rows`); what a loop, a
condition or a tensor list gives back holds them where its body, branches or elements do.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from kmirror._core.keras_hooks import elementwise, nested

__all__ = ["RowAxes", "NONE", "shape_read"]

#: Computed from the rows, with no axis holding them (a statistic, a shape).
NONE: frozenset = frozenset()

_REDUCTIONS = {"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"}
_SHAPES = {"Shape", "ShapeN", "Size", "Rank"}
_SLICES = {"Slice", "Pad", "PadV2", "MirrorPad"}
_MASKS = ("begin", "end", "ellipsis", "new_axis", "shrink_axis")


class RowAxes:
    """Where the rows of one replica's layer call sit in the tensors the call computes."""

    def __init__(self, seeds) -> None:
        self.graph = tf.compat.v1.get_default_graph()  # the call's
        self._known: dict = {}  # a tensor's ref -> the axes holding the rows, or None
        for seed in seeds:
            self.seed(seed)

    def seed(self, tensor) -> None:
        """`tensor` holds the call's rows in axis 0: an input, or rows kmirror took for it."""
        if _symbolic(tensor) and tensor.shape.rank:
            self._known[tensor.ref()] = frozenset({0})

    def of(self, tensor) -> frozenset | None:
        """The axes of `tensor` holding the call's rows; `NONE` when it is computed from them
        but holds none; None when it is not computed from them."""
        if not _symbolic(tensor):
            return None
        stack = [tensor]
        while stack:
            top = stack[-1]
            if top.ref() in self._known:
                stack.pop()
                continue
            sources = _sources(top)
            missing = [s for s in sources if s.ref() not in self._known]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            self._known[top.ref()] = self._rule(top, [self._known[s.ref()] for s in sources])
        return self._known[tensor.ref()]

    def _rule(self, tensor, held: list) -> frozenset | None:
        op = tensor.op
        if op.type == "Placeholder":  # of a nested function: a capture, or a loop's variable
            return held[0] if held else nested.loop_rows(tensor, self.graph)
        if all(h is None for h in held):
            return None
        if op.type in nested.CARRIERS:  # a loop, a condition, a tensor list
            return nested.carried(tensor, held, self.of, lambda: _kept(tensor, op.inputs, held))
        if op.type in _SHAPES or tensor.shape.rank is None:
            return NONE
        if op.type in elementwise.BROADCAST:  # whatever the dimensions broadcasting made known
            return elementwise.aligned(tensor.shape.rank, op.inputs, held)
        rows = held[0] if op.inputs else None
        if (op.type in _REDUCTIONS or op.type in ("ArgMax", "ArgMin")) and rows is not None:
            keepdims = op.type in _REDUCTIONS and op.get_attr("keep_dims")
            return _reduced(rows, reduced_axes(op.inputs[1], op.inputs[0]), keepdims)
        known = op.inputs and op.inputs[0].shape.rank is not None
        if op.type == "StridedSlice" and rows is not None and known and op.inputs[1].shape[0]:
            return _sliced(op, rows)
        if op.type in _SLICES and rows is not None:
            return rows  # some of the rows, or the rows padded: where they were
        if op.type == "Reshape" and rows is not None:
            return _reshaped(self, op, rows)
        if op.type == "Transpose" and rows is not None:
            if (perm := tf.get_static_value(op.inputs[1])) is None:
                return NONE
            return frozenset(list(np.asarray(perm).reshape(-1)).index(axis) for axis in rows)
        if op.type == "ExpandDims" and rows is not None:
            axis = tf.get_static_value(op.inputs[1])
            if axis is None:
                return NONE
            axis = int(np.asarray(axis).reshape(-1)[0]) % tensor.shape.rank
            return frozenset(a + 1 if a >= axis else a for a in rows)
        if op.type == "Squeeze" and rows is not None:
            rank = op.inputs[0].shape.rank
            dims = {d % rank for d in op.get_attr("squeeze_dims")} if rank is not None else set()
            if not dims or rows & dims:
                return NONE
            return frozenset(a - sum(d < a for d in dims) for a in rows)
        return _kept(tensor, op.inputs, held)


def _sliced(op, rows: frozenset) -> frozenset:
    """Where `x[...]` puts the rows: each axis it keeps past the axes it drops (an index, `x[0]`)
    or inserts (`x[None]`); `NONE` where it takes one row (`x[0]` of the rows)."""
    rank, specs = op.inputs[0].shape.rank, op.inputs[1].shape[0]
    bits = {name: op.get_attr(f"{name}_mask") for name in ("ellipsis", "new_axis", "shrink_axis")}
    spanned = sum(1 for i in range(specs) if not (bits["ellipsis"] | bits["new_axis"]) >> i & 1)
    where, axis, out = {}, 0, 0
    for i in range(specs):
        if bits["ellipsis"] >> i & 1:
            for _ in range(rank - spanned):
                where[axis], axis, out = out, axis + 1, out + 1
        elif bits["new_axis"] >> i & 1:
            out += 1
        else:
            kept = not bits["shrink_axis"] >> i & 1
            where[axis], axis, out = (out if kept else None), axis + 1, out + kept
    where.update({a: out + a - axis for a in range(axis, rank)})
    if any(where[a] is None for a in rows):
        return NONE
    return frozenset(where[a] for a in rows)


def reduced_axes(axes, tensor) -> set | None:
    """The axes (non-negative) a reduction of `tensor` over `axes` takes, if known."""
    rank = tensor.shape.rank
    value = tf.get_static_value(axes)
    if value is None or rank is None:
        return None
    return {int(a) % rank for a in np.asarray(value).reshape(-1)}


def _reduced(rows: frozenset, axes: set | None, keepdims: bool) -> frozenset:
    if axes is None or rows & axes:
        return NONE  # one value over the rows (made the whole batch's where it is a sum)
    if keepdims:
        return rows
    return frozenset(a - sum(r < a for r in axes) for a in rows)


def _reshaped(axes: RowAxes, op, rows: frozenset) -> frozenset:
    """Where a reshape of a tensor holding its rows in axis 0 puts them: in axis 0 when each
    row's values stay together (the first dimension asked is the rows' count, or -1 with a row's
    size a multiple of the rest); else over the first axes whose sizes, multiplied, cover them."""
    source, target = op.inputs[0], op.outputs[0]
    if rows != {0} or target.shape.rank is None or target.shape.rank == 0:
        return NONE
    first = _first_asked(op.inputs[1])
    if (read := shape_read(first)) and read[1] == {0} and axes.of(read[0]) == {0}:  # shape(x)[0]
        return frozenset({0})
    per_row = _size(source.shape[1:])
    dims = list(target.shape)
    if op.inputs[1].op.type == "Pack" and len(op.inputs[1].op.inputs) == len(dims):
        asked = [_static_int(t) for t in op.inputs[1].op.inputs]  # -1: inferred, unknown
        dims = [d if d is not None or a is None or a < 0 else a for d, a in zip(dims, asked)]
    if per_row is None:
        return frozenset({0}) if first == -1 else frozenset({0, 1} & set(range(len(dims))))
    for last in range(len(dims)):
        rest = _size(dims[last + 1 :])
        if rest is not None and per_row % rest == 0:
            return frozenset(range(last + 1))
    return frozenset({0})


def _first_asked(shape):
    """The first dimension a reshape asks for: an int, a tensor, or None when not known."""
    value = tf.get_static_value(shape)
    if value is not None and np.size(value):
        return int(np.asarray(value).reshape(-1)[0])
    if hasattr(shape, "op") and shape.op.type == "Pack":
        first = shape.op.inputs[0]
        static = tf.get_static_value(first)
        return int(static) if static is not None else first
    return None


def _static_int(tensor) -> int | None:
    """A dimension a reshape asks for, where it is known: a constant, or the product of static
    dimensions of a tensor's shape (`tf.tensordot`'s `prod(gather(shape(x), axes))`)."""
    value = tf.get_static_value(tensor)
    if value is not None:
        return int(np.asarray(value).reshape(-1)[0])
    op = tensor.op
    if op.type != "Prod" or op.inputs[0].op.type != "GatherV2":
        return None
    shape, picked = op.inputs[0].op.inputs[0], tf.get_static_value(op.inputs[0].op.inputs[1])
    if shape.op.type != "Shape" or picked is None:
        return None
    dims = [shape.op.inputs[0].shape[int(i)] for i in np.asarray(picked).reshape(-1)]
    return None if None in dims else math.prod(dims)


def shape_read(tensor) -> tuple | None:
    """For a slice of a tensor's shape (`tf.shape(x)[0]`, `tf.shape(x)[1:]`): `(x, the axes of x
    whose dimensions it reads)`, those axes None where not known; None for any other tensor."""
    op = getattr(tensor, "op", None)
    if op is None or op.type != "StridedSlice" or op.inputs[0].op.type != "Shape":
        return None
    shaped, bounds = op.inputs[0].op.inputs[0], [tf.get_static_value(t) for t in op.inputs[1:]]
    rank, mask = shaped.shape.rank, {n: op.get_attr(f"{n}_mask") & 1 for n in _MASKS}
    if not rank or any(b is None for b in bounds) or mask["new_axis"] or mask["ellipsis"]:
        return shaped, None
    begin, end, stride = (int(np.asarray(b).reshape(-1)[0]) for b in bounds)
    picked = range(rank)[None if mask["begin"] else begin : None if mask["end"] else end : stride]
    return shaped, {begin % rank} if mask["shrink_axis"] else set(picked)


def _kept(tensor, inputs, held: list) -> frozenset:
    """An input's row axes where the output has the same dimension there: at the same axes
    (a matmul, a convolution, a lookup by the rows' indices), else aligned from the last axis,
    as broadcasting aligns them; `NONE` where no input's rows are kept."""
    out = tensor.shape
    for source, rows in zip(inputs, held):
        if not rows or source.shape.rank is None:
            continue
        for shift in dict.fromkeys((0, out.rank - source.shape.rank)):
            moved = [a + shift for a in rows]
            if all(0 <= m < out.rank and out[m] == source.shape[a] for a, m in zip(rows, moved)):
                return frozenset(moved)
    return NONE


def _size(dims) -> int | None:
    return None if any(d is None for d in dims) else math.prod(dims)


def _sources(tensor) -> list:
    """The tensors `tensor` is computed from: its op's inputs, or what a placeholder captures."""
    if tensor.op.type == "Placeholder":
        external = nested.captured(tensor)
        return [external] if _symbolic(external) else []
    return list(tensor.op.inputs)


def _symbolic(tensor) -> bool:
    return tf.is_tensor(tensor) and hasattr(tensor, "op") and not tf.executing_eagerly()
