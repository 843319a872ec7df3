"""Reducers for several devices in one process, on `tf.distribute.MirroredStrategy`.

Each is a thin choice of TensorFlow's cross-device ops for the gradients. `HierarchicalCopy`
replaces TensorFlow's grouping, which drops one device's gradient when the device count is odd.
"""

from __future__ import annotations

import abc

import tensorflow as tf

from kmirror._core import tf_hooks
from kmirror.reducers.base import Reducer, check_num_packs

__all__ = ["InProcessReducer", "Nccl", "HierarchicalCopy", "OneDevice", "CrossDeviceOps"]


class InProcessReducer(Reducer):
    """A reducer that mirrors variables on local devices and reduces with a `CrossDeviceOps`."""

    @abc.abstractmethod
    def cross_device_ops(self) -> tf.distribute.CrossDeviceOps:
        """How the replicas' gradients are summed."""

    def check_devices(self, devices: list[str]) -> None:
        """Raises a ValueError naming the fix when this reducer cannot run on `devices`."""

    def make_strategy(self, devices: list[str]) -> tf.distribute.Strategy:
        self.check_devices(devices)
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=self.cross_device_ops())

    def replica_sum(self, value: tf.Tensor) -> tf.Tensor:
        return self.replica_sums([value])[0]

    def replica_sums(self, values: list) -> list:
        # Each replica's values copied to the first device, summed there and copied back, in one
        # merge and unpacked: the sums of statistics and normalisers are small. (TensorFlow's own
        # replica all_reduce gives its result a custom gradient whose tracing walks every
        # replica's graph, at every call.)
        def merge(strategy, *per_replica):
            summed = []
            for value in per_replica:
                local = strategy.experimental_local_results(value)
                with tf.device(local[0].device):
                    total = tf.math.add_n(local)
                copies = []
                for replica_value in local:
                    with tf.device(replica_value.device):
                        copies.append(tf.identity(total))
                summed.append(
                    strategy.experimental_distribute_values_from_function(
                        lambda context, copies=copies: copies[context.replica_id_in_sync_group]
                    )
                )
            return summed

        return list(tf.distribute.get_replica_context().merge_call(merge, args=tuple(values)))

    def batches_on_devices(self, dataset: tf.data.Dataset):
        if self.num_replicas < 2:
            return None
        # tf.distribute's input pipeline: one iterator per device, each element copied to its
        # device while the previous step runs.
        return self.strategy.distribute_datasets_from_function(lambda _: dataset)


class _Packing(InProcessReducer):
    """An all-reduce that concatenates gradients into `num_packs` packs first."""

    options = ("num_packs",)

    def __init__(self, num_packs: int = 1) -> None:
        super().__init__()
        self.num_packs = check_num_packs(num_packs)


class Nccl(_Packing):
    """NVIDIA NCCL all-reduce between the GPUs of one machine.

    The fastest choice with two or more GPUs: gradients move GPU to GPU over NVLink or PCIe,
    never through host memory. NCCL has no CPU kernels, so it needs at least 2 GPUs.

    Example:

    ```python
    model = kmirror.wrap(model, reducer=kmirror.reducers.Nccl(num_packs=2))
    ```

    Args:
        num_packs: how many packs gradients are concatenated into before the all-reduce
            (0: none, each gradient separately).
    """

    name = "nccl"

    def check_devices(self, devices: list[str]) -> None:
        require_gpus(self.name, devices)

    def cross_device_ops(self) -> tf.distribute.CrossDeviceOps:
        return tf.distribute.NcclAllReduce(num_packs=self.num_packs)


class HierarchicalCopy(_Packing):
    """Hierarchical copy all-reduce: sum within two groups of devices, then between the groups.

    Designed for machines whose GPUs form two fully connected groups (DGX-1 style); it runs on any
    devices, CPUs included. Unlike TensorFlow's `HierarchicalCopyAllReduce`, it gives the exact
    sum on every device count, odd counts included.

    Example:

    ```python
    model = kmirror.wrap(model, reducer=kmirror.reducers.HierarchicalCopy(num_packs=1))
    ```

    Args:
        num_packs: how many packs gradients are concatenated into before the all-reduce
            (0: none, each gradient separately).
    """

    name = "hierarchical_copy"

    def cross_device_ops(self) -> tf.distribute.CrossDeviceOps:
        return tf_hooks.GroupedAllReduce(hierarchical_copy_sum, num_packs=self.num_packs)


class OneDevice(InProcessReducer):
    """Reduction to one device: every replica's gradient is copied to one device, summed there,
    and the sum is copied back.

    Simple and correct everywhere (`"auto"` picks `hierarchical_copy` on CPUs). Its cost grows
    with the replica count, since one device receives every gradient.

    Example:

    ```python
    model = kmirror.wrap(model, reducer=kmirror.reducers.OneDevice(reduce_to_device="/cpu:0"))
    ```

    Args:
        reduce_to_device: the device that sums (default: the first replica's device).
    """

    name = "one_device"
    options = ("reduce_to_device",)

    def __init__(self, reduce_to_device: str | None = None) -> None:
        super().__init__()
        self.reduce_to_device = reduce_to_device

    def cross_device_ops(self) -> tf.distribute.CrossDeviceOps:
        return tf.distribute.ReductionToOneDevice(reduce_to_device=self.reduce_to_device)


class CrossDeviceOps(InProcessReducer):
    """Any `tf.distribute.CrossDeviceOps` object of your own, used as the reducer.

    `kmirror.wrap(model, reducer=my_cross_device_ops)` wraps it in this class.

    Example:

    ```python
    ops = tf.distribute.ReductionToOneDevice()
    model = kmirror.wrap(model, reducer=kmirror.reducers.CrossDeviceOps(ops))
    ```

    Args:
        ops: the cross-device ops that sum the gradients.
    """

    name = "custom"

    def __init__(self, ops: tf.distribute.CrossDeviceOps) -> None:
        super().__init__()
        self.ops = ops

    def cross_device_ops(self) -> tf.distribute.CrossDeviceOps:
        return self.ops


def require_gpus(reducer: str, devices: list[str]) -> None:
    """NCCL has no CPU kernels: fail at `wrap`, naming the fix, not at the first step."""
    found = sum("GPU" in d.upper() for d in devices)
    if found < 2 or found != len(devices):
        raise ValueError(
            f"reducer '{reducer}' needs at least 2 GPUs and only GPUs; found {found} GPU(s) among "
            f"the devices {devices}. Use reducer='hierarchical_copy' or 'one_device' on CPUs, "
            "or reducer='auto' to let kmirror choose."
        )


def hierarchical_copy_sum(devices, device_grads):
    """Sums `device_grads[d][i] = (tensor_i on device d, var)` over d, in two groups.

    Returns the same layout, each device holding the total. The root of each group rotates with
    the tensor index so that no single device does all the adding.
    """
    n = len(devices)
    half = n // 2
    groups = [list(range(half)), list(range(half, n))] if n > 1 else [[0]]
    totals = []
    for i, single in enumerate(zip(*device_grads)):
        values = [grad for grad, _ in single]
        # Alternate which group finishes the sum, as TensorFlow's version does.
        order = groups if (i % n) < half or n == 1 else groups[::-1]
        roots = [group[i % len(group)] for group in order]
        partial = []
        for group, root in zip(order, roots):
            with tf.device(devices[root]):
                partial.append(tf.math.add_n([values[d] for d in group]))
        with tf.device(devices[roots[0]]):
            total = tf.math.add_n(partial)
        at_root = {roots[0]: total}
        for root in roots[1:]:
            with tf.device(devices[root]):
                at_root[root] = tf.identity(total)
        per_device = []
        for d in range(n):
            source = next(at_root[r] for g, r in zip(order, roots) if d in g)
            with tf.device(devices[d]):
                per_device.append((tf.identity(source), single[d][1]))
        totals.append(per_device)
    return [list(per_device) for per_device in zip(*totals)]
