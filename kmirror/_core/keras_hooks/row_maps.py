"""A function a model's own step maps over the rows of its batch, on the replica's rows.

`tf.vectorized_map(fn, elems)` (and `keras.ops.vectorized_map`, which calls it) computes each
row's result from that row of `elems` alone: TensorFlow traces `fn` once and makes every row's
ops from it, with no value passed from one row to another. Where the step maps such a function
over rows of its batch (`elems` computed from it: `provenance`), each replica maps it over its own
rows only (`global_batch.Split.rows`), and the results are joined in row order
(`Split.joined`), as a layer call's outputs are: the per-row work (each row's gradient in
differentially private training) is split over the replicas, and what the step computes from
the results is one device's value on every replica. Inside the function the step computes as
one device (`own_thread.per_row`): its layer calls run whole, a gradient its tape takes is that
row's. Going backward through the joined results, the gradients are the replica's rows' (`n`
times, summed over the replicas where the step asks for a gradient of its weights), as they are
through a layer call.

A map over values that are not rows of the batch (the model's own), and any map in eager mode,
inside a layer call or inside a function of the step's, runs as TensorFlow runs it: whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import tensorflow as tf

from kmirror._core.global_batch import Split
from kmirror._core.keras_hooks import explaining
from kmirror._core.keras_hooks.own_thread import current_step, in_function, inside_layer_call

__all__ = ["install"]

_original: dict[str, Callable] = {}
_install_lock = threading.Lock()


def install() -> None:
    """Makes `tf.vectorized_map` map over the replica's rows in a model's own step (elsewhere,
    and on other threads, it is TensorFlow's own)."""
    with _install_lock:
        if not _original:
            _original["vectorized_map"] = tf.vectorized_map
            tf.vectorized_map = _vectorized_map


def _vectorized_map(fn, elems, *args, **kwargs):
    original = _original["vectorized_map"]
    own = current_step()
    if own is None or inside_layer_call() or in_function() is not None:
        return original(fn, elems, *args, **kwargs)
    tensors = [tf.convert_to_tensor(t) for t in tf.nest.flatten(elems)]
    if not tensors or not all(own.provenance.of_batch(t) for t in tensors):
        return original(fn, elems, *args, **kwargs)
    split = Split.of(tensors[0], own.index, own.replicas, own.all_gather, own.all_sum)
    explaining.mapped(getattr(fn, "__name__", type(fn).__name__))
    own.split_calls += 1
    rows = tf.nest.pack_sequence_as(elems, [split.rows(t) for t in tensors])
    return tf.nest.map_structure(split.joined, original(fn, rows, *args, **kwargs))
