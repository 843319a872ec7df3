"""Horovod's ring all-reduce: one process per device, started by horovodrun or `kmirror.launch`.

Each process holds one replica (on GPU `local_rank`, else the CPU) and trains on its rows of every
global batch (loading only those where it can, `kmirror.data`); gradients are summed with
Horovod's grouped all-reduce (tensor fusion), the loss and metric states with an all-reduce, and
predictions, where a metric needs them, gathered with an all-gather, so every process logs the
global values. Horovod's own Keras API does not work with Keras 3; this reducer uses only
Horovod's TensorFlow collectives.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import keras
import tensorflow as tf

from kmirror import devices as devices_lib
from kmirror.errors import PeerLost, reason
from kmirror.reducers import compression as compression_lib
from kmirror.reducers.base import Reducer, check_num_packs
from kmirror.reducers.job import Job
from kmirror.reducers.packing import packed_broadcast, packed_sum

__all__ = ["Horovod", "HorovodJob"]


def _import_horovod():
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:
        raise ImportError(
            "reducer='horovod' needs Horovod built for this TensorFlow: run "
            "`python -m kmirror.install_horovod` (it builds Horovod 0.28.1 against the "
            "TensorFlow installed, in a few minutes, and caches the wheel; set "
            "HOROVOD_GPU_OPERATIONS=NCCL first on GPU machines)."
        ) from error
    return hvd


class Horovod(Reducer):
    """Horovod's ring all-reduce between processes, one device each.

    Launch the script with `python -m kmirror.launch -n 2 script.py` (or `horovodrun -np 2`).
    `batch_size` stays the global batch: every process trains on its own rows of each, loading
    only those from numpy arrays and `kmirror.data` datasets; a `tf.data` pipeline of global
    batches is read by every process, so shuffle it with a fixed seed. At the start of `fit` every
    process gets rank 0's weights and optimizer state.

    Example:

    ```python
    model = kmirror.wrap(model, reducer=kmirror.reducers.Horovod(compression="fp16"))
    model.fit(x, y, batch_size=256)     # 128 rows per process with 2 processes
    ```

    Args:
        compression: None, "fp16" or "bf16": the dtype gradients travel in.
        sparse_as_dense: all-reduce sparse gradients (Embedding) as dense tensors instead of
            gathering their rows; faster when most rows are touched.
        num_packs: how many flat buffers kmirror concatenates the small dense gradients (under
            1 MiB, `kmirror.reducers.packing.PACK_BELOW_BYTES`) into before the all-reduce, per
            dtype; larger gradients travel as they are. 0 hands every gradient to Horovod by
            itself and leaves the packing to Horovod's tensor fusion
            (`HOROVOD_FUSION_THRESHOLD`), which still costs a negotiation per gradient: on models
            of many small layers, much slower. The default, 2, measured fastest (`make bench`,
            fusion section).
    """

    name = "horovod"
    options = ("compression", "sparse_as_dense", "num_packs")

    def __init__(self, compression=None, sparse_as_dense: bool = False, num_packs: int = 2) -> None:
        super().__init__()
        self.compression = compression_lib.get(compression)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.num_packs = check_num_packs(num_packs)
        self._hvd = None

    # -- set-up --------------------------------------------------------------------------------
    def select_devices(self, devices, num_gpus) -> list[str]:
        if devices is not None:
            raise ValueError(
                "reducer='horovod' runs one process per device and places each on GPU local_rank "
                "(else the CPU) itself; do not pass devices=. Start one process per GPU with "
                "`python -m kmirror.launch -n N script.py` or horovodrun."
            )
        self._hvd = hvd = _import_horovod()
        if not hvd.is_initialized():
            hvd.init()
        if hvd.size() == 1 and "HOROVOD_RANK" not in os.environ:
            warnings.warn(
                "kmirror: reducer='horovod' was started without a launcher, so it trains as a "
                "single replica. Start N processes with `python -m kmirror.launch -n N "
                "script.py` or `horovodrun -np N python script.py`.",
                stacklevel=4,
            )
        gpus = devices_lib.gpus() if num_gpus != 0 else []
        return [gpus[hvd.local_rank() % len(gpus)]] if gpus else ["/device:CPU:0"]

    def make_strategy(self, devices: list[str]) -> tf.distribute.Strategy:
        # The rank reaches the step as a variable, not a constant: with a constant rank and a
        # static batch size, a process whose rows are known to be empty would have its
        # collectives' inputs constant-folded by TensorFlow's graph optimizer, which then runs
        # those collectives at optimisation time, on that process alone (the job hangs).
        with tf.device(devices[0]):
            self._rank = tf.Variable(self._hvd.rank(), trainable=False, dtype=tf.int32)
        return tf.distribute.OneDeviceStrategy(devices[0])

    @property
    def num_replicas(self) -> int:
        return self._hvd.size()

    @property
    def rank(self) -> int:
        return self._hvd.rank()

    # -- collectives ---------------------------------------------------------------------------
    def distribute(self, shard_fn):
        size = self._hvd.size()
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: shard_fn(self._rank.read_value(), size)
        )

    def replica_index(self):
        return self._rank.read_value()

    def reduce_gradients(self, gradients: list) -> list:
        hvd = self._hvd
        gradients = [None if g is None else self._local(g) for g in gradients]
        if self._hvd.size() == 1:
            return gradients
        if self.sparse_as_dense:
            gradients = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in gradients
            ]
        dense = [i for i, g in enumerate(gradients) if isinstance(g, tf.Tensor)]
        reduced = list(gradients)
        if dense and self.compression is compression_lib.BF16:
            for i, total in zip(
                dense, compression_lib.bf16_sum(hvd, [gradients[i] for i in dense])
            ):
                reduced[i] = total
        elif dense:
            compressed = [self.compression.compress(gradients[i]) for i in dense]
            sent = [t for t, _ in compressed]
            summed = (
                packed_sum(hvd, sent, self.num_packs)
                if self.num_packs
                else hvd.grouped_allreduce(sent, op=hvd.Sum)
            )
            for i, total, (_, ctx) in zip(dense, summed, compressed):
                reduced[i] = self.compression.decompress(total, ctx)
        for i, g in enumerate(gradients):
            if isinstance(g, tf.IndexedSlices):
                # Summing sparse gradients is gathering every process's rows.
                reduced[i] = hvd.allreduce(g, op=hvd.Sum)
        return reduced

    def all_sum(self, value):
        return self._hvd.allreduce(value, op=self._hvd.Sum)

    def replica_sum(self, value):
        return self._hvd.allreduce(tf.stop_gradient(value), op=self._hvd.Sum)

    def reduce_in_replica(self, gradients: list) -> list:
        return self.reduce_gradients(gradients)  # one replica per process: no merge needed

    def all_gather(self, value):
        return self._hvd.allgather(value)

    def _local(self, per_replica):
        return self.strategy.experimental_local_results(per_replica)[0]

    def sum(self, per_replica) -> tf.Tensor:
        return self._hvd.allreduce(self._local(per_replica), op=self._hvd.Sum)

    def concat(self, per_replica):
        return tf.nest.map_structure(
            lambda v: None if v is None else self._hvd.allgather(self._local(v)), per_replica
        )

    def make_job(self) -> HorovodJob:
        return HorovodJob(self._hvd)

    def describe(self) -> str:
        return f"horovod rank {self.rank} of {self.num_replicas}"


class HorovodJob(Job):
    """The ranks of a Horovod job: rank and size from Horovod; the broadcast, counts and seed
    travel through Horovod's collectives."""

    def __init__(self, hvd) -> None:
        self._hvd = hvd

    @property
    def num_processes(self) -> int:
        return self._hvd.size()

    @property
    def process_index(self) -> int:
        return self._hvd.rank()

    def broadcast(self, variables: list) -> None:
        # One broadcast per dtype of all variables concatenated: Horovod negotiates each tensor
        # separately, which costs a deep model's hundreds of variables seconds. Run eagerly: a
        # few small ops per variable cost less than tracing them as a function and its first
        # call (measured 17-26 ms against 40-80 ms for a small model's).
        if self._hvd.size() == 1:
            return
        packed_broadcast(self._hvd, variables)

    @contextlib.contextmanager
    def failures(self):
        try:
            yield
        except tf.errors.OpError as error:
            if self._hvd.size() == 1 or "horovod" not in str(error).lower():
                raise
            first = reason(error)
            rank, size = self._hvd.rank(), self._hvd.size()
            raise PeerLost(
                f"kmirror: rank {rank} of {size} stops because another rank of "
                f"the Horovod job stopped or cannot be reached ({first}). Relaunch every process; "
                "with kmirror.callbacks.BackupAndRestore, training resumes from the last epoch."
            ) from None

    def gather_counts(self, count: int) -> list[int]:
        if self._hvd.size() == 1:
            return [count]
        counts = self._hvd.allgather(tf.constant([count], tf.int64), name="kmirror_counts")
        return [int(c) for c in counts.numpy()]

    def agree_on_seed(self) -> None:
        if self._hvd.size() > 1:
            drawn = tf.random.uniform([], 0, 2**31 - 1, dtype=tf.int64)
            seed = int(self._hvd.broadcast(drawn, root_rank=0, name="kmirror_seed"))
            keras.utils.set_random_seed(seed)
