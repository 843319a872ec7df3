"""Shared pieces of the benchmarks: the model, the data, timing and the results file."""

from __future__ import annotations

import argparse
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


def strategy_training(strategy, model, global_batch: int):
    """The training step of TensorFlow's custom-training-loop tutorial under `strategy` (the loss
    averaged over the global batch, `apply_gradients` in replica context), tracking loss and
    accuracy. `model` is compiled and built in `strategy.scope()`. Returns `epoch(data)`, which
    trains once over a distributed dataset."""
    import keras
    import tensorflow as tf

    with strategy.scope():
        mean_loss, accuracy = keras.metrics.Mean(), keras.metrics.SparseCategoricalAccuracy()
    per_sample = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    optimizer = model.optimizer

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            y_pred = model(xb, training=True)
            loss = tf.nn.compute_average_loss(
                per_sample(yb, y_pred), global_batch_size=global_batch
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        mean_loss.update_state(loss * strategy.num_replicas_in_sync)
        accuracy.update_state(yb, y_pred)

    @tf.function
    def step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    def epoch(data):
        for metric in (mean_loss, accuracy):
            metric.reset_state()
        for xb, yb in data:
            step(xb, yb)
        mean_loss.result(), accuracy.result()

    return epoch


def horovod_training(model, horovod: bool = True):
    """A training loop written by hand, the way Horovod's TensorFlow examples train: a
    `tf.function` step that averages the gradients over the ranks with `hvd.grouped_allreduce`
    (none without `horovod`: one process alone), tracking loss and accuracy, averaged over the
    ranks at the end of the epoch. `model` is compiled, with rank 0's weights. Returns
    `epoch(data)`, which trains once over this rank's batches."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    optimizer, loss_fn = model.optimizer, model.loss
    mean_loss, accuracy = keras.metrics.Mean(), keras.metrics.SparseCategoricalAccuracy()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            y_pred = model(xb, training=True)
            loss = loss_fn(yb, y_pred)
        grads = tape.gradient(loss, model.trainable_variables)
        if horovod:
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply(grads, model.trainable_variables)
        mean_loss.update_state(loss)
        accuracy.update_state(yb, y_pred)

    def epoch(data):
        for metric in (mean_loss, accuracy):
            metric.reset_state()
        for xb, yb in data:
            step(xb, yb)
        logs = tf.stack([mean_loss.result(), accuracy.result()])
        if horovod:
            hvd.allreduce(logs, op=hvd.Average)

    return epoch


def timed_epoch(epoch, steps: int):
    """`epoch` as a function returning its seconds per step (of `steps` per epoch)."""

    def run():
        start = time.perf_counter()
        epoch()
        return (time.perf_counter() - start) / steps

    return run


def interleaved(candidates: dict, rounds: int, warm_up: bool = False) -> dict[str, float]:
    """Median seconds per step of each candidate, timed in turn, round after round (after one
    untimed run of each with `warm_up`: tracing)."""
    if warm_up:
        for run in candidates.values():
            run()
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


def print_peak_memory(**measured: float) -> None:
    """In a child process: prints its peak resident memory, and whatever else it `measured`, for
    `peak_memory_of` and `measured_in_child`."""
    print(json.dumps({"peak_mib": peak_memory_mib(), **measured}))


def measured_in_child(
    script: str, arguments: list[str], timeout: float, env: dict | None = None
) -> dict[str, float]:
    """Runs `script` with `arguments` (and `env` added to the environment) in a fresh process,
    which ends with `print_peak_memory`, and returns what it printed."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, script, *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        env={**os.environ, **(env or {})},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_memory_of(script: str, arguments: list[str], timeout: float) -> float:
    """The peak resident memory (MiB) of a fresh process running `script` with `arguments`."""
    return measured_in_child(script, arguments, timeout)["peak_mib"]


def tensor_peak_mib(devices: list[str]) -> float:
    """The peak of the memory TensorFlow's allocators held for tensors on `devices` (MiB): the
    per-device figure `tf.config.experimental.get_memory_info` reports. Logical CPU devices share
    one host allocator, so CPUs count once; each GPU has its own. On CPUs this needs TensorFlow's
    own (BFC) allocator, `TF_CPU_ALLOCATOR_USE_BFC=true` before TensorFlow starts."""
    import tensorflow as tf

    specs = [tf.DeviceSpec.from_string(d) for d in devices]
    counted = {f"{s.device_type}:{s.device_index if s.device_type == 'GPU' else 0}" for s in specs}
    return sum(tf.config.experimental.get_memory_info(d)["peak"] for d in counted) / 2**20


def machine() -> dict:
    import tensorflow as tf

    return {
        "cpus": os.cpu_count(),
        "gpus": len(tf.config.list_physical_devices("GPU")),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "platform": platform.platform(),
    }


def write_from_chief(out: str, value, is_chief: bool) -> None:
    """In a job's child process: the chief writes `value` to `out` for `run_job`."""
    if is_chief:
        with open(out, "w") as f:
            json.dump(value, f)


def results() -> dict:
    """What benchmarks/results.json holds."""
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def update_results(section: str, values) -> None:
    """Writes one section of benchmarks/results.json, keeping the others."""
    found = results()
    found[section] = values
    RESULTS.write_text(json.dumps(found, indent=2, sort_keys=True) + "\n")


def options(doc: str, **defaults) -> argparse.Namespace:
    """A benchmark's command line: `--name value` for each of `defaults` (a list default takes
    several values), and the hidden `--child OUT` through which it starts its own processes."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, list):
            parser.add_argument(flag, type=type(default[0]), nargs="+", default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


def command_line(**values) -> list[str]:
    """`values` as the options of a benchmark's own processes (`--name value`, see `options`)."""
    line = []
    for name, value in values.items():
        line += [
            "--" + name.replace("_", "-"),
            *map(str, value if isinstance(value, list) else [value]),
        ]
    return line


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
