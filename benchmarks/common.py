"""Shared pieces of the benchmarks: the model, the data, timing and the results file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("results.json")


def model_and_data(samples: int, width: int = 512, depth: int = 2, seed: int = 0):
    import keras
    import numpy as np

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((784,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers += [keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 784)).astype("float32")
    y = rng.integers(0, 10, size=samples)
    return model, x, y


def compile_model(model):
    import keras

    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def seconds_per_step(model, x, y, batch_size: int) -> float:
    steps = len(x) // batch_size
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return (time.perf_counter() - start) / steps


def interleaved(candidates: dict, rounds: int) -> dict[str, float]:
    """Median seconds per step of each candidate, timed in turn, round after round."""
    times = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, run in candidates.items():
            times[name].append(run())
    return {name: statistics.median(values) for name, values in times.items()}


def peak_memory_mib() -> float:
    """This process's peak resident memory. VmHWM, unlike ru_maxrss, starts afresh at exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def machine() -> dict:
    import tensorflow as tf

    return {
        "cpus": os.cpu_count(),
        "gpus": len(tf.config.list_physical_devices("GPU")),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "platform": platform.platform(),
    }


def update_results(section: str, values) -> None:
    """Writes one section of benchmarks/results.json, keeping the others."""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[section] = values
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
