"""`kmirror.wrap`: a user's Keras model, checked and mirrored in place with the reducer asked for.

It validates what it is given (a model, devices, a cluster, the reducer and its options), picks
and binds the reducer (`kmirror.reducers`), and returns the `MirroredModel` that trains the model
(whose variables it mirrors where they are: `_core.mirroring`). Bad input is refused before
the model is touched.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from kmirror import reducers
from kmirror._core import cluster, mirroring
from kmirror._core.model import MirroredModel
from kmirror.reducers.base import Reducer

__all__ = ["wrap"]


def wrap(
    model: keras.Model,
    reducer: str | Reducer | tf.distribute.CrossDeviceOps = "auto",
    *,
    devices: list[str] | None = None,
    num_gpus: int | None = None,
    cluster_spec=None,
    task_type: str | None = None,
    task_id: int | None = None,
    sync_batch_norm: bool = True,
    prefetch: bool | None = None,
    **reducer_options: Any,
) -> MirroredModel:
    """Wraps a Keras model for synchronous data-parallel training on every local device.

    The returned `MirroredModel` trains exactly as the model would on one device with the same
    global batch (`batch_size` in `fit` is the global batch), only split across replicas. The
    model's variables are mirrored where they are, one copy per replica: its layers, optimizer
    and metrics are the objects that train, so every reference you hold to them stays valid, and
    weights, compile settings and optimizer state carry over. `unwrap()` gives the model back,
    single-device again.

    Example:

    ```python
    import kmirror
    kmirror.devices.simulate(2)                   # without GPUs: 2 logical CPU devices
    import keras, numpy as np
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.rand(100, 8), np.random.rand(100, 1)
    model = kmirror.wrap(model, reducer="hierarchical_copy")
    model.fit(x, y, batch_size=32, epochs=2)      # 32 rows per step in all: 16 per replica
    ```

    Args:
        model: any `keras.Model` that trains on one device: Sequential, functional or
            subclassed, with or without `get_config`, with its own `train_step`, `test_step` or
            `predict_step` or not, built or not, compiled or not (compile the wrapped model
            before `fit` if not).
        reducer: how gradients are summed across replicas: a name from `kmirror.REDUCERS`, a
            `kmirror.reducers.Reducer` object, or a `tf.distribute.CrossDeviceOps`.
        devices: the devices to replicate on (default: every GPU, else every logical CPU).
        num_gpus: use the first `num_gpus` GPUs instead of naming devices (0: the CPUs).
        cluster_spec: the workers of a multi-worker job (a dict, `tf.train.ClusterSpec` or
            `ClusterDef`); default: `TF_CONFIG`'s. Call `kmirror.cluster.connect()` first.
        task_type: this process's job in `cluster_spec` ("worker" or "chief").
        task_id: this process's index in its job.
        sync_batch_norm: BatchNormalization layers use the statistics of the global batch, as on
            one device, and so does every layer's sum or mean over the rows of its call
            (default). False: each replica normalises and reduces over its own rows (and
            counts them), fewer all-reduces per step, but no longer the single-device result.
        prefetch: with several replicas in one process, each replica's rows of the next batch
            of a `tf.data` dataset or of arrays are copied to its device while the current step
            runs, as `tf.distribute` does (the same rows, the same result). None (default): when
            the replicas are GPUs; on CPU devices the copy is free and the extra input
            pipeline per device only costs time.
        **reducer_options: options of the named reducer, e.g. `num_packs=2` for `"nccl"`.

    Returns:
        A `kmirror.MirroredModel`.
    """
    if isinstance(model, MirroredModel):
        raise ValueError(
            "this model is already a kmirror.MirroredModel; use it as it is, or call "
            "model.unwrap() first to wrap the plain model with other settings."
        )
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"kmirror.wrap expects a keras.Model; got {type(model).__name__}. Build a Keras model "
            "(keras.Sequential, the functional API, or a keras.Model subclass) and pass that."
        )
    if mirroring.is_wrapped(model):
        raise ValueError(
            "this model is already wrapped by kmirror: use the model kmirror.wrap returned, or "
            "call its unwrap() first to wrap the model with other settings."
        )
    workers = cluster.describe(cluster_spec, task_type, task_id)
    if workers is not None:
        if devices is not None:
            raise ValueError(
                "devices cannot be given together with cluster_spec / TF_CONFIG: every worker "
                "replicates on all its local GPUs, else on its CPU devices, as TensorFlow's "
                "MultiWorkerMirroredStrategy does."
            )
        if cluster_spec is not None:
            cluster.connect(cluster_spec, task_type, task_id)
    chosen = reducers.get(
        reducer,
        devices=devices,
        num_gpus=num_gpus,
        multi_worker=workers is not None,
        **reducer_options,
    )
    if workers is not None and cluster.joined() is None:
        _join_from_environment()
    chosen.bind(devices=devices, num_gpus=num_gpus)
    if prefetch is not None and not isinstance(prefetch, bool):
        raise ValueError(
            f"prefetch must be True, False or None (prefetch on GPUs); got {prefetch!r}."
        )
    return MirroredModel(model, chosen, sync_batch_norm=sync_batch_norm, prefetch=prefetch)


def _join_from_environment() -> None:
    """Joins the cluster `TF_CONFIG` describes (Ray Train and Kubernetes operators set it) when
    TensorFlow has not started yet; else says where `kmirror.cluster.connect()` goes."""
    try:
        cluster.connect()
    except RuntimeError:
        raise RuntimeError(
            "TF_CONFIG describes a cluster (Ray Train, a Kubernetes operator or a launcher set "
            "it) that this process has not joined, and TensorFlow has started: it configures its "
            "collective ops only before that. Call kmirror.cluster.connect() first thing in the "
            "script (with Ray Train: at the top of train_loop_per_worker), before building the "
            "model."
        ) from None
