"""Where ops that move values put the rows of a layer call: a reshape, a slice, a transpose, an
expansion or a squeeze (`row_axes`' rules for them), and which of them leave axis 0 as it is.

A reshape keeps the rows in axis 0 where each row's values stay together: the first dimension it
asks for is the rows' count (`tf.shape(x)[0]`, or the whole shape of a tensor holding them in axis
0), or the values of a row, counted through the ops before it (`RowAxes.row_size`: `(rows, T, D)`
to `(rows*T, D)` and back), fill whole entries of axis 0. Else it spreads them over the first axes
that cover them (groups of rows); a reshape of a tensor holding them in other axes leaves them
anywhere (`anywhere`): no rule proves where.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

__all__ = ["NONE", "anywhere", "reshaped", "sliced", "shape_read", "first_axis_kept"]
__all__ += ["looked_up_by_row", "FIRST_AXIS_KEPT", "asked_dims", "size", "first_dim_of"]

#: Computed from the rows, with no axis holding them (a statistic, a shape).
NONE: frozenset = frozenset()
_MASKS = ("begin", "end", "ellipsis", "new_axis", "shrink_axis")
#: Ops whose output's axis 0 is their first input's, entry for entry (of the same rank).
FIRST_AXIS_KEPT = {
    "Identity",
    "StopGradient",
    "MatMul",
    "BatchMatMulV2",
    "BatchMatMulV3",
    "Conv2D",
    "Conv3D",
    "DepthwiseConv2dNative",
    "Conv2DBackpropInput",
    "Conv3DBackpropInputV2",
    "MaxPool",
    "AvgPool",
    "MaxPool3D",
    "AvgPool3D",
    "Softmax",
    "LogSoftmax",
    "FusedBatchNormV3",
    "ExtractImagePatches",
    "OneHot",
    "Select",
    "EnsureShape",
}


def looked_up_by_row(op) -> bool:
    """Whether a gather's output has its indices' axis 0 as its own (a lookup in axis 0 of a
    table, without batch dimensions)."""
    if op.get_attr("batch_dims"):
        return False
    if op.type == "ResourceGather":
        return True
    axis = tf.get_static_value(op.inputs[2])
    return axis is not None and int(np.asarray(axis).reshape(-1)[0]) == 0


def first_axis_kept(op) -> bool:
    """Whether a transpose, an expansion, a squeeze or a slice leaves its input's axis 0 as it
    is: not moved, not sliced, nothing inserted before it."""
    if op.type == "Transpose":
        perm = tf.get_static_value(op.inputs[1])
        return perm is not None and int(np.asarray(perm).reshape(-1)[0]) == 0
    if op.type == "ExpandDims":
        axis = tf.get_static_value(op.inputs[1])
        return (
            axis is not None and int(np.asarray(axis).reshape(-1)[0]) % op.outputs[0].shape.rank > 0
        )
    if op.type == "Squeeze":
        rank = op.inputs[0].shape.rank
        dims = op.get_attr("squeeze_dims")
        return rank is not None and bool(dims) and all(d % rank for d in dims)
    bits = {name: op.get_attr(f"{name}_mask") & 1 for name in _MASKS}
    strides = tf.get_static_value(op.inputs[3])
    whole = bits["begin"] and bits["end"] and not (bits["shrink_axis"] or bits["new_axis"])
    whole = whole and not bits["ellipsis"] and strides is not None and np.size(strides) > 0
    return bool(whole) and int(np.asarray(strides).reshape(-1)[0]) == 1


def anywhere(tensor) -> frozenset:
    """Every axis of `tensor`: where no rule proves which of them hold the rows, any may. A sum
    over all of them is still the whole batch's; any other reduction or op over them runs the
    call whole, and a call that leaves such a tensor runs whole in the call around it."""
    rank = tensor.shape.rank
    return NONE if not rank else frozenset(range(rank))


def sliced(op, rows: frozenset) -> frozenset:
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


def reshaped(axes, op, rows: frozenset) -> frozenset:
    """Where a reshape of a tensor holding its rows in axis 0 puts them: in axis 0 when each
    row's values stay together (the first dimension asked is that of a tensor holding the rows
    in axis 0; or a row's values fill whole entries of axis 0: counted, or the reshape keeps the
    last axes as they are); else over the first axes whose sizes, multiplied, cover them (groups
    of rows); anywhere where no rule proves it."""
    source, target = op.inputs[0], op.outputs[0]
    if not rows or target.shape.rank is None or target.shape.rank == 0:
        return NONE
    if rows != {0} or axes.ungrouped(source):  # moved by a reshape where no rule follows
        return anywhere(target)
    found = first_dim_of(op.inputs[1])
    if found is not None and found[1] == 0 and axes.of(found[0]) == {0}:
        return frozenset({0})  # `tf.reshape(x, [tf.shape(y)[0], ...])`, `tf.shape(y)`
    dims = asked_dims(op)
    per_row, rest = axes.row_size(source), size(dims[1:])
    if per_row is not None and rest and per_row % rest == 0:
        return frozenset({0})  # each row's values stay together: `per_row / rest` entries
    if _trailing(source.shape, dims):
        return frozenset({0})  # `(rows, T, D)` to `(rows*T, D)`, whatever T is
    per_row = size(source.shape[1:])
    if per_row is None:
        return anywhere(target)
    for last in range(len(dims)):
        rest = size(dims[last + 1 :])
        if rest is not None and per_row % rest == 0:
            return frozenset(range(last + 1))
    return anywhere(target)


def _trailing(source, dims: list) -> bool:
    """Whether a reshape keeps the last axes of its input as they are (known), merging the
    others into its first axis."""
    if source.rank is None or not 1 < len(dims) <= source.rank:
        return False
    kept = list(source)[source.rank - len(dims) + 1 :]
    return None not in kept and kept == list(dims[1:])


def first_dim_of(shape) -> tuple | None:
    """For a shape a reshape asks for, made from another tensor's shape: `(that tensor, which of
    its axes the first dimension asked is)`; None where it is not known so (`tf.shape(x)`,
    `tf.shape(x)[0]` packed with others, `tf.concat([tf.shape(x)[:-1], [units]], 0)`, a gather of
    `tf.shape(x)`'s dimensions)."""
    op = getattr(shape, "op", None)
    if op is None:
        return None
    if op.type == "Shape":
        return op.inputs[0], 0
    if op.type == "StridedSlice" and (read := shape_read(shape)) is not None and read[1]:
        return read[0], min(read[1])
    if op.type == "GatherV2" and op.inputs[0].op.type == "Shape":
        picked = tf.get_static_value(op.inputs[1])
        if picked is not None and np.size(picked):
            return op.inputs[0].op.inputs[0], int(np.asarray(picked).reshape(-1)[0])
    if op.type == "ConcatV2" and op.inputs[0].shape.rank == 1 and op.inputs[0].shape[0]:
        return first_dim_of(op.inputs[0])
    if op.type == "Pack" and (read := shape_read(op.inputs[0])) is not None and read[1]:
        return read[0], min(read[1])
    return None


def asked_dims(op) -> list:
    """A reshape's output dimensions: its static shape's, and those its shape's `Pack` asks
    for where they are known (`tf.tensordot`'s products of static dimensions)."""
    dims = list(op.outputs[0].shape)
    if op.inputs[1].op.type == "Pack" and len(op.inputs[1].op.inputs) == len(dims):
        asked = [_static_int(t) for t in op.inputs[1].op.inputs]  # -1: inferred, unknown
        dims = [d if d is not None or a is None or a < 0 else a for d, a in zip(dims, asked)]
    return dims


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


def size(dims) -> int | None:
    """The values of these dimensions, where each is known."""
    if isinstance(dims, tf.TensorShape) and dims.rank is None:
        return None
    return None if any(d is None for d in dims) else math.prod(dims)
