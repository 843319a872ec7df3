"""Every other op over the rows of a layer call: known to compute each row on its own, or the
call runs whole.

The reductions (`reductions`) and the ops that combine rows (`mixing`, `by_place`) are checked
by their own rules. Every other op TensorFlow makes while a replica computes a layer call on its
rows is checked as it is made (`tf_hooks.graphs.watch_ops`), where an input of it holds the rows
(`reductions.held`):

- an op computing each element from the same elements of its inputs (`tf.exp`, `a * b`, a
  comparison, a cast), or moving values whose rows `row_axes` follows (a reshape, a transpose, a
  stack, a tensor list, a loop or a condition, whose own ops are checked as they are made): as
  TensorFlow makes it; but where it pairs the rows, entry by entry, with values that are not rows
  (a table or a state the model holds with as many rows as the batch, a stateful RNN's), the
  call runs whole;
- an op computing each row on its own (resizing images, a cross-entropy of each row's logits): as
  TensorFlow makes it where the rows are in its first axis;
- an op over its last axes (a Fourier transform, a matrix inverse or decomposition) or along an
  axis it is given (a split, a cumulative log-sum-exp, a tile, a reversal): as TensorFlow makes
  it where that is not an axis holding the rows; a concatenation, where it is not, or where every
  input holds the rows there (rows joined with rows);
- a call of a function TensorFlow traced (a `tf.function` the layer calls, `ops.jvp`): the call
  runs whole, since a function traced before is reused without its ops being made again;
- any other op (a kind kmirror does not know, or one of the above over the rows): the call runs
  on the whole batch (`reductions.ask_whole`), where it is one device's value. A layer that runs
  so still trains exactly, with each replica computing its call on every row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import tensorflow as tf

from kmirror._core.keras_hooks import elementwise, nested, reductions
from kmirror._core.keras_hooks.by_place import counts_rows, named_axes, rank
from kmirror._core.tf_hooks import graphs

__all__ = ["install"]


def _names(text: str) -> set[str]:
    return set(text.split())


#: Ops computing each element from the same elements of their inputs: broadcast as NumPy does
#: (`elementwise`), or not (a v1 `Select` by a vector, a bitcast, a one-hot, a fill).
_PER_ELEMENT = elementwise.BROADCAST | _names("Select Bitcast OneHot Fill")
#: Ops moving or keeping values whose rows `row_axes` follows; loops and conditions, whose own
#: ops are checked as they are made; writes (`writes`) and assertions.
_MOVING = _names(
    """Identity IdentityN Snapshot StopGradient PreventGradient CheckNumerics EnsureShape Reshape
    Transpose ConjugateTranspose ExpandDims Squeeze Shape ShapeN Size Rank Pack BroadcastArgs
    BroadcastGradientArgs TensorListFromTensor TensorListSetItem TensorListStack
    TensorListReserve TensorListLength TensorListElementShape TensorListPushBack
    TensorListScatterV2 While StatelessWhile If StatelessIf Case StatelessCase AssignVariableOp
    AssignAddVariableOp AssignSubVariableOp ResourceGather Assert StringFormat PrintV2 NoOp"""
)
#: Ops computing each index of their inputs' first axis on its own.
_PER_ROW = _names(
    """ResizeBilinear ResizeNearestNeighbor ResizeBicubic ResizeArea ScaleAndTranslate
    ImageProjectiveTransformV2 ImageProjectiveTransformV3 AdjustContrastv2 AdjustHue
    AdjustSaturation RGBToHSV HSVToRGB ExtractImagePatches DepthToSpace SpaceToDepth LRN InTopKV2
    SoftmaxCrossEntropyWithLogits SparseSoftmaxCrossEntropyWithLogits Multinomial"""
)
#: Ops over the last axes of their inputs, each index of the others on its own.
_LAST_AXES = {"FFT": 1, "IFFT": 1, "RFFT": 1, "IRFFT": 1, "FFT2D": 2, "IFFT2D": 2, "RFFT2D": 2}
_LAST_AXES |= {"IRFFT2D": 2, "FFT3D": 3, "IFFT3D": 3, "RFFT3D": 3, "IRFFT3D": 3}
_MATRICES = """MatrixInverse Cholesky MatrixDeterminant LogMatrixDeterminant MatrixSolve Qr Svd Lu
    MatrixTriangularSolve SelfAdjointEigV2 MatrixBandPart MatrixDiagPartV3 MatrixSetDiagV3"""
_LAST_AXES |= dict.fromkeys(_names(_MATRICES), 2)


#: (the input whose axes it combines, the axes: from its inputs and attributes) per op.
_ALONG: dict[str, Callable] = {
    "Unpack": lambda i, a: (0, named_axes(a["axis"].i, i[0])),
    "Split": lambda i, a: (1, named_axes(i[0], i[1])),
    "SplitV": lambda i, a: (0, named_axes(i[2], i[0])),
    "CumulativeLogsumexp": lambda i, a: (0, named_axes(i[1], i[0])),
    "ReverseV2": lambda i, a: (0, named_axes(i[1], i[0])),  # `tf.reverse` by another name
    "ReverseSequence": lambda i, a: (0, {a["seq_dim"].i}),
}
_ALONG |= dict.fromkeys(nested.LIST_READS, lambda i, a: (0, {0}))


def _tiled(inputs) -> set | None:
    multiples = tf.get_static_value(inputs[1])
    return None if multiples is None else {a for a, m in enumerate(multiples) if m != 1}


def _concatenated(inputs, held) -> str | None:
    """A concatenation along an axis holding the rows of some of its inputs only: values that
    are not rows, which every replica would add, among them."""
    *values, axis = inputs
    axes = [named_axes(axis, v) for v in values]
    if all(along is not None and not rows & along for rows, along in zip(held, axes)):
        return None
    if all(along is not None and rows & along for rows, along in zip(held, axes)):
        return None  # rows of the batch joined with rows: per row still
    return "concatenates values that are not rows of the batch with its rows"


def _combines(op_type: str, inputs: list, attrs: dict, held: list) -> str | None:
    """What the op does over the rows of its call, where it combines them; None where it does
    not."""
    what = f"computes TensorFlow's {op_type}"
    if op_type in _PER_ROW:
        return None if all(rows <= {0} for rows in held) else what
    if op_type == "ConcatV2":
        return _concatenated(inputs, held)
    if op_type in _LAST_AXES:  # each input's last axes
        last = [_last(t, _LAST_AXES[op_type]) for t in inputs]
        return what if any(r and (a is None or r & a) for r, a in zip(held, last)) else None
    if op_type == "Tile":
        source, axes = 0, _tiled(inputs)
    elif op_type in _ALONG:
        source, axes = _ALONG[op_type](inputs, attrs)
    else:
        return f"{what}, which kmirror does not know to compute each row on its own"
    rows = held[source]
    return what if rows and (axes is None or rows & axes) else None


def _last(tensor, count: int) -> set | None:
    dims = rank(tensor)
    return None if dims is None else set(range(max(dims - count, 0), dims))


def _paired(op_type: str, inputs) -> None:
    """An op computing each element from the same elements of its inputs, broadcast, pairs the
    rows of its call with values that are not rows (a weight, a constant, a table or state the
    model holds) where those have more than one entry along an axis holding the rows: one device
    pairs row i of the batch with entry i, a replica its row j (the batch's row `start + j`) with
    entry j. The call runs whole. Only an axis where one input's dimension is unknown (as the
    rows' count is) and another's known is looked at."""
    shapes = [t.shape for t in inputs]
    if any(shape.rank is None for shape in shapes):
        return
    out = max(shape.rank for shape in shapes)

    def at(shape, axis):  # the dimension broadcasting aligns with the output's `axis`
        index = axis - out + shape.rank
        return shape[index] if index >= 0 else 1

    axes = [a for a in range(out) if any(at(s, a) is None for s in shapes)]
    axes = [a for a in axes if any((at(s, a) or 1) > 1 for s in shapes)]
    if not axes:
        return
    held = [reductions.held(t) for t in inputs]
    rows = elementwise.aligned(out, inputs, held)
    for shape, axes_held in zip(shapes, held):
        if not axes_held and any(a in rows and (at(shape, a) or 1) > 1 for a in axes):
            reductions.combined(
                f"computes TensorFlow's {op_type}, pairing the rows of its call in axes "
                f"{sorted(rows)} with a tensor of shape {shape.as_list()} entry by entry"
            )


#: Ops whose values number the positions their inputs count (a range, an identity matrix, a
#: one-hot of a depth), and TensorFlow's stateless draws of a shape: from the count of the
#: call's rows, they number its rows by their place, or draw one value per row of the replica.
_COUNTED = {"Range", "MatrixDiagV3", "MatrixDiagV2", "MatrixSetDiagV3", "MatrixBandPart"}
_COUNTED |= {"OneHot"}


def _sized_by_count(tensor) -> bool:
    """An integer computed from the count of the call's rows, or a tensor filled to a shape
    computed from it (`tf.eye(n)`'s zeros)."""
    if not tf.is_tensor(tensor):
        return False
    if tensor.op.type == "Fill":
        return counts_rows(tensor.op.inputs[0])
    return counts_rows(tensor)


def _counted(op_type: str, inputs) -> None:
    stateless = op_type.startswith("StatelessRandom") or op_type.startswith("StatelessTruncated")
    if (op_type in _COUNTED or stateless) and any(_sized_by_count(t) for t in inputs):
        what = "draws" if stateless else "computes"
        reductions.ask_whole(
            f"{what} TensorFlow's {op_type} of the count of the rows of its call, one value "
            "per row by its place"
        )


#: Calls of a function graph: one traced before (a `tf.function` a layer calls again, Keras'
#: `ops.jvp`) is reused without making its ops again, where kmirror would check them, and a
#: replica may reuse what another traced: which of them checked its ops is not the same on every
#: replica. Such a call over the rows runs the layer's call whole on every replica.
_FUNCTION_CALLS = _names("PartitionedCall StatefulPartitionedCall")


def _check(op_type: str, inputs, attrs) -> None:
    if op_type in _MOVING or not reductions.watching():
        return
    if op_type in _FUNCTION_CALLS:
        if any(reductions.held(t) for t in inputs):
            reductions.ask_whole(
                "calls a function TensorFlow traced (a `tf.function`), whose ops kmirror does "
                "not follow, over its rows"
            )
        return
    _counted(op_type, inputs)
    if op_type in _PER_ELEMENT:
        if op_type in elementwise.BROADCAST and len(inputs) > 1:
            _paired(op_type, inputs)
        return
    held = [reductions.held(t) or frozenset() for t in inputs]
    if not any(held):
        return
    what = _combines(op_type, list(inputs), attrs or {}, held)
    if what is not None:
        axes = sorted(set().union(*held))
        reductions.ask_whole(f"{what} over a tensor holding the rows of its call in axes {axes}")


_installed: list = []
_install_lock = threading.Lock()


def install() -> None:
    """Checks every op made while a replica computes a layer call, once per process."""
    with _install_lock:
        if not _installed:
            graphs.watch_ops(_check)
            _installed.append(_check)
