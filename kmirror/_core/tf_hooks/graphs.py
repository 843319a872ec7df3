"""Where kmirror reaches into the graphs TensorFlow makes: the only module besides its package's
`__init__` that touches `tensorflow.python`.

TensorFlow has no public API for these things kmirror needs:

- the functions every reduction of TensorFlow, Keras and NumPy-like code ends in
  (`reduction_functions`: `gen_math_ops.mean`, `_sum`, ...), which kmirror replaces so that a
  reduction over the rows of a layer call is the whole batch's (`keras_hooks.reductions`), and
  those of the ops that combine values of different rows (`mixing_functions`: a matrix product,
  a softmax, a segment sum, a slice, ...), which run such a call on the whole batch;
- every op a graph makes, seen before it is made (`watch_ops`), to check the ops over the rows
  of a layer call that no function above makes (`keras_hooks.other_ops`);
- the function graphs a loop or a condition runs (`branch_outputs`), to follow the rows of a
  layer call through them (`keras_hooks.nested`);
- the function TensorFlow's vectorized maps trace for one index (`watch_per_row_functions`:
  `tf.vectorized_map`, `keras.ops.vectorized_map`, `GradientTape.jacobian` and `batch_jacobian`
  all end in `parallel_for.control_flow_ops.pfor`, which traces it in the graph around it), so
  that a model's own step computes there as one device (`keras_hooks.own_thread.per_row`);
- which ops write a variable (`variable_write`), the handle a traced function captured for a
  resource (`captured_handle`: a function graph's captures, followed out to the eager handle) and
  whether it is a distributed variable's copy (`distributed`), to find the state a traced step
  writes (`_core.reached_state`);
- the gradient registry's custom gradients (`custom_gradients`), which a traced step's
  `tf.custom_gradient`s leave there, keeping the step's graph alive until released
  (`release_custom_gradients`).

Checked on TensorFlow 2.21.0 (`make test`) and 2.19.1 (`make test-compat`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import tensorflow as tf

from kmirror import versions

versions.check()  # before the internals below

from tensorflow.python.framework import ops as tf_ops  # noqa: E402
from tensorflow.python.ops import (  # noqa: E402
    gen_array_ops,
    gen_linalg_ops,
    gen_manip_ops,
    gen_math_ops,
    gen_nn_ops,
)
from tensorflow.python.ops.parallel_for import control_flow_ops as pfor_ops  # noqa: E402

__all__ = ["reduction_functions", "mixing_functions", "watch_ops", "branch_outputs"]
__all__ += ["custom_gradients", "release_custom_gradients", "watch_per_row_functions"]
__all__ += ["variable_write", "captured_handle", "distributed"]


def custom_gradients() -> set[str]:
    """The `tf.custom_gradient`s TensorFlow's global gradient registry holds: one per call while
    tracing, each holding the graph it was traced in alive for the life of the process."""
    return {n for n in tf_ops._gradient_registry._registry if n.startswith("CustomGradient-")}


def release_custom_gradients(kept: set[str]) -> None:
    """Removes from the registry every custom gradient but those `kept`."""
    for name in custom_gradients() - kept:
        del tf_ops._gradient_registry._registry[name]


def _ops(module, pairs: str) -> list[tuple[object, str, str]]:
    """(module, function, op type) for each "function:OpType" of `pairs`."""
    return [(module, *pair.split(":")) for pair in pairs.split()]


def reduction_functions() -> list[tuple[object, str, str]]:
    """(module, function, op type) of the functions TensorFlow's reductions call to make their
    op: `tf.reduce_mean`, `tf.math.reduce_variance`, `tf.nn.moments`, Keras' `ops.mean`,
    `ops.var` and the rest all end in one of these, looked up on the module when called."""
    math = "_sum:Sum mean:Mean _max:Max _min:Min prod:Prod euclidean_norm:EuclideanNorm "
    math += "arg_max:ArgMax arg_min:ArgMin cumsum:Cumsum cumprod:Cumprod _any:Any _all:All"
    return _ops(gen_math_ops, math) + _ops(gen_nn_ops, "top_kv2:TopKV2")


def mixing_functions() -> list[tuple[object, str, str]]:
    """(module, function, op type) of the functions that make TensorFlow's ops which can combine
    values of different rows of a tensor: `tf.matmul`, `tf.einsum`, `tf.nn.softmax`, the segment
    reductions, `tf.math.bincount`, `tf.roll`, `tf.reverse`, a slice (`x[1:]`), `tf.gather`,
    `tf.gather_nd`, the scatters, `tf.pad`, `tf.cast` (of a row count to a number), convolutions
    and poolings, and Keras' `ops` that call them, end in these, looked up when called."""
    math = "mat_mul:MatMul batch_mat_mul_v2:BatchMatMulV2 batch_mat_mul_v3:BatchMatMulV3 "
    math += "bincount:Bincount dense_bincount:DenseBincount cast:Cast"
    segments = ("sum", "sum_v2", "mean", "max", "min", "prod")
    math += "".join(f" segment_{k}:Segment" for k in segments)
    math += "".join(f" unsorted_segment_{k}:Segment" for k in ("sum", "max", "min", "prod"))
    math += "".join(f" sparse_segment_{k}:SparseSegment" for k in ("sum", "mean", "sqrt_n"))
    array = "reverse_v2:ReverseV2 strided_slice:StridedSlice _slice:Slice gather_v2:GatherV2 "
    array += "gather_nd:GatherNd pad:Pad pad_v2:Pad mirror_pad:Pad"
    scatters = ("update", "add", "sub", "max", "min")
    array += "".join(f" tensor_scatter_{k}:TensorScatter" for k in scatters)
    windows = "conv2d:Conv conv3d:Conv conv:Conv conv2d_backprop_input:ConvTranspose "
    windows += "conv3d_backprop_input_v2:ConvTranspose depthwise_conv2d_native:DepthwiseConv "
    windows += "max_pool:Pool max_pool_v2:Pool avg_pool:Pool max_pool3d:Pool avg_pool3d:Pool"
    return [
        *_ops(gen_math_ops, math),
        *_ops(gen_linalg_ops, "einsum:Einsum"),
        *_ops(gen_nn_ops, "softmax:Softmax log_softmax:Softmax " + windows),
        *_ops(gen_manip_ops, "roll:Roll"),
        *_ops(gen_array_ops, array),
    ]


def branch_outputs(op) -> list[list]:
    """The outputs of each function graph a control-flow op runs, as TensorFlow's control flow
    keeps them on the op once made (a loop's body: `_body_graph`; a condition's branches:
    `_true_graph`, `_false_graph`), each list one per output of the op; none for other ops."""
    graphs = (getattr(op, name, None) for name in ("_body_graph", "_true_graph", "_false_graph"))
    return [list(graph.outputs) for graph in graphs if graph is not None]


def watch_ops(check: Callable) -> None:
    """Calls `check(op_type, inputs, attrs)` before a graph (a function's too) makes each op:
    every op of TensorFlow, Keras and a user's code is made by `Graph._create_op_internal`,
    `attrs` the op's attributes as `AttrValue`s. `check` may raise, and the op is not made."""
    original = tf_ops.Graph._create_op_internal

    def create(graph, op_type, inputs, *args, **kwargs):
        check(op_type, inputs, kwargs.get("attrs") if len(args) < 4 else args[3])
        return original(graph, op_type, inputs, *args, **kwargs)

    tf_ops.Graph._create_op_internal = create


def watch_per_row_functions(marked: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Traces the function every vectorized map of TensorFlow computes for one index inside
    `marked()`: `pfor(loop_fn, iters)` calls `loop_fn(index)` (or `loop_fn(index, pfor_config)`,
    as its `_loop_fn_has_config` tells) once, and makes every index's ops from the
    ops it made."""
    original = pfor_ops.pfor

    def pfor(loop_fn, iters, *args, **kwargs):
        if pfor_ops._loop_fn_has_config(loop_fn):

            def traced(index, pfor_config):
                with marked():
                    return loop_fn(index, pfor_config=pfor_config)

        else:

            def traced(index):
                with marked():
                    return loop_fn(index)

        return original(traced, iters, *args, **kwargs)

    pfor_ops.pfor = pfor


#: The ops writing a variable through its handle (the first input): assignments, scatters,
#: slice assignments and the fused updates of TensorFlow's optimizers.
_WRITE_PREFIXES = ("ResourceScatter", "ResourceApply", "ResourceSparseApply")
_WRITES = frozenset(
    {
        "AssignVariableOp",
        "AssignAddVariableOp",
        "AssignSubVariableOp",
        "ResourceStridedSliceAssign",
    }
)


def variable_write(op_type: str) -> bool:
    """Whether ops of `op_type` write the variable whose handle is their first input."""
    return op_type in _WRITES or op_type.startswith(_WRITE_PREFIXES)


def captured_handle(tensor):
    """The eager resource handle a traced function's `tensor` stands for: a function graph's
    capture, followed out through the graphs around it (a condition's branch inside a step);
    None where `tensor` is made in a graph (a variable the function makes itself)."""
    while tf.is_symbolic_tensor(tensor):
        if tensor.op.type != "Placeholder":
            return None
        captured = _captured.get(tensor.graph)
        if captured is None or len(captured) != len(tensor.graph.captures):
            captured = {id(internal): external for external, internal in tensor.graph.captures}
            _captured[tensor.graph] = captured
        tensor = captured.get(id(tensor))
        if tensor is None:
            return None
    return tensor


_captured = weakref.WeakKeyDictionary()  # a function graph -> its captures by internal tensor


def distributed(handle) -> bool:
    """Whether `handle` is a copy of a `tf.distribute` variable (a mirrored variable's on one
    replica): TensorFlow marks each copy's handle with its container."""
    return hasattr(handle, "_distributed_container")
