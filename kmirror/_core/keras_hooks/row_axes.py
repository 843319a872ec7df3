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

import numpy as np
import tensorflow as tf

from kmirror._core.keras_hooks import elementwise, nested
from kmirror._core.keras_hooks.moves import (
    FIRST_AXIS_KEPT,
    NONE,
    anywhere,
    asked_dims,
    first_axis_kept,
    looked_up_by_row,
    reshaped,
    shape_read,
    size,
    sliced,
)

__all__ = ["RowAxes", "NONE", "shape_read", "anywhere"]


_REDUCTIONS = {"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"}
_SHAPES = {"Shape", "ShapeN", "Size", "Rank"}
_SLICES = {"Slice", "Pad", "PadV2", "MirrorPad"}


class RowAxes:
    """Where the rows of one replica's layer call sit in the tensors the call computes."""

    def __init__(self, seeds) -> None:
        self.graph = tf.compat.v1.get_default_graph()  # the call's
        self._known: dict = {}  # a tensor's ref -> the axes holding the rows, or None
        self._entries_known: dict = {}  # a tensor's ref -> entries of each row in axis 0
        for seed in seeds:
            self.seed(seed)

    def seed(self, tensor) -> None:
        """`tensor` holds the call's rows in axis 0: an input, or rows kmirror took for it."""
        if _symbolic(tensor) and tensor.shape.rank:
            self._known[tensor.ref()] = frozenset({0})
            self._entries_known[tensor.ref()] = 1

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

    def row_size(self, tensor) -> int | None:
        """How many values of `tensor`, which holds the rows in axis 0, each row has, where the
        graph proves it: a call's input, `(rows, H, W, D)`, has `H*W*D`; a reshape keeps each
        row's count (`(rows*H*W, D)` has `H*W*D` too: axis 0 holds `H*W` entries of each row);
        an op keeping its input's axis 0 as it is (an op computing each element from its
        inputs', a product with a kernel) has its own other axes' values per row, times the
        entries of a row in axis 0. None where the graph does not prove it."""
        entries = self._entries(tensor)
        rest = size(tensor.shape[1:]) if tensor.shape.rank else None
        return None if entries is None or rest is None else entries * rest

    def _entries(self, tensor) -> int | None:
        """How many entries of axis 0 of `tensor` (holding the rows there) each row has."""
        seen = []
        while self.of(tensor) == {0}:
            if tensor.ref() in self._entries_known:
                entries = self._entries_known[tensor.ref()]
                break
            seen.append(tensor)
            op = tensor.op
            if op.type == "Reshape":
                values = self.row_size(op.inputs[0])
                rest = size(asked_dims(op)[1:])
                known = values is not None and rest and values % rest == 0
                entries = values // rest if known else None
                break
            source = self._same_first_axis(tensor)
            if source is None:
                entries = None
                break
            tensor = source
        else:
            entries = None
        for tensor in seen:
            self._entries_known[tensor.ref()] = entries
        return entries

    def ungrouped(self, tensor) -> bool:
        """Whether axis 0 of `tensor`, holding the rows, holds entries of each row apart from
        each other (rows joined with rows along it, `tf.concat([x, y], 0)`): no reshape of it
        keeps each row's values together."""
        while self.of(tensor) == {0}:
            op = tensor.op
            if op.type == "ConcatV2":
                axis = tf.get_static_value(op.inputs[-1])
                return axis is None or int(axis) % max(tensor.shape.rank or 1, 1) == 0
            tensor = self._same_first_axis(tensor)
            if tensor is None:
                return False
        return False

    def _same_first_axis(self, tensor):
        """An input of `tensor`'s op whose axis 0 is `tensor`'s axis 0, entry for entry (an op
        computing each element from its inputs', a product with a kernel, a convolution); None
        for a call's input and for any op that may move, add or drop entries of axis 0."""
        op = tensor.op
        if op.type in _REDUCTIONS or op.type in ("ArgMax", "ArgMin"):  # over other axes only
            axes = reduced_axes(op.inputs[1], op.inputs[0])
            sources = [op.inputs[0]] if axes is not None and 0 not in axes else []
        elif op.type in elementwise.BROADCAST or op.type in FIRST_AXIS_KEPT:
            sources = list(op.inputs)
        elif op.type in ("Transpose", "ExpandDims", "Squeeze", "StridedSlice"):
            sources = [op.inputs[0]] if first_axis_kept(op) else []
        elif op.type in ("GatherV2", "ResourceGather") and looked_up_by_row(op):
            sources = [op.inputs[1]]  # a table's entries looked up by the rows' indices
        else:
            return None
        for source in sources:
            if self.of(source) == {0} and source.shape.rank and source.shape[0] == tensor.shape[0]:
                return source
        return None

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
            return sliced(op, rows)
        if op.type in _SLICES and rows is not None:
            return rows  # some of the rows, or the rows padded: where they were
        if op.type == "Reshape" and rows is not None:
            return reshaped(self, op, rows)
        if op.type == "Transpose" and rows is not None:
            if (perm := tf.get_static_value(op.inputs[1])) is None:
                return anywhere(tensor)
            return frozenset(list(np.asarray(perm).reshape(-1)).index(axis) for axis in rows)
        if op.type == "ExpandDims" and rows is not None:
            axis = tf.get_static_value(op.inputs[1])
            if axis is None:
                return anywhere(tensor)
            axis = int(np.asarray(axis).reshape(-1)[0]) % tensor.shape.rank
            return frozenset(a + 1 if a >= axis else a for a in rows)
        if op.type == "Squeeze" and rows is not None:
            rank = op.inputs[0].shape.rank
            dims = {d % rank for d in op.get_attr("squeeze_dims")} if rank is not None else set()
            if not dims or rows & dims:
                return anywhere(tensor)
            return frozenset(a - sum(d < a for d in dims) for a in rows)
        return _kept(tensor, op.inputs, held)


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


def _sources(tensor) -> list:
    """The tensors `tensor` is computed from: its op's inputs, or what a placeholder captures."""
    if tensor.op.type == "Placeholder":
        external = nested.captured(tensor)
        return [external] if _symbolic(external) else []
    return list(tensor.op.inputs)


def _symbolic(tensor) -> bool:
    return tf.is_tensor(tensor) and hasattr(tensor, "op") and not tf.executing_eagerly()
