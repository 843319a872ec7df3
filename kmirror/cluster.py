"""Who am I in the job: whether this process is the chief, the one that writes files.

In every mode exactly one process is the chief: the only process in one-process training, rank 0
under Horovod, the `chief` task (else worker 0) of a multi-worker `TF_CONFIG`.
"""

from __future__ import annotations

import json
import os

__all__ = ["is_chief"]


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
    if "HOROVOD_RANK" in os.environ:
        return os.environ["HOROVOD_RANK"] == "0"
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = config.get("task") or {}
    if not task:
        return True
    if "chief" in config.get("cluster", {}):
        return task.get("type") == "chief"
    return task.get("type") == "worker" and int(task.get("index", 0)) == 0
