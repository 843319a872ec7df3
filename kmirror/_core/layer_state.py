"""State that layers write during a step, combined over the replicas as each weight declares.

A layer may keep state that its `call` writes: a running sum (`self.total.assign_add(...)`), a
call counter, a Keras metric updated inside `call` (keras.io's endpoint-layer pattern). Each
replica writes its own copy, from its own rows. After its part of the step, what a replica wrote
is combined over every replica in one all-reduce, as `add_weight(aggregation=...)` declares:

- `"sum"`: the value before the step plus every replica's change (a running sum over the rows is
  then one device's; Keras' metrics declare their variables so, which makes a metric updated
  inside `call` exact in the logs and in `evaluate`);
- `"mean"`: the mean of the replicas' values;
- `"only_first_replica"`: the first replica's value;
- `"none"` (Keras' default): the replicas must have written the same value (a call counter);
  where they did not, the step raises before it updates any weight, and the error says to
  declare the aggregation (`kmirror.errors.DIVERGED`).

A value computed from a reduction over the rows that kmirror made the whole batch's (a running
sum of the batch's `ops.sum`, a metric's update in `call`: `keras_hooks.reductions`) is one
device's on every replica already: whatever the aggregation, the first replica's value is kept.

What kmirror keeps alike by construction is left as it is: weights and optimizer state (every
replica applies the summed gradient), seed generators' states (every replica takes its rows of
one device's draw), BatchNormalization's moving statistics when they come from the global batch's
statistics, and metrics a model's own step updates with global values. With per-replica
statistics (`sync_batch_norm=False`) the moving statistics are averaged, as `"mean"`.

Example:

```python
state = LayerState(model, reducer, global_statistics=True)
def replica_step(...):             # in replica context
    before = state.before()
    with state.recording(rows > 0):
        ...                        # the replica's forward pass (on one row if it has none)
    loss = after(state.combine(before), loss)   # the weights are updated after the checks
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import tensorflow as tf

from kmirror import errors
from kmirror._core import keras_hooks, mirroring
from kmirror.reducers.base import Reducer

__all__ = ["LayerState", "after"]

_AGGREGATIONS = ("sum", "mean", "only_first_replica", "none")


class LayerState:
    """The state of `model` that one traced step's replicas write, and its combination.

    Made once per trace of a step (its replicas share it): the variables a replica writes are
    recorded while its forward pass is traced, and combined in the same order on every replica.

    Args:
        model: the user's model.
        reducer: sums over the replicas.
        global_statistics: BatchNormalization's moving statistics come from the global batch.
        left: more variables left as each replica writes them: written alike (the metrics a
            model's own step updates with global values), or never read.
    """

    def __init__(
        self, model: keras.Model, reducer: Reducer, global_statistics: bool, left=()
    ) -> None:
        self._reducer = reducer
        kept = [v for o in mirroring.optimizers(model) for v in o.variables]
        kept += keras_hooks.seed_states(model) + list(left)
        statistics = keras_hooks.moving_statistics(model)
        kept += statistics if global_statistics else []
        #: Per-replica statistics are averaged (BatchNormalization declares no aggregation).
        self._aggregation = {} if global_statistics else {id(v): "mean" for v in statistics}
        kept = {id(v) for v in kept}
        self._candidates = [
            v for v in mirroring.state(model) if not v.trainable and id(v) not in kept
        ]
        self._written = {}  # id -> variable: what any replica of this trace wrote
        #: Written from a reduction made the whole batch's: alike on every replica.
        self._alike = {}
        self._layout = None  # the written candidates, in the order every replica packs them

    def _aggregation_of(self, variable) -> str:
        if id(variable) in self._alike:
            return "only_first_replica"
        aggregation = self._aggregation.get(id(variable), variable.aggregation)
        return aggregation if aggregation in _AGGREGATIONS else "none"

    def before(self) -> dict:
        """In replica context, before the forward pass: the values a `"sum"` needs."""
        return {
            id(v): keras_hooks.storage(v).read_value()
            for v in self._candidates
            if self._aggregation_of(v) == "sum"
        }

    @contextlib.contextmanager
    def recording(self, has_rows: tf.Tensor) -> Iterator[None]:
        """The block whose writes to the model's state are recorded (a replica's forward, or a
        layer call of a model's own step). A replica without rows (`has_rows` false) computes on
        a row that is not its own (`_core.feed.placement.one_row_at_least`,
        `_core.global_batch`): what the block adds to a `"sum"` weight there is taken back."""
        sums = [v for v in self._candidates if self._aggregation_of(v) == "sum"]
        before = {id(v): keras_hooks.storage(v).read_value() for v in sums}
        written, alike = {}, {}
        with keras_hooks.recording(written, alike):
            yield
        self._written.update(written)
        self._alike.update(alike)
        for variable in sums:
            if id(variable) in written and id(variable) not in alike:
                stored, start = keras_hooks.storage(variable), before[id(variable)]
                added = (stored.read_value() - start) * tf.cast(has_rows, start.dtype)
                stored.assign(start + added)

    def combine(self, before: dict) -> list:
        """In replica context, after the forward pass: every written variable takes its combined
        value. Returns what must run before the step updates the weights (the checks)."""
        written = [v for v in self._candidates if id(v) in self._written]
        if self._layout is None:
            self._layout = written
        elif len(written) != len(self._layout):
            raise ValueError(
                "kmirror: the replicas' steps write different layer weights "
                f"({', '.join(v.path for v in written)}); each replica must run the same code."
            )
        if not self._layout:
            return []
        first = tf.cast(tf.equal(self._reducer.replica_index(), 0), tf.float64)
        after, sent = [], []
        for variable in self._layout:
            value = keras_hooks.storage(variable).read_value()
            wide = tf.reshape(tf.cast(value, tf.float64), [-1])
            aggregation = self._aggregation_of(variable)
            if aggregation == "sum":
                wide = wide - tf.reshape(tf.cast(before[id(variable)], tf.float64), [-1])
            elif aggregation in ("only_first_replica", "none"):
                wide = wide * first
            after.append(value)
            sent.append(wide)
        total = self._reducer.all_sum(tf.stop_gradient(tf.concat(sent, 0)))
        checked, offset = [], 0
        for variable, value, part in zip(self._layout, after, sent):
            combined = tf.reshape(total[offset : offset + part.shape[0]], value.shape)
            offset += part.shape[0]
            aggregation = self._aggregation_of(variable)
            if aggregation == "none":
                own = tf.cast(value, tf.float64)
                checked.append((variable, tf.reduce_any(tf.not_equal(own, combined))))
                continue
            if aggregation == "sum":
                combined += tf.cast(before[id(variable)], tf.float64)
            elif aggregation == "mean":
                combined /= self._reducer.num_replicas
            keras_hooks.storage(variable).assign(tf.cast(combined, value.dtype))
        return self._checks(checked)

    def _checks(self, checked: list) -> list:
        """Asserts that no replica wrote another value than the first replica to a `"none"`
        weight; every process sees the same count, so all raise at the same step."""
        if not checked:
            return []
        differing = tf.stack([tf.cast(d, tf.float64) for _, d in checked])
        differing = self._reducer.all_sum(differing)
        return [
            tf.debugging.Assert(
                tf.equal(count, 0),
                [
                    f"{errors.DIVERGED} {variable.path}, whose aggregation is 'none' (one "
                    "device keeps one value). Declare how the replicas' values combine: "
                    "add_weight(..., aggregation='sum') for a running sum or count over the "
                    "rows, 'mean' for their mean, 'only_first_replica' for the first replica's "
                    "value."
                ],
            )
            for (variable, _), count in zip(checked, tf.unstack(differing))
        ]


def after(checks: list, values):
    """`values` (any nest; None stays None), each tensor computed after `checks`."""
    if not checks:
        return values
    with tf.control_dependencies(checks):
        return tf.nest.map_structure(lambda v: tf.identity(v) if tf.is_tensor(v) else v, values)
