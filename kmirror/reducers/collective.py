"""TensorFlow's collective all-reduce across workers (several processes or machines, gRPC).

The workers come from `cluster_spec` or `TF_CONFIG`, the way TensorFlow's
MultiWorkerMirroredStrategy finds them; `kmirror.cluster.connect()` must run at the start of each
worker's program, since TensorFlow configures collective ops only then. Each worker holds a
replica per local device (every GPU, else every logical CPU device) and takes its replicas' rows
of every global batch.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from kmirror import devices as devices_lib
from kmirror._core import cluster
from kmirror.errors import PeerLost, reason
from kmirror.reducers import packing
from kmirror.reducers.base import Reducer
from kmirror.reducers.in_process import require_gpus
from kmirror.reducers.job import Job

__all__ = ["Collective", "CollectiveJob"]

IMPLEMENTATIONS = {
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
}


class Collective(Reducer):
    """TensorFlow's collective all-reduce between workers: `"ring"`, `"nccl"` (GPUs) or `"auto"`.

    Created by `kmirror.wrap(model, reducer="ring", cluster_spec=...)` or with `TF_CONFIG` set;
    every worker runs the same script.

    Example:

    ```python
    kmirror.cluster.connect()                 # first thing in the script: reads TF_CONFIG
    model = kmirror.wrap(build_model(), reducer="ring")
    model.fit(x, y, batch_size=256)           # 256 rows per step over all workers
    ```

    Args:
        communication: "ring", "nccl" or "auto" (TensorFlow chooses).
        timeout_seconds: how long a collective may wait for another worker before failing;
            None (the default): as long as the worker is reachable. A worker that dies is found
            by TensorFlow within seconds either way. TensorFlow keeps one sleeping thread per
            collective for its timeout, so a timeout costs `collectives per second x timeout`
            threads: a job of many small steps held 12,000 threads per process at 120 s.
    """

    options = ("timeout_seconds",)
    name = "ring"
    # TensorFlow's collective launcher keys each collective by an instance key captured when the
    # step is called, which a step nested in Keras' while loop and condition cannot be fed.
    steps_in_one_call = False

    def __init__(self, communication: str = "ring", timeout_seconds: float | None = None) -> None:
        super().__init__()
        if communication not in IMPLEMENTATIONS:
            raise ValueError(f"communication must be one of {list(IMPLEMENTATIONS)}.")
        self.name = communication
        self.timeout_seconds = timeout_seconds

    def select_devices(self, devices, num_gpus) -> list[str]:
        if devices is not None or num_gpus is not None:
            raise ValueError(
                "devices and num_gpus cannot be given together with cluster_spec / TF_CONFIG: "
                "every worker replicates on all its local GPUs, else on its CPU devices, as "
                "TensorFlow's MultiWorkerMirroredStrategy does; limit a worker's GPUs with "
                "CUDA_VISIBLE_DEVICES."
            )
        self.cluster = cluster.connected()
        local = [devices_lib.canonical(d) for d in self.cluster.strategy.extended.worker_devices]
        if self.name == "nccl":
            require_gpus("nccl", local)
        return local

    def make_strategy(self, devices: list[str]) -> tf.distribute.Strategy:
        self._check_same_device_count(len(devices))
        # The job's one strategy exists since connect() and may serve other models; this
        # reducer's implementation and timeout go with each of its collectives instead.
        self.communication = tf.distribute.experimental.CommunicationOptions(
            implementation=IMPLEMENTATIONS[self.name], timeout_seconds=self.timeout_seconds
        )
        return self.cluster.strategy

    def _check_same_device_count(self, count: int) -> None:
        """Every worker must have as many replicas; a mismatch would hang the first collective."""
        counts = self.cluster.exchange("devices", str(count))
        if len(set(counts)) > 1:
            raise ValueError(
                "every worker must use the same number of local devices; the workers have "
                f"{', '.join(counts)} (in task order). Give each worker the same GPUs "
                "(num_gpus=N) or the same kmirror.devices.simulate(n)."
            )

    def concat(self, per_replica):
        def gather(values):
            return tf.nest.map_structure(
                lambda v: None if v is None else self.all_gather(v), values
            )

        gathered = self.run(gather, args=(per_replica,))
        return tf.nest.map_structure(
            lambda v: None if v is None else self.local_values(v)[0], gathered
        )

    def all_gather(self, value):
        ctx = tf.distribute.get_replica_context()
        # The collective sends from the replica's device (every worker has as many replicas).
        local = self.strategy.extended.worker_devices
        replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
        with tf.device(local[replica % len(local)]):
            value = tf.identity(value)
        gathered = ctx.all_gather(value, 0, options=self.communication)
        if value.shape.rank is None:
            return gathered
        # TensorFlow's gather over workers forgets every static dimension; all but the rows'
        # are the replica's, as one device's batch has them.
        return tf.ensure_shape(gathered, [None, *value.shape[1:]])

    def sum(self, per_replica):
        return self.local_values(self.run(self.all_sum, args=(per_replica,)))[0]

    def make_job(self) -> CollectiveJob:
        return CollectiveJob(self.cluster, self.strategy, self.communication)

    def describe(self) -> str:
        return (
            f"collective {self.name} over {self.num_replicas} replica(s) on "
            f"{self.cluster.num_workers} worker(s)"
        )


class CollectiveJob(Job):
    """The workers of a collective job: their index and count come from the cluster
    (`kmirror.cluster`); the broadcast is a collective all-reduce, counts and seeds travel through
    the cluster's exchange."""

    def __init__(
        self,
        workers: cluster.Cluster,
        strategy: tf.distribute.Strategy,
        communication: tf.distribute.experimental.CommunicationOptions | None,
    ) -> None:
        self._cluster, self._strategy, self._communication = workers, strategy, communication

    @property
    def num_processes(self) -> int:
        return self._cluster.num_workers

    @property
    def process_index(self) -> int:
        return self._cluster.index

    def broadcast(self, variables: list) -> None:
        """Every worker takes worker 0's values (each may have built its model differently).

        One collective for all of them: each replica's values, as float64, joined into one
        vector (worker 0's first replica's, the others' zeros) and summed. A collective per
        variable costs its tracing (a deep model's hundreds) at every model's first step."""
        if not variables:
            return
        strategy = self._strategy

        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            mine = tf.cast(tf.equal(ctx.replica_id_in_sync_group, 0), tf.float64)
            values = [tf.cast(tf.convert_to_tensor(v), tf.float64) * mine for v in variables]
            return packing.in_one(
                lambda joined: ctx.all_reduce(
                    tf.distribute.ReduceOp.SUM, joined, options=self._communication
                ),
                values,
            )

        reduced = self.traced_for(variables, lambda: strategy.run(replica_fn))()
        for variable, value in zip(variables, reduced):
            first = strategy.experimental_local_results(value)[0]
            variable.assign(tf.cast(first, variable.dtype))

    def gather_counts(self, count: int) -> list[int]:
        return [int(c) for c in self._cluster.exchange("count", str(count))]

    def agree_on_seed(self) -> None:
        import keras

        drawn = int(tf.random.uniform([], 0, 2**31 - 1, dtype=tf.int64))
        seeds = self._cluster.exchange("seed", str(drawn))
        keras.utils.set_random_seed(int(seeds[self._cluster.chief_index]))

    @contextlib.contextmanager
    def failures(self):
        try:
            yield
        except (
            tf.errors.UnavailableError,
            tf.errors.DeadlineExceededError,
            tf.errors.CancelledError,
            tf.errors.AbortedError,
            tf.errors.InternalError,
        ) as error:
            first = reason(error)
            raise PeerLost(
                f"kmirror: worker {self._cluster.task_type}:{self._cluster.task_id} stops because "
                f"another worker of the job stopped or cannot be reached ({first}). Relaunch every "
                "worker; with kmirror.callbacks.BackupAndRestore, training resumes from the last "
                "epoch."
            ) from None
