"""Which devices replicas run on, and splitting the host CPU into several without GPUs.

Example:

```python
import kmirror
kmirror.devices.simulate(2)             # first, before TensorFlow starts; only without GPUs
print(kmirror.devices.gpu_count(), kmirror.devices.local_devices())
```
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["simulate", "local_devices", "choose", "gpus", "gpu_count"]


def simulate(n: int) -> list[str]:
    """Splits the host CPU into `n` logical devices, so that `n` replicas can run without GPUs.

    Tests, notebooks and laptops use this to exercise multi-replica training where no GPUs are
    present. It must run before TensorFlow initialises its devices, that is before the first model,
    tensor or `tf.config.list_logical_devices` call of the process. Calling it again with the same
    `n` is harmless.

    Example:

    ```python
    import kmirror
    kmirror.devices.simulate(2)
    print(kmirror.devices.local_devices())   # ['/device:CPU:0', '/device:CPU:1']
    ```

    Args:
        n: how many logical CPU devices to create (at least 1).

    Returns:
        The names of the logical CPU devices.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"devices.simulate(n) needs a whole number n >= 1; got {n!r}.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    names = [f"/device:CPU:{i}" for i in range(n)]  # not listed: that would start TensorFlow
    if current is not None and len(current) == n:
        return names
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError as error:
        have = len(tf.config.list_logical_devices("CPU"))
        raise RuntimeError(
            f"kmirror.devices.simulate({n}) was called after TensorFlow initialised its devices "
            f"(it has {have} CPU device(s) now). Call kmirror.devices.simulate({n}) first, at the "
            "top of the script or notebook, before building any model or tensor."
        ) from error
    return names


def gpu_count() -> int:
    """How many physical GPUs this machine has; safe to call before `simulate`."""
    return len(tf.config.list_physical_devices("GPU"))


def gpus() -> list[str]:
    """Returns the names of the local logical GPU devices (empty without GPUs)."""
    return _names("GPU")


def local_devices(num_gpus: int | None = None) -> list[str]:
    """Returns the devices replicas run on by default: every local GPU, else every logical CPU.

    Args:
        num_gpus: use the first `num_gpus` GPUs; 0 means the CPU devices.
    """
    available = gpus()
    if num_gpus is None:
        return available or _names("CPU")
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 0:
        raise ValueError(f"num_gpus must be a whole number >= 0; got {num_gpus!r}.")
    if num_gpus == 0:
        return _names("CPU")
    if num_gpus > len(available):
        raise ValueError(
            f"num_gpus={num_gpus} asks for more GPUs than this machine has ({len(available)}). "
            f"Pass num_gpus <= {len(available)}, or num_gpus=0 to train on the CPU."
        )
    return available[:num_gpus]


def choose(devices: list[str] | None = None, num_gpus: int | None = None) -> list[str]:
    """Checks the devices a user asked for (by name or by GPU count); returns them canonically.

    Args:
        devices: device names such as `["/gpu:0", "/gpu:1"]`; default: `local_devices(num_gpus)`.
        num_gpus: the first `num_gpus` GPUs (0: the CPU devices); not together with `devices`.
    """
    if devices is not None and num_gpus is not None:
        raise ValueError(
            "pass either devices=[...] or num_gpus=N, not both: devices names the exact devices, "
            "num_gpus takes the first N GPUs."
        )
    if devices is None:
        return local_devices(num_gpus)
    if isinstance(devices, str) or not devices:
        raise ValueError(
            f"devices must be a non-empty list of device names such as ['/gpu:0', '/gpu:1']; "
            f"got {devices!r}."
        )
    names = [canonical(d) for d in devices]
    repeated = sorted({d for d in names if names.count(d) > 1})
    if repeated:
        raise ValueError(
            f"devices lists {', '.join(repeated)} more than once; give each device once "
            "(one replica per device)."
        )
    known = {canonical(d.name) for d in tf.config.list_logical_devices()}
    missing = [d for d, name in zip(devices, names) if name not in known]
    if missing:
        raise ValueError(
            f"devices {missing} do not exist here; available: {sorted(known)}. Without GPUs, "
            "call kmirror.devices.simulate(n) first to split the CPU into n devices."
        )
    return names


def _names(kind: str) -> list[str]:
    return [_short(d.name) for d in tf.config.list_logical_devices(kind)]


def _short(name: str) -> str:
    """'/job:localhost/replica:0/task:0/device:CPU:1' -> '/device:CPU:1'."""
    return "/" + name.rsplit("/", 1)[-1] if "/device:" in name else name


def canonical(name: str) -> str:
    """A device string in one spelling, so that '/cpu:1' and '/device:CPU:1' compare equal."""
    spec = tf.DeviceSpec.from_string(name)
    kind = (spec.device_type or "CPU").upper()
    return f"/device:{kind}:{spec.device_index or 0}"
