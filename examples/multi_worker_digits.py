"""Train the digits classifier on several workers with TensorFlow's collective ring.

    python -m kmirror.launch --workers 2 examples/multi_worker_digits.py [--epochs 5]

Every worker runs this same script with its own TF_CONFIG (the launcher writes one per worker on
loopback; on real machines see docs/multi-worker.md). `kmirror.cluster.connect()` comes first:
TensorFlow sets up its collective ops only at program start. Only the chief prints progress.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import kmirror  # noqa: E402

kmirror.cluster.connect()  # reads TF_CONFIG; without it, this is one process

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="the global batch")
    args = parser.parse_args()

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    split = int(0.8 * len(x))

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model = kmirror.wrap(model, reducer="ring")
    model.fit(
        x[:split],
        y[:split],
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x[split:], y[split:]),
        verbose=2,
    )
    loss, accuracy = model.evaluate(x[split:], y[split:], verbose=0)
    checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
    role = "chief" if model.is_chief else "worker"
    print(
        f"{role} of {model.num_replicas} replicas: test loss {loss:.4f}, accuracy "
        f"{accuracy:.4f}, weight checksum {checksum:.6f}"
    )


if __name__ == "__main__":
    main()
