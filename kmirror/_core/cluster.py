"""Who am I in the job: the process's place, whether it is the chief, and joining the cluster
`TF_CONFIG` (or a cluster spec) describes; public as `kmirror.cluster`, whose page says more."""

from __future__ import annotations

import json
import os
import sys

import tensorflow as tf

from kmirror._core import slurm, tf_hooks

__all__ = ["is_chief", "process", "connect", "connected", "joined", "describe", "Cluster"]


def is_chief(model=None) -> bool:
    """True in the one process of the job that writes checkpoints, summaries and backups.

    Example:

    ```python
    if kmirror.cluster.is_chief(model):
        model.save("final.keras")
    ```

    Args:
        model: a `kmirror.MirroredModel` (asked directly), or None / a plain Keras model (then
            the launcher's environment decides: Horovod's rank, else `TF_CONFIG`).
    """
    if model is not None and hasattr(model, "is_chief"):
        return bool(model.is_chief)
    return process()[0] == 0


def process() -> tuple[int, int]:
    """`(this process's index, the job's number of processes)`: the multi-worker cluster joined
    with `kmirror.cluster.connect()`, else Horovod's rank and size, else `TF_CONFIG`'s cluster,
    else `(0, 1)`, as in `index, count = kmirror.cluster.process()`. The chief is process 0.
    """
    if _connected is not None:
        return _connected.index, _connected.num_workers
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is not None and hvd.is_initialized():  # launched by mpirun as well
        return hvd.rank(), hvd.size()
    if "HOROVOD_RANK" in os.environ and "HOROVOD_SIZE" in os.environ:
        return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    workers = describe()  # TF_CONFIG's cluster, not joined yet
    return (workers.index, workers.num_workers) if workers is not None else (0, 1)


class Cluster:
    """The workers of a multi-worker job and this process's place among them."""

    def __init__(self, spec: tf.train.ClusterSpec, task_type: str, task_id: int) -> None:
        self.spec = spec
        self.task_type = task_type
        self.task_id = task_id
        self.tasks = [(job, i) for job in _job_order(spec) for i in range(spec.num_tasks(job))]
        chief = ("chief", 0) if "chief" in spec.jobs else ("worker", 0)
        self.chief_index = self.tasks.index(chief)
        self.is_chief = (task_type, task_id) == chief
        #: This task's place in `tasks`: the order of the workers' replicas and rows.
        self.index = self.tasks.index((task_type, task_id))
        self.strategy = None
        self._exchanges, self._published = 0, None

    @property
    def num_workers(self) -> int:
        return len(self.tasks)

    def same_as(self, other: Cluster) -> bool:
        mine, theirs = (self.task_type, self.task_id), (other.task_type, other.task_id)
        return self.spec.as_dict() == other.spec.as_dict() and mine == theirs

    def resolver(self, num_gpus: int = 0):
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            self.spec,
            task_type=self.task_type,
            task_id=self.task_id,
            num_accelerators={"GPU": num_gpus},
            rpc_layer="grpc",
        )

    def exchange(self, key: str, value: str) -> list[str]:
        """Publishes `value` under `key` and returns every task's value, in task order.

        Goes through TensorFlow's coordination service, not through collectives, so that it
        works even when the workers disagree on the collectives' shape. Every worker calls it in
        the same order; a counter keeps each exchange's keys apart. Once every task published
        its value, every task has read the previous exchange: this task's key of it goes.
        """
        self._exchanges += 1
        prefix = f"kmirror/{self._exchanges}/{key}"
        mine = f"{prefix}/{self.task_type}/{self.task_id}"
        tf_hooks.publish(mine, value)
        values = [tf_hooks.read_published(f"{prefix}/{job}/{i}") for job, i in self.tasks]
        if self._published is not None:
            tf_hooks.unpublish(self._published)
        self._published = mine
        return values


_connected: Cluster | None = None


def connect(cluster_spec=None, task_type: str | None = None, task_id: int | None = None):
    """Joins this process to a multi-worker job; call it first, before building any model.

    TensorFlow configures its collective ops (the gRPC transport between workers) only before it
    runs anything, so this must be the first TensorFlow work of the script. Without `cluster_spec`
    it reads `TF_CONFIG`, as Kubernetes operators and Ray Train set it; without that, in a
    Slurm job step of several tasks (`srun -n 2 python train.py`), Slurm's environment
    (`_core.slurm`): one worker per task, worker `SLURM_PROCID`, the step's nodes, ports from
    8888 on each node as TensorFlow's `SlurmClusterResolver` gives them (`KMIRROR_SLURM_PORT`
    sets another first port). Without any of these it does nothing and returns None (one
    process). Calling it again with the same cluster
    is harmless.

    Example:

    ```python
    import kmirror
    kmirror.cluster.connect()      # TF_CONFIG='{"cluster": {"worker": [...]}, "task": {...}}'
    model = kmirror.wrap(build_model(), reducer="ring")
    ```

    Args:
        cluster_spec: a dict `{"worker": ["host:port", ...]}`, a `tf.train.ClusterSpec` or a
            `ClusterDef`; default: the cluster of `TF_CONFIG`.
        task_type: this process's job ("worker" or "chief"); default "worker".
        task_id: this process's index in its job.

    Returns:
        The `Cluster`, or None without a cluster.
    """
    global _connected
    wanted = describe(cluster_spec, task_type, task_id)
    step = slurm.workers() if wanted is None and cluster_spec is None else None
    if step is not None:
        wanted = describe({"worker": step[0]}, "worker", step[1])
    if wanted is None:
        return None
    if _connected is not None:
        if not _connected.same_as(wanted):
            raise ValueError(
                "this process already joined another cluster (or as another task); a process "
                "belongs to one multi-worker job."
            )
        return _connected
    if tf_hooks.started() and not tf_hooks.collectives_configured():
        raise RuntimeError(
            "kmirror.cluster.connect() must run before TensorFlow starts (before any model, "
            "tensor or device query): TensorFlow configures its collective ops only at program "
            "start. Call kmirror.cluster.connect() (after kmirror.devices.simulate, if used) at "
            "the top of the script."
        )
    # The job's one multi-worker strategy: creating it configures TensorFlow's collective ops.
    # Reducers reuse it (a second one would reconfigure the running collectives).
    options = tf.distribute.experimental.CommunicationOptions()
    resolver = wanted.resolver(_physical_gpus())
    wanted.strategy = tf_hooks.multi_worker_strategy(resolver, options, _cpu_devices())
    _connected = wanted
    return wanted


def joined() -> Cluster | None:
    """The cluster this process joined, or None."""
    return _connected


def connected() -> Cluster:
    """The cluster this process joined; raises RuntimeError naming the fix if none."""
    if _connected is None:
        raise RuntimeError(
            "this process has not joined its cluster: call kmirror.cluster.connect() at the top "
            "of the script (it reads TF_CONFIG, or takes cluster_spec, task_type and task_id)."
        )
    return _connected


def describe(cluster_spec=None, task_type=None, task_id=None) -> Cluster | None:
    """Validates a cluster description (or TF_CONFIG's) without joining it; without either, the
    cluster this process joined (or None)."""
    if cluster_spec is None:
        if task_type is not None or task_id is not None:
            raise ValueError("task_type and task_id go with cluster_spec; pass cluster_spec too.")
        config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        if not config.get("cluster"):
            return _connected
        task = config.get("task") or {}
        cluster_spec, task_type, task_id = config["cluster"], task.get("type"), task.get("index")
    try:
        spec = tf.train.ClusterSpec(cluster_spec)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"cluster_spec must be a dict such as {{'worker': ['host1:2222', 'host2:2222']}}, a "
            f"tf.train.ClusterSpec or a ClusterDef: {error}"
        ) from None
    task_type = task_type or "worker"
    unknown = set(spec.jobs) - {"chief", "worker"}
    if unknown or not spec.jobs:
        raise ValueError(
            f"a kmirror cluster has 'worker' tasks and at most one 'chief'; got jobs {spec.jobs}."
        )
    if task_type not in spec.jobs:
        raise ValueError(
            f"task_type '{task_type}' is not a job of the cluster {spec.jobs}; pass the job this "
            "process runs as (task_type='worker' or 'chief')."
        )
    if task_id is None:
        raise ValueError("task_id is missing: pass this process's index in its job (0, 1, ...).")
    count = spec.num_tasks(task_type)
    if not isinstance(task_id, int) or isinstance(task_id, bool) or not 0 <= task_id < count:
        raise ValueError(
            f"task_id={task_id!r} is out of range: job '{task_type}' has {count} task(s), "
            f"so task_id must be 0..{count - 1}."
        )
    return Cluster(spec, task_type, task_id)


def _job_order(spec: tf.train.ClusterSpec) -> list[str]:
    return [job for job in ("chief", "worker") if job in spec.jobs]


def _physical_gpus() -> int:
    return len(tf.config.list_physical_devices("GPU"))


def _cpu_devices() -> int:
    """How many logical CPU devices `kmirror.devices.simulate` asked for (without starting TF)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    return len(configured) if configured else 1
