"""The main job: train a digit classifier with every reducer that runs here, beside one device.

Uses scikit-learn's bundled digits data (1797 8x8 images, nothing is downloaded). Without GPUs the
host CPU is split into 2 logical devices. The in-process reducers train in this process; `horovod`
and `ring` train in a job of 2 processes, each with one device, started by `kmirror.launch`.
Prints one row per run: the reducer, the replica count, the final loss and accuracy, the training
speed, and how far the weights ended from the single-device run (the equivalence kmirror
promises: ~1e-6 after 5 epochs of Adam, float rounding).

    python examples/demo.py [--devices 2] [--epochs 5] [--batch-size 128]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits as digits_data  # noqa: E402

import kmirror  # noqa: E402

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3"}  # the job's processes print no TensorFlow log lines


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="the global batch")
    return parser.parse_args()


def load_digits():
    digits = digits_data()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_model():
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class Throughput(keras.callbacks.Callback):
    """Samples per second over every epoch after the first (which includes tracing)."""

    def __init__(self, samples):
        super().__init__()
        self.samples = samples
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.start)

    @property
    def samples_per_second(self):
        timed = self.times[1:] or self.times
        return self.samples * len(timed) / sum(timed)


def train(reducer: str, fit_args: dict, baseline: list | None = None) -> tuple:
    """Trains the classifier wrapped with `reducer`: (name, replicas, test loss, test accuracy,
    samples per second, max |w - w_single| when `baseline` is given)."""
    (x, y), (x_test, y_test) = load_digits()
    model = kmirror.wrap(build_model(), reducer=reducer)
    speed = Throughput(len(x))
    model.fit(x, y, callbacks=[speed], **fit_args)
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    weights = model.get_weights()
    difference = None if baseline is None else _difference(weights, baseline)
    name = f"auto -> {model.reducer}" if reducer == "auto" else reducer
    return name, model.num_replicas, loss, accuracy, speed.samples_per_second, difference, weights


def _difference(weights: list, baseline: list) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(weights, baseline))


def main():
    args = parse_args()
    if not kmirror.devices.gpu_count():
        kmirror.devices.simulate(args.devices)
    (x, y), (x_test, y_test) = load_digits()
    fit_args = dict(batch_size=args.batch_size, epochs=args.epochs, shuffle=False, verbose=0)

    rows = []
    baseline = build_model()
    speed = Throughput(len(x))
    baseline.fit(x, y, callbacks=[speed], **fit_args)
    loss, accuracy = baseline.evaluate(x_test, y_test, verbose=0)
    rows.append(("single device", 1, loss, accuracy, speed.samples_per_second, 0.0))

    for reducer in ("one_device", "hierarchical_copy", "auto"):
        rows.append(train(reducer, fit_args, baseline.get_weights())[:6])
    # A job of 2 processes per reducer; the chief's (rank 0's) result.
    for reducer in ("horovod", "ring"):
        result = kmirror.launch.run(
            train, n=2, mode=reducer, timeout=300, args=(reducer, fit_args), env=QUIET
        )
        name, replicas, loss, accuracy, speed, _, weights = result[0]
        difference = _difference(weights, baseline.get_weights())
        rows.append((f"{name} (2 processes)", replicas, loss, accuracy, speed, difference))

    print(
        f"\ndigits: {len(x)} training / {len(x_test)} test samples, global batch "
        f"{args.batch_size}, {args.epochs} epochs; loss and accuracy on the test set\n"
    )
    header = ("reducer", "replicas", "loss", "accuracy", "samples/s", "max |w - w_single|")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for name, replicas, loss, accuracy, speed, difference in rows:
        print(
            f"| {name} | {replicas} | {loss:.4f} | {accuracy:.4f} | {speed:,.0f} | "
            f"{difference:.1e} |"
        )


if __name__ == "__main__":
    main()
