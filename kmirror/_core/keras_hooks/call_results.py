"""What a layer call of a model's own step leaves, as one device's: its outputs, and the tensors
its layers keep (set on themselves, put in their lists and dicts).

A replica computes the call on its rows of the batch. Where a tensor the call leaves holds them
is known from how the traced call computed it (`reductions.held`, read while the call runs:
`placed`), not from its shape:

- in its first axis (a layer's output, one value per row kept on the layer): every replica's
  rows are joined in row order (`Split.joined`), the whole batch's value;
- in none (a statistic over the rows, which kmirror computes over the whole batch in the call:
  `reductions`; a value computed from the weights or data the model holds): it is one device's
  value already, and taken as it is. Going backward it is a value every replica computed whole,
  as the step's own values are (`_core.global_batch`). Where the rules of `row_axes` lose the
  rows of a tensor (an op of unknown rank, a transpose by axes the call computes), a first
  dimension not known, as a replica's rows have, says it holds them there
  (`global_batch.rows_first`);
- in other axes, or a count of the replica's rows (`ops.shape(x)[0]`, a number the call took
  from its rows' shape: `by_place`): the replicas cannot make the whole batch's value. An output
  is refused; a kept value is refused when the step reads it (`call_state`, `containers`).

In eager mode (`run_eagerly=True`) no call runs on a replica's rows: it runs whole
(`calls`), and leaves one device's values.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src import backend

from kmirror._core.global_batch import Split, rows_first
from kmirror._core.keras_hooks import by_place, reductions
from kmirror._core.keras_hooks.own_thread import OwnStep

__all__ = ["placed", "whole_value", "output"]

#: Where a tensor holds the replica's count of its rows.
_COUNT = "the count of the replica's rows"


def placed(own: OwnStep, outputs) -> dict:
    """Where each tensor the call leaves holds its rows, read while the call runs (id -> the
    axes, `NONE` or None where it holds none, `_COUNT`)."""
    kept = [own.attributes[key][2] for key in own.set_in_call]
    for _container, shadow in own.shadows.values():
        values = shadow.values() if isinstance(shadow, dict) else shadow
        kept += [value for value in values if id(value) in own.put_in_call]
    tensors = [t for t in tf.nest.flatten(outputs) + kept if tf.is_tensor(t)]
    return {id(t): _COUNT if by_place.counts_rows(t) else reductions.held(t) for t in tensors}


def whole_value(value, split: Split, own: OwnStep, where: dict, kept: bool = True):
    """The whole batch's value of a tensor the call left (`kept`: on a layer, else an output);
    None where the replicas cannot make it."""
    if not tf.is_tensor(value):
        return value
    first = rows_first(where.get(id(value), _COUNT), value)
    if first is None:
        return None
    return _joined(value, split, own) if first else value


def output(value, split: Split, own: OwnStep, where: dict, layer):
    """An output of the call, the whole batch's; a clear error where the replicas cannot make
    it."""
    found = whole_value(value, split, own, where, kept=False)
    if found is not None or value is None:
        return found
    axes = where.get(id(value))
    if axes is None:
        what = "a scalar computed from its replica's rows"
    elif axes == _COUNT:
        what = f"{_COUNT} (ops.shape(x)[0]), not the whole batch's"
    else:
        what = f"a tensor holding its replica's rows in axes {sorted(axes)}, not in axis 0 only"
    raise ValueError(
        f"kmirror: layer '{layer.name}' ({type(layer).__name__}), called in the model's own "
        f"step, returned {what}, which its replicas cannot join into the whole batch's value. "
        "Return one value per row in the first axis (transpose inside the call), and compute "
        "what is over the rows from it in the step."
    )


def _joined(value, split: Split, own: OwnStep):
    mask = backend.get_keras_mask(value)
    joined = split.joined(value)
    if mask is not None:
        backend.set_keras_mask(joined, split.joined(mask))
    own.joins[id(joined)] = (joined, value, split)
    own.provenance.mark(joined)
    return joined
