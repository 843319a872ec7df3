"""Where kmirror reaches into TensorFlow: the only module that touches `tensorflow.python`.

TensorFlow has no public API for these things kmirror needs:

- a batch all-reduce with its own summing rule on top of TensorFlow's packing of gradients
  (`GroupedAllReduce`: the hierarchical copy that covers every device, also for odd counts);
- a multi-worker strategy with one replica per logical CPU device (`multi_worker_strategy`);
  TensorFlow's uses one CPU device per worker;
- the coordination service's key-value store (`publish`, `read_published`, `unpublish`), for
  exchanging small values between workers without collectives;
- the state TensorFlow draws its operations' seeds from (`seed_state`), so that processes can
  tell whether they would draw alike;
- whether TensorFlow has started, and whether its collective ops are configured
  (`started`, `collectives_configured`), to refuse a late `kmirror.cluster.connect()` clearly;
- which strategy a variable was created under (`strategy_of`): whether a model's variable is
  mirrored already, and by which wrapped model;
- a mirrored variable read as a number (`read_as_numbers`): TensorFlow's distributed variables,
  which hold a mirrored Keras variable's value, lack the `int()`, `float()` and `complex()` a
  `tf.Variable` has;
- Slurm's host lists and tasks per node expanded (`slurm_tasks`), as TensorFlow's
  `SlurmClusterResolver` expands them (the resolver itself gives no task a port without a GPU);
- the graphs TensorFlow makes, and the ops in them (`graphs`);
- autograph's rules of what it converts (`never_converted`): it leaves TensorFlow's and Keras'
  functions as written wherever they are called, and so it must leave kmirror's that take their
  place while a step runs (`keras_hooks`, and the functions this package installs).

Checked on TensorFlow 2.21.0 (`make test`) and 2.19.1 (`make test-compat`).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from kmirror import versions

versions.check()  # before the internals below

from tensorflow.python.autograph.core import config as autograph_config  # noqa: E402
from tensorflow.python.autograph.core import config_lib as autograph_rules  # noqa: E402
from tensorflow.python.distribute import collective_all_reduce_strategy as tf_collective  # noqa: E402
from tensorflow.python.distribute import cross_device_ops as tf_cross_device_ops  # noqa: E402
from tensorflow.python.distribute import distribute_lib  # noqa: E402
from tensorflow.python.distribute import values as tf_values  # noqa: E402
from tensorflow.python.distribute.cluster_resolver import (  # noqa: E402
    slurm_cluster_resolver as tf_slurm,
)
from tensorflow.python.eager import context  # noqa: E402

__all__ = ["GroupedAllReduce", "multi_worker_strategy", "publish", "read_published", "unpublish"]
__all__ += ["seed_state", "started", "collectives_configured", "slurm_tasks", "strategy_of"]
__all__ += ["read_as_numbers", "never_converted"]


class GroupedAllReduce(tf.distribute.HierarchicalCopyAllReduce):
    """TensorFlow's packed batch all-reduce with the sum of the packs done by `sum_packs`.

    `sum_packs(devices, packs)` receives `packs[d][i] = (tensor_i on device d, variable)` and
    returns the same layout with every device holding the total.
    """

    def __init__(self, sum_packs: Callable, num_packs: int = 1) -> None:
        super().__init__(num_packs=num_packs)
        self._sum_packs = sum_packs

    def _do_batch_all_reduce(self, reduce_op, dense_values):
        destinations = dense_values[0]._devices
        grouped = tf_cross_device_ops._group_value_by_device(dense_values)
        packs, packer = tf_cross_device_ops._pack_tensors(grouped, self._num_packs)
        reduced = self._sum_packs(destinations, packs)
        reduced = tf_cross_device_ops._unpack_tensors(reduced, packer)
        return tf_cross_device_ops._ungroup_and_make_mirrored(reduced, dense_values[0], reduce_op)


def never_converted(package: str) -> None:
    """Makes autograph leave the functions of `package` (a module's name, its submodules
    included) as written wherever they are called: from a converted function (a model's own
    `tf.function`, a `tf.map_fn` body outside Keras' steps) they run as TensorFlow's and Keras'
    run there, and what they call is converted only where those would convert it. Without it,
    autograph converts a kmirror function standing in for one of Keras' (a layer's call, a
    reduction), with a warning where it cannot."""
    rules = autograph_config.CONVERSION_RULES
    if not any(isinstance(r, autograph_rules.DoNotConvert) and r.matches(package) for r in rules):
        autograph_config.CONVERSION_RULES = (autograph_rules.DoNotConvert(package), *rules)


def publish(key: str, value: str) -> None:
    """Stores `value` under `key` in the job's coordination service."""
    context.context().set_config_key_value(key, value)


def unpublish(key: str) -> None:
    """Removes `key` from the job's coordination service."""
    context.context().delete_config_key_value(key)


def read_published(key: str) -> str:
    """The value some task published under `key`; waits until it is there."""
    return context.context().get_config_key_value(key)


def seed_state() -> tuple | None:
    """TensorFlow's global seed and the state of the generator its eager operations' seeds are
    drawn from (None when no global seed was set: every process draws differently)."""
    eager = context.context()
    if eager._seed is None:
        return None
    return eager._seed, eager._rng.getstate()


def started() -> bool:
    """True once TensorFlow's runtime has started (a tensor, model or device query was made)."""
    return context.context()._context_handle is not None


def collectives_configured() -> bool:
    """True when this process's collective ops are configured (a multi-worker strategy exists)."""
    return context.context()._collective_leader is not None


def strategy_of(variable: tf.Variable) -> tf.distribute.Strategy | None:
    """The `tf.distribute` strategy in whose scope `variable` was created (None: none)."""
    return getattr(variable, "_distribute_strategy", None)


def read_as_numbers() -> None:
    """Gives TensorFlow's distributed variables the conversions of a `tf.Variable`: `int(v)`,
    `float(v)` and `complex(v)` of the value `v.numpy()` reads (outside a step: every replica's
    copy holds it), so that `int(layer.counter.value)` answers as on one device. Adds only what
    TensorFlow does not define; calling it again changes nothing."""
    for name, convert in (("__int__", int), ("__float__", float), ("__complex__", complex)):
        if not hasattr(tf_values.DistributedVariable, name):
            setattr(tf_values.DistributedVariable, name, _read_as(convert))


def _read_as(convert: Callable) -> Callable:
    def method(self):
        return convert(self.numpy())

    method.__name__ = f"__{convert.__name__}__"
    return method


class _Extended(tf_collective.CollectiveAllReduceExtended):
    """TensorFlow's multi-worker strategy, with one replica per logical CPU device when there are
    no GPUs (TensorFlow would use one CPU device per worker)."""

    def __init__(self, *args, cpu_devices: int = 1, **kwargs):
        self._kmirror_cpu_devices = cpu_devices
        super().__init__(*args, **kwargs)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        devices, kind = super()._initialize_local_devices(cluster_resolver, worker_device)
        if kind == "CPU" and self._kmirror_cpu_devices > 1:
            devices = tuple(
                f"{worker_device}/device:CPU:{i}" for i in range(self._kmirror_cpu_devices)
            )
        return devices, kind


class _MultiWorker(tf.distribute.MultiWorkerMirroredStrategy):
    def __init__(self, cluster_resolver, communication_options, cpu_devices):
        distribute_lib.Strategy.__init__(
            self,
            _Extended(
                self,
                cluster_resolver=cluster_resolver,
                communication_options=communication_options,
                cpu_devices=cpu_devices,
            ),
        )


def multi_worker_strategy(resolver, options, cpu_devices: int = 1) -> tf.distribute.Strategy:
    """A MultiWorkerMirroredStrategy over `resolver`'s cluster (`cpu_devices` replicas per worker
    without GPUs)."""
    return _MultiWorker(resolver, options, cpu_devices)


def slurm_tasks(nodes: str, tasks_per_node: str) -> list[tuple[str, int]]:
    """(host, tasks on it) for a job step's `SLURM_STEP_NODELIST` ("node[01-03],gpu7") and
    `SLURM_STEP_TASKS_PER_NODE` ("2(x3),1"), in Slurm's order."""
    return list(
        zip(tf_slurm.expand_hostlist(nodes), tf_slurm.expand_tasks_per_node(tasks_per_node))
    )


never_converted(__name__)  # the functions this package installs in TensorFlow's place
