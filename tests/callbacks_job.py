"""A training job for the callback tests, in one process or as a Horovod rank.

    python callbacks_job.py MODE OUT REDUCER           (REDUCER one_device: 2 simulated devices)
    python -m kmirror.launch -n 2 callbacks_job.py MODE OUT horovod
    python -m kmirror.launch --workers 2 callbacks_job.py MODE OUT ring

MODE "callbacks": checkpoints and TensorBoard into OUT/<kind><rank>, and an early-stopped run.
MODE "backup": 5 epochs with BackupAndRestore(OUT/backup); with KMIRROR_TEST_CRASH=<rank> that
rank kills itself in the middle of epoch 4, unless OUT/crashed exists (the relaunch).
Results go to OUT/<mode>-rank<r>.pkl.
"""

import os
import pickle
import signal
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kmirror  # noqa: E402

mode, out, reducer = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
if reducer == "ring":
    kmirror.cluster.connect()
elif reducer != "horovod":
    kmirror.devices.simulate(2)

import keras  # noqa: E402
from models import BATCH, dense_data, dense_model  # noqa: E402

rank = kmirror.launch._rank()
x, y = dense_data()
xv, yv = dense_data(n=40, seed=5)


def make():
    return kmirror.wrap(dense_model("sgd", seed=1 + 10 * rank), reducer=reducer)


def fit(model, epochs, callbacks, **kwargs):
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=callbacks,
        **kwargs,
    ).history


class CrashMidEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 3 and batch == 1:
            (out / "crashed").touch()
            os.kill(os.getpid(), signal.SIGKILL)


results = {}
if mode == "callbacks":
    model = make()
    checkpoints, board = out / f"checkpoints{rank}", out / f"tensorboard{rank}"
    callbacks = [
        kmirror.callbacks.ChiefCheckpoint(checkpoints / "ckpt_{epoch:02d}.keras"),
        kmirror.callbacks.ChiefCheckpoint(checkpoints / "best.keras", save_best_only=True),
        kmirror.callbacks.ChiefCheckpoint(checkpoints / "last.weights.h5", save_weights_only=True),
        kmirror.callbacks.ChiefTensorBoard(board),
    ]
    results["history"] = fit(model, 4, callbacks)
    results["weights"] = model.get_weights()
    results["samples_seen"] = model.samples_seen
    stopped = fit(make(), 30, [keras.callbacks.EarlyStopping(patience=1, min_delta=0.05)])
    results["early_stopped_epochs"] = len(stopped["loss"])
elif mode == "backup":
    callbacks = [kmirror.callbacks.BackupAndRestore(out / "backup")]
    if os.environ.get("KMIRROR_TEST_CRASH") == str(rank) and not (out / "crashed").exists():
        callbacks.append(CrashMidEpoch())
    model = make()
    results["history"] = fit(model, 5, callbacks)
    results["weights"] = model.get_weights()
    results["optimizer"] = [v.numpy() for v in model.optimizer.variables]

with open(out / f"{mode}-rank{rank}.pkl", "wb") as f:
    pickle.dump(results, f)
