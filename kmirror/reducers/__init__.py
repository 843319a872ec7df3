"""Reducers: how the replicas' gradients are summed. One argument of `kmirror.wrap` picks one.

| name | what runs | where |
|---|---|---|
| `"nccl"` | NVIDIA NCCL all-reduce | 2+ GPUs, one process |
| `"hierarchical_copy"` | sum in two device groups, then between them | any devices, one process |
| `"one_device"` | copy to one device, sum, copy back | any devices, one process |
| `"horovod"` | Horovod's ring all-reduce | one process per device |
| `"ring"` | TensorFlow's collective ring | several workers |
| `"auto"` | see `auto()`: Horovod, collective, NCCL or hierarchical copy by where it runs | |

Example:

```python
import kmirror, keras
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="adam", loss="mse")
by_name = kmirror.wrap(model, reducer="hierarchical_copy", num_packs=2)
model = by_name.unwrap()                # the same model, to wrap with a reducer object
by_object = kmirror.wrap(model, reducer=kmirror.reducers.HierarchicalCopy(num_packs=2))
print(kmirror.reducers.auto())          # what reducer="auto" picks in this process
```
"""

from __future__ import annotations

import difflib
import os

import tensorflow as tf

from kmirror import devices as devices_lib
from kmirror.reducers import compression
from kmirror.reducers.base import Reducer
from kmirror.reducers.collective import Collective
from kmirror.reducers.horovod import Horovod
from kmirror.reducers.in_process import (
    CrossDeviceOps,
    HierarchicalCopy,
    InProcessReducer,
    Nccl,
    OneDevice,
)
from kmirror.reducers.job import Job

__all__ = [
    "REDUCERS",
    "Reducer",
    "Job",
    "InProcessReducer",
    "Nccl",
    "HierarchicalCopy",
    "OneDevice",
    "CrossDeviceOps",
    "Horovod",
    "Collective",
    "compression",
    "get",
]

REDUCERS = ("auto", "nccl", "hierarchical_copy", "one_device", "horovod", "ring")
"""Every reducer name `kmirror.wrap` accepts.

Example:

```python
import kmirror
print(kmirror.REDUCERS)   # ('auto', 'nccl', 'hierarchical_copy', 'one_device', 'horovod', 'ring')
```
"""

_BY_NAME = {cls.name: cls for cls in (Nccl, HierarchicalCopy, OneDevice, Horovod)}


def get(reducer, devices=None, num_gpus=None, multi_worker: bool = False, **options) -> Reducer:
    """Turns the `reducer` argument (a name, a Reducer or a CrossDeviceOps) into a Reducer.

    Args:
        reducer: a name from `REDUCERS`, a `Reducer` object, or a `tf.distribute.CrossDeviceOps`.
        devices: the devices asked for (they decide what `"auto"` picks).
        num_gpus: the GPU count asked for, instead of devices.
        multi_worker: the process is one worker of a cluster (`cluster_spec` or `TF_CONFIG`).
        **options: options of the named reducer, such as `num_packs`.
    """
    if isinstance(reducer, Reducer):
        if options:
            raise ValueError(
                f"reducer options {sorted(options)} were given with a {type(reducer).__name__} "
                "object; set them on the object instead, e.g. "
                "kmirror.reducers.HierarchicalCopy(num_packs=2)."
            )
        return reducer
    if isinstance(reducer, tf.distribute.CrossDeviceOps):
        return CrossDeviceOps(reducer, **options)
    if not isinstance(reducer, str):
        raise TypeError(
            f"reducer must be a name from {list(REDUCERS)} or a kmirror.reducers.Reducer; "
            f"got {type(reducer).__name__}."
        )
    if reducer not in REDUCERS:
        close = _closest(reducer)
        hint = f" Did you mean '{close}'?" if close else ""
        raise ValueError(
            f"unknown reducer '{reducer}'.{hint} Valid reducers: {', '.join(REDUCERS)}."
        )
    if multi_worker:
        if reducer not in ("ring", "nccl", "auto"):
            raise ValueError(
                f"reducer '{reducer}' does not run across workers; with cluster_spec or TF_CONFIG "
                "use reducer='ring', 'nccl' (GPUs) or 'auto'."
            )
        return _checked(Collective, options, reducer, communication=reducer)
    if reducer == "ring":
        raise ValueError(
            "reducer 'ring' runs across workers and needs a cluster: set TF_CONFIG (python -m "
            "kmirror.launch --workers 2 script.py does) or pass cluster_spec, task_type and "
            "task_id, and call kmirror.cluster.connect() first. In one process use "
            "'hierarchical_copy', 'one_device' or 'nccl'."
        )
    if reducer == "auto":
        reducer = auto(devices, num_gpus)
    return _checked(_BY_NAME[reducer], options, reducer)


def _checked(cls, options: dict, reducer: str, **fixed) -> Reducer:
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        accepted = ", ".join(cls.options) or "no options"
        raise ValueError(
            f"reducer '{reducer}' does not take the option(s) {', '.join(unknown)}; "
            f"it accepts: {accepted}."
        )
    return cls(**fixed, **options)


def _closest(name: str) -> str | None:
    """The valid name a misspelling most likely meant ('one-device', 'NCCL', 'nccl_allreduce')."""
    spelled = name.strip().lower().replace("-", "_").replace(" ", "_")
    for valid in REDUCERS:
        if spelled == valid or spelled.startswith(valid) or valid.startswith(spelled or "?"):
            return valid
    close = difflib.get_close_matches(spelled, REDUCERS, n=1, cutoff=0.5)
    return close[0] if close else None


def auto(devices=None, num_gpus=None) -> str:
    """Horovod under a Horovod launcher; else NCCL on 2+ physical GPUs; else hierarchical copy,
    the faster of the two all-reduces that run on CPUs (`make bench`, scaling section; TensorFlow
    itself would pick one_device)."""
    if launched_by_horovod():
        return "horovod"
    devices = devices_lib.choose(devices, num_gpus)
    all_gpus = devices and all("GPU" in d.upper() for d in devices)
    physical = len(tf.config.list_physical_devices("GPU"))
    if all_gpus and len(devices) >= 2 and physical >= 2 and tf.test.is_built_with_cuda():
        return "nccl"
    return "hierarchical_copy"


def launched_by_horovod() -> bool:
    """True in a process started by horovodrun or `kmirror.launch` for Horovod."""
    return "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ
