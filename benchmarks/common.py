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


def many_small_layers(samples: int, layers: int = 100, units: int = 64, seed: int = 0):
    """A model of `layers` Dense layers of `units` units: many small gradients, where packing them
    together before the all-reduce matters most."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(seed)
    stack = [keras.Input((units,))]
    stack += [keras.layers.Dense(units, activation="relu") for _ in range(layers)]
    stack += [keras.layers.Dense(10)]
    model = keras.Sequential(stack)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, units)).astype("float32")
    y = rng.integers(0, 10, size=samples)
    return model, x, y


def digits():
    """scikit-learn's bundled digits, scaled to [0, 1]: real data, nothing downloaded."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype("float32"), data.target.astype("int64")


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


def print_peak_memory() -> None:
    """In a child process: prints its peak resident memory for `peak_memory_of`."""
    print(json.dumps({"peak_mib": peak_memory_mib()}))


def peak_memory_of(script: str, arguments: list[str], timeout: float) -> float:
    """Runs `script` with `arguments` in a fresh process (it ends with `print_peak_memory`) and
    returns that process's peak resident memory in MiB."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, script, *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]


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


def run_job(
    script: str, arguments: list[str], n: int = 2, mode: str = "horovod", one_core: bool = True
):
    """Runs `script --child OUT arguments...` as an `n`-process job; returns the JSON written to
    OUT (by the chief). With `one_core`, each process uses one thread, as one core each."""
    import sys
    import tempfile

    import kmirror.launch

    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out.json")
        command = [sys.executable, script, "--child", out, *arguments]
        env = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"} if one_core else {}
        with open(os.devnull, "w") as quiet:
            code = kmirror.launch.launch(
                command, n=n, mode=mode, timeout=900, env=env, output=quiet
            )
        if code != 0:
            name = os.path.basename(script)
            raise SystemExit(f"the {name} job of {n} processes failed with exit code {code}")
        with open(out) as f:
            return json.load(f)


def record_overhead(reducer: str, medians: dict[str, float], baseline: str, **facts) -> float:
    """Adds `reducer`'s kmirror / baseline ratio to "wrapper_overhead", with its timings."""
    ratio = round(medians["kmirror"] / medians[baseline], 4)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    update_results("wrapper_overhead", {**results.get("wrapper_overhead", {}), reducer: ratio})
    details = results.get("wrapper_overhead_details", {})
    details[reducer] = {
        **facts,
        **{f"{side}_ms_per_step": round(1e3 * t, 3) for side, t in medians.items()},
    }
    update_results("wrapper_overhead_details", details)
    print(f"{reducer}: time x{ratio:.3f}  {details[reducer]}")
    return ratio
