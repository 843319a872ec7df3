"""Train the digits classifier with Horovod: one process per device, started by the launcher.

    python -m kmirror.launch -n 2 examples/horovod_digits.py [--epochs 5] [--batch-size 128]
    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_digits.py

Every process builds its own model (here with a different seed, to show that rank 0's weights
win at the start of fit), reads the same data and takes its half of every global batch. Only the
chief (rank 0) prints progress and results; every rank ends with the same weights.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import kmirror  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="the global batch")
    args = parser.parse_args()

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    split = int(0.8 * len(x))

    keras.utils.set_random_seed(int(os.environ.get("HOROVOD_RANK", "0")))
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model = kmirror.wrap(model, reducer="horovod")
    model.fit(
        x[:split],
        y[:split],
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x[split:], y[split:]),
        verbose=2 if model.is_chief else 0,
    )
    loss, accuracy = model.evaluate(x[split:], y[split:], verbose=0)
    checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
    print(
        f"rank {os.environ.get('HOROVOD_RANK', '0')} of {model.num_replicas}: test loss "
        f"{loss:.4f}, accuracy {accuracy:.4f}, weight checksum {checksum:.6f}"
    )


if __name__ == "__main__":
    main()
