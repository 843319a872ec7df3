"""Who am I in the job: whether this process is the chief, the one that writes files.

In every mode exactly one process is the chief: the only process in one-process training, rank 0
under Horovod, the `chief` task (else worker 0) of a multi-worker `TF_CONFIG`.

Example:

```python
import kmirror
kmirror.cluster.connect()           # joins TF_CONFIG's cluster, if any; first in the script
if kmirror.cluster.is_chief():
    print("this process writes the checkpoints")
```
"""

from kmirror._core.cluster import Cluster, connect, connected, describe, is_chief, joined, process

__all__ = ["is_chief", "process", "connect", "connected", "joined", "describe", "Cluster"]
