"""The processes of a training job: which one this is, and what they settle together around the
steps.

A reducer (`kmirror.reducers.Reducer`) lays out the replicas and sums inside each step. Its job
(`Reducer.job`) is the rest of what the processes do together: which process this is and whether
it is the chief, giving every process the chief's variables, exchanging a count, seeding their
random generators alike, and turning a lost peer's low-level error into
`kmirror.errors.PeerLost`. In one process all of it is trivial (`Job`); TensorFlow's collective
reducers and Horovod bring their own (`kmirror.reducers.collective.CollectiveJob`,
`kmirror.reducers.horovod.HorovodJob`).

Example:

```python
import keras, kmirror
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss="mse")
reducer = kmirror.reducers.HierarchicalCopy()
wrapped = kmirror.wrap(model, reducer=reducer)
job = reducer.job                 # the job of the reducer wrap bound
if job.is_chief:
    print(f"process {job.process_index} of {job.num_processes}")   # process 0 of 1
```
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from kmirror._core import tf_hooks

__all__ = ["Job"]


class Job:
    """The processes of one training job; the base class is a job of one process.

    Subclass it for a reducer that spans processes, and return it from the reducer's `make_job`.
    A job of several processes says which process this is and how many there are
    (`num_processes`, `process_index`), and how they exchange: the chief's variables
    (`broadcast`), a count from each (`gather_counts`), one seed (`agree_on_seed`); `failures`
    names a lost peer. `is_chief`, `seed_once` and `traced_for` follow from those. A subclass
    that overrides any of the first five overrides all five (the one-process answers of the
    others would silently keep each process to itself); else defining it raises a TypeError.
    """

    #: What a job of several processes must say, together.
    MULTI_PROCESS = ("num_processes", "process_index", "broadcast", "gather_counts")
    MULTI_PROCESS += ("agree_on_seed",)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        said = [name for name in Job.MULTI_PROCESS if getattr(cls, name) is not vars(Job)[name]]
        missing = [name for name in Job.MULTI_PROCESS if name not in said]
        if said and missing:
            raise TypeError(
                f"{cls.__name__} overrides {', '.join(said)} but not {', '.join(missing)}: a job "
                "of several processes says all of num_processes, process_index, broadcast, "
                "gather_counts and agree_on_seed (kmirror.reducers.Job)."
            )

    @property
    def num_processes(self) -> int:
        """Processes in the job, each holding the same number of replicas."""
        return 1

    @property
    def process_index(self) -> int:
        """This process's place among them: its replicas follow those of processes before it."""
        return 0

    @property
    def is_chief(self) -> bool:
        """True in exactly one process of the job: process 0, which writes checkpoints and
        summaries (`kmirror.cluster.is_chief` follows the same rule)."""
        return self.process_index == 0

    def broadcast(self, variables: list) -> None:
        """Gives every process the chief's values of `variables` (no-op within one process)."""

    def gather_counts(self, count: int) -> list[int]:
        """Every process's `count`, in process order, read on the host (`[count]` within one
        process)."""
        return [count]

    def agree_on_seed(self) -> None:
        """Seeds every process's random generators alike, so that they shuffle data alike
        (no-op within one process)."""

    def seed_once(self) -> None:
        """The first time it is asked, `agree_on_seed` unless the processes' random generators
        already stand alike (the script seeded every process alike): then they keep drawing what
        one device draws, whatever their number, so a backup resumes alike on any number of
        processes. From then on the processes draw the same numbers (seeding again would clear
        TensorFlow's kernel caches: the step is rebuilt)."""
        if getattr(self, "_seeded", False):
            return
        if self.num_processes > 1:
            states = set(self.gather_counts(_random_states()))
            if len(states) > 1 or -1 in states:
                self.agree_on_seed()
        self._seeded = True

    def traced_for(self, variables: list, send: Callable[[], None]) -> Callable[[], None]:
        """`send` (which sends `variables`) as a `tf.function`, traced once per set of variables:
        sending the same variables again (every `fit`) reuses the trace of the first `send`."""
        key = tuple(id(v) for v in variables)
        if getattr(self, "_traced_key", None) != key:
            self._traced_key, self._traced = key, tf.function(send, autograph=False)
        return self._traced

    def failures(self) -> contextlib.AbstractContextManager:
        """A context that turns a lost peer's low-level error into `kmirror.errors.PeerLost`."""
        return contextlib.nullcontext()


def _random_states() -> int:
    """A fingerprint of the random generators a training draws from: Python's, numpy's and
    TensorFlow's (-1 when TensorFlow has no global seed, as differs between processes)."""
    tf_state = tf_hooks.seed_state()
    if tf_state is None:
        return -1
    numpy_state = np.random.get_state()
    text = repr((random.getstate(), numpy_state[1].tolist(), numpy_state[2:], tf_state))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
