"""Values the test processes compute once for the whole run: a single-device reference that
tests in both `make test` processes compare with (the feature matrix in one, the Horovod and ring
jobs' features in the other) is trained by whichever asks first, and read by the other.

Under pytest-xdist the processes share the run's temporary folder (`SHARED`, set by
tests/conftest.py); a lock on each value's file makes a second process wait for the first one's
result rather than compute it again. Outside xdist, values are computed in the process and kept
there.
"""

import fcntl
import os
import pickle
from collections.abc import Callable
from pathlib import Path

#: The environment variable naming the folder the test processes share.
SHARED = "KMIRROR_TESTS_SHARED"
_LOCAL: dict = {}


def shared(key: str, compute: Callable[[], object]):
    """`compute()`, computed once in the whole test run (a picklable value)."""
    if SHARED not in os.environ:
        if key not in _LOCAL:
            _LOCAL[key] = compute()
        return _LOCAL[key]
    folder = Path(os.environ[SHARED])
    path = folder / f"{key}.pkl"
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = compute()
        written = path.with_suffix(".part")
        written.write_bytes(pickle.dumps(value))
        written.replace(path)
        return value
