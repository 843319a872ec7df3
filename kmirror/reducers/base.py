"""The reducer seam: how replicas are laid out and how their gradients are summed; the step
(`_core.step`) never knows which all-reduce runs. What the processes do together around the steps
is the reducer's job, `Reducer.job` (`kmirror.reducers.job`)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

import tensorflow as tf

from kmirror import devices as devices_lib
from kmirror._core import python_draws
from kmirror.reducers import packing, scoped
from kmirror.reducers.job import Job

__all__ = ["Reducer", "check_num_packs", "present_only"]


class Reducer(abc.ABC):
    """Base class of kmirror's reducers: how gradients are summed across replicas.

    A reducer is chosen by name (`kmirror.wrap(model, reducer="hierarchical_copy")`) or passed as an
    object carrying options
    (`kmirror.wrap(model, reducer=kmirror.reducers.HierarchicalCopy(num_packs=2))`).
    A reducer object is bound to one model's devices by `wrap`; use a fresh object per model.

    What a reducer must say is where its replicas are: `make_strategy`, a `tf.distribute`
    strategy with one replica per device. Everything else has a default on that strategy: the
    gradients' sum (`reduce_gradients`, also entered from a replica: `reduce_in_replica`), the
    sums and gatherings of small values inside a step (`all_sum`, `replica_sums`, `all_gather`)
    and of per-replica values after it (`sum`, `concat`). A reducer sums differently by overriding
    `reduce_gradients`; one whose replicas live in several processes (Horovod, `Collective`)
    overrides the collectives it runs itself and returns its `kmirror.reducers.Job` from
    `make_job`.

    Example, the shortest reducer (every replica's gradients summed on one device):

    ```python
    import tensorflow as tf
    import kmirror

    class ToOneDevice(kmirror.reducers.Reducer):
        name = "to_one_device"

        def make_strategy(self, devices):
            ops = tf.distribute.ReductionToOneDevice()
            return tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    model = kmirror.wrap(model, reducer=ToOneDevice(), devices=["/cpu:0", "/cpu:1"])
    ```
    """

    name: ClassVar[str] = ""
    #: Options this reducer accepts, by name (validated by `kmirror.reducers.get`).
    options: ClassVar[tuple[str, ...]] = ()
    #: Whether this reducer's collectives can run inside Keras' loop over `steps_per_execution`
    #: steps (a `tf.while_loop` with a `tf.cond`). When False, each of those steps is its own call
    #: of the traced step (same result, one host round trip per step).
    steps_in_one_call: ClassVar[bool] = True

    def __init__(self) -> None:
        self.strategy: tf.distribute.Strategy | None = None
        self.devices: list[str] = []
        #: How this reducer's collectives communicate (None: the strategy's own choice).
        self.communication: tf.distribute.experimental.CommunicationOptions | None = None
        self._job: Job | None = None

    # -- set-up --------------------------------------------------------------------------------
    def bind(self, devices: list[str] | None = None, num_gpus: int | None = None) -> None:
        """Creates the replicas on the devices asked for (called once, by `wrap`)."""
        if self.strategy is not None:
            raise ValueError(
                f"this {type(self).__name__} reducer object is already used by another model; "
                "pass a new reducer object (or the reducer's name) to each kmirror.wrap call."
            )
        self.devices = self.select_devices(devices, num_gpus)
        self.strategy = self.make_strategy(self.devices)

    def select_devices(self, devices: list[str] | None, num_gpus: int | None) -> list[str]:
        """The local devices this process's replicas run on."""
        return devices_lib.choose(devices, num_gpus)

    @abc.abstractmethod
    def make_strategy(self, devices: list[str]) -> tf.distribute.Strategy:
        """Where the replicas are: a `tf.distribute` strategy with one replica on each of
        `devices` (this process's)."""

    @contextlib.contextmanager
    def scope(self):
        """The scope in which variables become mirrored on every replica, each replica updating
        its own copy."""
        with self.strategy.scope(), scoped.creating():
            yield

    def make_job(self) -> Job:
        """The processes of this reducer's job (made at the first use of `job`): one by default."""
        return Job()

    @property
    def job(self) -> Job:
        """Which process this is among the job's, and what they settle together around the
        steps (`kmirror.reducers.Job`)."""
        if self._job is None:
            self._job = self.make_job()
        return self._job

    @property
    def num_replicas(self) -> int:
        """Replicas in the whole job (all processes)."""
        return self.strategy.num_replicas_in_sync

    # -- collectives used by the step ----------------------------------------------------------
    def distribute(self, shard_fn: Callable[[int, int], Any]) -> Any:
        """Per-replica values: `shard_fn(replica_index, num_replicas)` for each local replica."""
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: shard_fn(ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)
        )

    def distribute_local(self, shard_fn: Callable[[int, int], Any]) -> Any:
        """Per-replica values: `shard_fn(local_index, local_replicas)` for each local replica
        (for data that holds this process's rows only)."""
        count = len(self.devices)
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: shard_fn(ctx.replica_id_in_sync_group % count, count)
        )

    def batches_on_devices(self, dataset: tf.data.Dataset) -> Any | None:
        """`dataset`'s elements handed to the local replicas in turn, each prefetched to its
        replica's device ahead of the step; None: the step takes its rows of the host batch."""
        return None

    def replica_index(self) -> tf.Tensor:
        """In replica context: this replica's index among all replicas of the job."""
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    def run(self, fn: Callable, args: tuple) -> Any:
        """Runs `fn` once per local replica, in replica context; each replica draws from Python's
        and NumPy's global generators what one device's single run draws (`python_draws`)."""
        with python_draws.alike() as each:
            return self.strategy.run(each(fn), args=args)

    def reduce_gradients(self, gradients: list) -> list:
        """Sums the replicas' gradients: the one point where gradients cross replicas.

        Called in cross-replica context with one per-replica value per gradient (None where a
        variable has no gradient); returns per-replica values holding the sum on every replica."""

        def batch_sum(present):
            pairs = [(g, g) for g in present]
            with self.strategy.scope():
                return self.strategy.extended.batch_reduce_to(
                    tf.distribute.ReduceOp.SUM, pairs, options=self.communication
                )

        return present_only(gradients, batch_sum)

    def all_sum(self, value: tf.Tensor) -> tf.Tensor:
        """The sum over every replica of a small tensor, in replica context (loss normalisers,
        BatchNormalization's statistics). Going backward, each replica's gradient of the sum is
        the sum of every replica's: the sum's value reaches every replica's loss."""
        total = self.replica_sum(tf.stop_gradient(value))

        @tf.custom_gradient
        def summed(value, total):
            return total, lambda upstream: (self.replica_sum(upstream), None)

        # The sum is computed outside the custom gradient: TensorFlow walks the graph from a
        # custom gradient's outputs back to its inputs, and a sum's inputs are every replica's.
        return summed(value, total)

    def replica_sum(self, value: tf.Tensor) -> tf.Tensor:
        """The sum over every replica of a tensor, in replica context, with no gradient."""
        return tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, value, options=self.communication
        )

    def replica_sums(self, values: list) -> list:
        """`replica_sum` of each of `values` (of one dtype), in one sum of them packed."""
        return packing.in_one(self.replica_sum, values)

    def reduce_in_replica(self, gradients: list) -> list:
        """`reduce_gradients` called from replica context (inside a model's own train_step):
        each replica passes its gradients and receives the sums."""
        ctx = tf.distribute.get_replica_context()
        return present_only(
            gradients,
            lambda present: ctx.merge_call(
                lambda _, *grads: self.reduce_gradients(list(grads)), args=tuple(present)
            ),
        )

    def all_gather(self, value: tf.Tensor) -> tf.Tensor:
        """Every replica's rows of `value` joined in replica order, in replica context."""
        ctx = tf.distribute.get_replica_context()
        return ctx.merge_call(lambda _, v: self.concat(v), args=(value,))

    def local_values(self, per_replica: Any) -> tuple:
        """The tensors of a per-replica value, one per local replica."""
        return tuple(self.strategy.experimental_local_results(per_replica))

    def from_local_values(self, values: tuple) -> Any:
        """The per-replica value made of one tensor per local replica (`local_values`' inverse)."""
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: values[ctx.replica_id_in_sync_group % len(values)]
        )

    def sum(self, per_replica: Any) -> tf.Tensor:
        """The sum over all replicas of a per-replica scalar."""
        with self.strategy.scope():
            return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def concat(self, per_replica: Any) -> Any:
        """Per-replica batches joined along the batch axis, in replica order (nested)."""
        return tf.nest.map_structure(
            lambda v: None if v is None else tf.concat(self.local_values(v), axis=0), per_replica
        )

    def describe(self) -> str:
        return f"{self.name} over {self.num_replicas} replica(s)"


def present_only(gradients: list, reduce: Callable[[list], list]) -> list:
    """`reduce` applied to the gradients that are not None, each result in its gradient's place
    (None stays None; no gradient at all: nothing is reduced)."""
    present = [g for g in gradients if g is not None]
    if not present:
        return list(gradients)
    reduced = iter(reduce(present))
    return [None if g is None else next(reduced) for g in gradients]


def check_num_packs(num_packs) -> int:
    """`num_packs` if it is a whole number >= 0; else a ValueError."""
    if not isinstance(num_packs, int) or isinstance(num_packs, bool) or num_packs < 0:
        raise ValueError(f"num_packs must be a whole number >= 0; got {num_packs!r}.")
    return num_packs
