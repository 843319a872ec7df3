"""A training job for the callback tests, in one process or as a Horovod rank.

    python callbacks_job.py MODE OUT REDUCER           (REDUCER one_device: 2 simulated devices)
    python -m kmirror.launch -n 2 callbacks_job.py MODE OUT horovod
    python -m kmirror.launch --workers 2 callbacks_job.py MODE OUT ring

MODE "callbacks": checkpoints and TensorBoard into OUT/<kind><rank>, an early-stopped run, and
Keras' own file-writing callbacks, every process writing into OUT/keras.
MODE "backup": 5 epochs of 4 batches, numpy arrays in order, then a RowDataset shuffled (each
process loads its rows; Python's random draws the order), with
BackupAndRestore(OUT/backup<rank>, save_freq=2): each process has its own folder, as without a
shared filesystem; each first runs uninterrupted (whole-<scenario>, OUT/whole<rank>). With
KMIRROR_TEST_CRASH=<rank> that rank kills itself after batch 2 of epoch 4
(batches 0 and 1 are backed up) of each training, once (OUT/crashed-<scenario> marks it);
a training finished at an earlier launch is not run again.
Results go to OUT/<mode>-rank<r>.pkl (OUT/backup-<scenario>-rank<r>.pkl).
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
from models import BATCH, KERAS_EPOCHS, Rows, dense_data, dense_model, keras_callbacks  # noqa: E402

rank = kmirror.cluster.process()[0]
x, y = dense_data()
xv, yv = dense_data(n=40, seed=5)


def make():
    return kmirror.wrap(dense_model("sgd", seed=1 + 10 * rank), reducer=reducer)


def fit(model, epochs, callbacks, shuffle=False, rows=False, **kwargs):
    given = {"x": Rows(x, y)} if rows else {"x": x, "y": y, "batch_size": BATCH}
    return model.fit(
        **given,
        epochs=epochs,
        shuffle=shuffle,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=callbacks,
        **kwargs,
    ).history


class CrashMidEpoch(keras.callbacks.Callback):
    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 3 and batch == 2:
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


SCENARIOS = ("ordered", "rows")
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
    # Keras' own callbacks, every process given the same folder.
    results["keras history"] = fit(make(), KERAS_EPOCHS, keras_callbacks(out / "keras"))
elif mode == "backup":
    # First each scenario uninterrupted (whole-<scenario>, its own backup folder), then each
    # crashed and resumed.
    for scenario in [f"whole-{s}" for s in SCENARIOS] + list(SCENARIOS):
        done = out / f"backup-{scenario}-rank{rank}.pkl"
        if done.exists():  # finished at an earlier launch
            continue
        whole = scenario.startswith("whole-")
        folder = out / (f"whole{rank}" if whole else f"backup{rank}")
        backup = kmirror.callbacks.BackupAndRestore(folder, save_freq=2)
        crashed = out / f"crashed-{scenario}"
        crash = os.environ.get("KMIRROR_TEST_CRASH") == str(rank) and not crashed.exists()
        crash = crash and not whole
        model = make()
        keras.utils.set_random_seed(7)  # the processes agree on the shuffle seed drawn from it
        history = fit(
            model,
            5,
            [backup, *([CrashMidEpoch(crashed)] if crash else [])],
            shuffle=not scenario.endswith("ordered"),
            rows=scenario.endswith("rows"),
        )
        with open(done, "wb") as f:
            pickle.dump(
                {
                    "history": history,
                    "weights": model.get_weights(),
                    "optimizer": [v.numpy() for v in model.optimizer.variables],
                },
                f,
            )

if mode == "callbacks":
    with open(out / f"{mode}-rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)
