"""A token model with large logits: kmirror against native MirroredStrategy on the same devices.

The model predicts one of 4000 classes for each of 64 positions (batch 32: 32 x 64 x 4000 logits,
33 MB per batch) with accuracy as its metric. kmirror updates that metric from the replicas'
summed metric states, so no logit leaves its device; a step that gathered the predictions would
copy every logit to one device each step.

Time: both fit in one process on the same simulated devices, interleaved rounds, medians.
Peak memory: each side trains in its own child process (same data, same steps) and reports its
peak resident memory, which varies by tens of MiB from run to run; children of the two sides
alternate, `--memory-runs` each, and the ratio is of the medians.

Writes `"large_output": {"time": r, "peak_memory": r, ...}` to benchmarks/results.json.

    python benchmarks/bench_large_output.py [--devices 2] [--rounds 5] [--batches 8]
        [--memory-runs 3]
"""

from __future__ import annotations

import argparse
import os
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


def child(side: str, devices: int, batches: int) -> None:
    """Trains one side for 3 epochs and prints its peak memory (MiB) as JSON."""
    import kmirror

    simulated = kmirror.devices.simulate(devices)
    model = build(side, simulated)
    x, y = token_data(batches)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    common.print_peak_memory()


def peak_of(side: str, devices: int, batches: int) -> float:
    arguments = ["--child", side, "--devices", str(devices), "--batches", str(batches)]
    return common.peak_memory_of(__file__, arguments, timeout=900)


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

    peaks = common.interleaved(
        {side: (lambda s=side: peak_of(s, args.devices, args.batches)) for side in SIDES},
        rounds=args.memory_runs,
    )

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
        "peak_memory": round(peaks["kmirror"] / peaks["native"], 4),
        "kmirror_ms_per_step": round(1e3 * medians["kmirror"], 2),
        "native_ms_per_step": round(1e3 * medians["native"], 2),
        "kmirror_peak_mib": round(peaks["kmirror"], 1),
        "native_peak_mib": round(peaks["native"], 1),
        "logits_per_batch": [BATCH, LENGTH, CLASSES],
        "replicas": args.devices,
        "machine": common.machine(),
    }
    print(result)
    common.update_results("large_output", result)
    print(f"wrote {common.RESULTS}")


if __name__ == "__main__":
    main()
