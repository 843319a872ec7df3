"""Checkpoints, TensorBoard summaries, and resuming after a crash, on the digits data.

    python examples/checkpoint_resume.py --out runs/digits --crash-at-epoch 3   # dies in epoch 3
    python examples/checkpoint_resume.py --out runs/digits                      # resumes there
    python -m kmirror.launch -n 2 examples/checkpoint_resume.py --reducer horovod --out runs/hvd

The chief writes `best.keras` (the epoch with the lowest validation loss), TensorBoard event files
under `logs/`, and a backup after every epoch; a relaunch after a crash continues from the last
completed epoch. `tensorboard --logdir <out>/logs` shows the curves.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import kmirror  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/digits", help="folder for checkpoints and logs")
    parser.add_argument("--reducer", default="auto")
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--crash-at-epoch", type=int, default=None, help="simulate a crash")
    return parser.parse_args()


def main():
    args = parse_args()
    if args.reducer != "horovod" and not kmirror.devices.gpu_count():
        kmirror.devices.simulate(args.devices)
    import keras
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    split = int(0.8 * len(x))
    out = Path(args.out)

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model = kmirror.wrap(model, reducer=args.reducer)

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.epoch + 1 == args.crash_at_epoch and batch == 2:
                print(f"simulating a crash in epoch {args.crash_at_epoch}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    callbacks = [
        kmirror.callbacks.ChiefCheckpoint(out / "best.keras", save_best_only=True),
        kmirror.callbacks.ChiefTensorBoard(out / "logs"),
        kmirror.callbacks.BackupAndRestore(out / "backup"),
    ]
    if args.crash_at_epoch:
        callbacks.append(Crash())
    history = model.fit(
        x[:split],
        y[:split],
        batch_size=128,
        epochs=args.epochs,
        shuffle=False,
        validation_data=(x[split:], y[split:]),
        callbacks=callbacks,
        verbose=2,
    )
    if model.is_chief:
        best = keras.models.load_model(out / "best.keras")
        loss, accuracy = best.evaluate(x[split:], y[split:], verbose=0)
        print(f"trained epochs {history.epoch[0] + 1}..{history.epoch[-1] + 1} of {args.epochs}")
        print(f"best checkpoint: validation loss {loss:.4f}, accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
