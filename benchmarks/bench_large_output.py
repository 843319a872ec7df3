"""A token model with large logits: kmirror against native MirroredStrategy on the same devices.

The model predicts one of 4000 classes for each of 64 positions (batch 32: 32 x 64 x 4000 logits,
33 MB per batch) with accuracy as its metric. kmirror updates that metric from the replicas'
summed metric states, so no logit leaves its device; a step that gathered the predictions would
copy every logit to one device each step.

Time: both fit in one process on the same simulated devices, interleaved rounds, medians.
Peak memory: each side trains in its own child process (same data, same steps); children of the
two sides alternate, `--memory-runs` each, and each ratio is of the medians. Three figures:

- `peak_memory`: the peak of the memory TensorFlow's allocator held for tensors, as
  `tf.config.experimental.get_memory_info` reports it (on GPUs, the device memory). The CPU
  children use TensorFlow's own allocator for this (`TF_CPU_ALLOCATOR_USE_BFC=true`).
- `peak_rss`: the same children's peak resident memory: tensors, graphs and Python together.
- `peak_rss_malloc`: peak resident memory with the C library's malloc, TensorFlow's CPU default.
  glibc keeps freed blocks in per-thread arenas, so this figure depends on which threads happen to
  allocate and free the 16 MB logit buffers, and varies by tens of MiB between runs.

Writes `"large_output": {"time": r, "peak_memory": r, "peak_rss": r, ...}` to
benchmarks/results.json.

    python benchmarks/bench_large_output.py [--devices 2] [--rounds 5] [--batches 8]
        [--memory-runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

BATCH, LENGTH, CLASSES, WIDTH = 32, 64, 4000, 64
SIDES = ("kmirror", "native")


def token_model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((LENGTH,), dtype="int32"),
            keras.layers.Embedding(CLASSES, WIDTH),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def token_data(batches: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, CLASSES, size=(batches * BATCH, LENGTH)).astype("int32")
    return x, np.roll(x, -1, axis=1)


def build(side: str, devices):
    import tensorflow as tf

    import kmirror

    if side == "kmirror":
        return kmirror.wrap(token_model(), reducer="hierarchical_copy", devices=devices)
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.HierarchicalCopyAllReduce()
    )
    with strategy.scope():
        return token_model()


ALLOCATORS = {"tf": {"TF_CPU_ALLOCATOR_USE_BFC": "true"}, "malloc": {}}


def child(side: str, devices: int, batches: int) -> None:
    """Trains one side for 3 epochs and prints its peak memory (MiB) as JSON."""
    import kmirror

    simulated = kmirror.devices.simulate(devices)
    model = build(side, simulated)
    x, y = token_data(batches)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "true":
        common.print_peak_memory(tensor_peak_mib=common.tensor_peak_mib(simulated))
    else:
        common.print_peak_memory()


def measured(side: str, allocator: str, devices: int, batches: int) -> dict[str, float]:
    arguments = ["--child", side, "--devices", str(devices), "--batches", str(batches)]
    return common.measured_in_child(__file__, arguments, timeout=900, env=ALLOCATORS[allocator])


def peaks(devices: int, batches: int, runs: int) -> dict[str, dict[str, float]]:
    """Median peaks (MiB) of each side: `tensors` and `rss` under TensorFlow's allocator,
    `rss_malloc` under malloc; the sides' children alternate."""
    runs_of = {(side, allocator): [] for allocator in ALLOCATORS for side in SIDES}
    for _ in range(runs):
        for side, allocator in runs_of:
            runs_of[side, allocator].append(measured(side, allocator, devices, batches))

    def median(side, allocator, key):
        return statistics.median(run[key] for run in runs_of[side, allocator])

    return {
        side: {
            "tensors": median(side, "tf", "tensor_peak_mib"),
            "rss": median(side, "tf", "peak_mib"),
            "rss_malloc": median(side, "malloc", "peak_mib"),
        }
        for side in SIDES
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--memory-runs", type=int, default=3)
    parser.add_argument("--child", choices=["kmirror", "native"])
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.devices, args.batches)

    memory = peaks(args.devices, args.batches, args.memory_runs)

    import kmirror

    devices = kmirror.devices.simulate(args.devices)
    x, y = token_data(args.batches)
    sides = {side: build(side, devices) for side in SIDES}
    for model in sides.values():  # warm-up: tracing
        common.seconds_per_step(model, x, y, BATCH)
    medians = common.interleaved(
        {side: (lambda m=m: common.seconds_per_step(m, x, y, BATCH)) for side, m in sides.items()},
        rounds=args.rounds,
    )
    result = {
        "time": round(medians["kmirror"] / medians["native"], 4),
        "peak_memory": ratio(memory, "tensors"),
        "peak_rss": ratio(memory, "rss"),
        "peak_rss_malloc": ratio(memory, "rss_malloc"),
        "kmirror_ms_per_step": round(1e3 * medians["kmirror"], 2),
        "native_ms_per_step": round(1e3 * medians["native"], 2),
        **{
            f"{side}_{kind}_peak_mib": round(memory[side][kind], 1)
            for side in SIDES
            for kind in ("tensors", "rss", "rss_malloc")
        },
        "logits_per_batch": [BATCH, LENGTH, CLASSES],
        "replicas": args.devices,
        "machine": common.machine(),
    }
    print(result)
    common.update_results("large_output", result)
    print(f"wrote {common.RESULTS}")


def ratio(memory: dict, kind: str) -> float:
    return round(memory["kmirror"][kind] / memory["native"][kind], 4)


if __name__ == "__main__":
    main()
