"""Test set-up: split the host CPU into 7 logical devices before TensorFlow initialises.

Tests pick 1 to 7 of them with `devices=cpus(n)`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import kmirror  # noqa: E402

MAX_DEVICES = 7
kmirror.devices.simulate(MAX_DEVICES)


def cpus(n: int) -> list[str]:
    """The first n simulated CPU devices."""
    return [f"/device:CPU:{i}" for i in range(n)]
