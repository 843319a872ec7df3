"""A training job for the callback tests, in one process or as a Horovod rank.

    python callbacks_job.py MODE OUT REDUCER           (REDUCER one_device: 2 simulated devices)
    python -m kmirror.launch -n 2 callbacks_job.py MODE OUT horovod
    python -m kmirror.launch --workers 2 callbacks_job.py MODE OUT ring

MODE "callbacks": checkpoints and TensorBoard into OUT/<kind><rank>, an early-stopped run, and
Keras' own file-writing callbacks, every process writing into OUT/keras. The first run is tracked
as a script does it in every process: an MLflow run opened in every process (file store
OUT/mlruns/callbacks) with MLflow's callback, a W&B run (offline, OUT/wandb<rank>) with
`WandbMetricsLogger`, and a callback of the script's own appending each epoch's logs to
OUT/epochs.jsonl, given to `kmirror.callbacks.chief_only`. The early-stopped run is logged by
`mlflow.tensorflow.autolog()` (file store OUT/mlruns/autolog); the run with Keras' own callbacks
by MLflow's callback, its run opened on the chief alone (file store OUT/mlruns/chief).
MODE "backup": 5 epochs of 4 shuffled batches (numpy arrays; KMIRROR_TEST_ROWS=1: a RowDataset,
each process loading its rows, in the order Python's random draws) with
BackupAndRestore(OUT/backup<rank>, save_freq=2): each process has its own folder, as without a
shared filesystem. Every process seeds alike after building its model (the processes draw what
one device draws). With KMIRROR_TEST_KILL=<rank> that rank kills itself after batch 2 of epoch 4
(once: OUT/killed marks it), first marking its host down in KMIRROR_TEST_DOWN (a folder the test's
ssh reads); with KMIRROR_TEST_TERM=<rank> that rank sends itself SIGTERM after batch 2 of epoch 3
(once: OUT/termed; KMIRROR_PREEMPTION_CHECK_SECONDS past the end of training leaves the signal
pending at the last step). With KMIRROR_TEST_KERAS_BACKUP=1 the callback is Keras' own
BackupAndRestore, with the same arguments. Each process prints its rank, the job's size and its
host. Results go to OUT/backup-rank<r>.pkl, written after `fit` (with the batches it trained).
"""

import contextlib
import functools
import json
import os
import pickle
import signal
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kmirror  # noqa: E402

mode, out, reducer = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
if mode == "backup":  # the "callbacks" mode's trackers import pandas
    import lean_start  # noqa: F401 - before Keras
if reducer == "ring":
    kmirror.cluster.connect()
elif reducer != "horovod":
    kmirror.devices.simulate(2)

import keras  # noqa: E402
import trackers  # noqa: E402, F401 - the trackers' local stores alone: nothing reaches a network
from models import BATCH, KERAS_EPOCHS, Rows, dense_data, dense_model, keras_callbacks  # noqa: E402

rank = kmirror.cluster.process()[0]
x, y = dense_data()
xv, yv = dense_data(n=40, seed=5)


def make(optimizer="sgd"):
    return kmirror.wrap(dense_model(optimizer, seed=1 + 10 * rank), reducer=reducer)


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


class Epochs(keras.callbacks.Callback):
    """Appends each epoch's logs to a file, as a line of JSON: a callback that writes."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        with open(self.path, "a") as f:
            f.write(json.dumps({key: float(value) for key, value in logs.items()}) + "\n")


def tracked_fit(model, epochs, callbacks):
    """`fit`, tracked by MLflow, W&B and a callback of the script's own, in every process."""
    import mlflow
    import wandb
    from wandb.integration.keras import WandbMetricsLogger

    mlflow.set_tracking_uri((out / "mlruns" / "callbacks").as_uri())
    run = wandb.init(project="kmirror", dir=out / f"wandb{rank}", mode="offline")
    mine = kmirror.callbacks.chief_only(Epochs(out / "epochs.jsonl"))
    with mlflow.start_run():
        tracked = [mlflow.keras.MlflowCallback(), WandbMetricsLogger(), mine]
        history = fit(model, epochs, callbacks + tracked)
    run.finish()
    return history


def chief_run_fit(model, epochs, callbacks):
    """`fit` with MLflow's callback in every process, its run opened on the chief alone."""
    import mlflow

    mlflow.set_tracking_uri((out / "mlruns" / "chief").as_uri())
    with mlflow.start_run() if kmirror.cluster.is_chief() else contextlib.nullcontext():
        return fit(model, epochs, [*callbacks, mlflow.keras.MlflowCallback()])


def autologged_fit(model, epochs, callbacks):
    """`fit` with MLflow's autologging on, in every process."""
    import mlflow

    mlflow.set_tracking_uri((out / "mlruns" / "autolog").as_uri())
    mlflow.tensorflow.autolog(log_models=False)  # its checkpoints each epoch, not the model
    try:
        return fit(model, epochs, callbacks)
    finally:
        mlflow.tensorflow.autolog(disable=True)


class Batches(keras.callbacks.Callback):
    """Counts the batches `fit` trains."""

    count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


class Fault(keras.callbacks.Callback):
    """After batch `batch` of epoch `epoch` (0-based), once (the marker): `fault()`."""

    def __init__(self, at, marker, fault):
        super().__init__()
        self.at, self.marker, self.fault = at, marker, fault

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at and not self.marker.exists():
            self.marker.touch()
            self.fault()


def host():
    if reducer == "horovod":
        return os.environ.get("HOROVOD_HOSTNAME", "localhost")
    config = json.loads(os.environ["TF_CONFIG"])
    return config["cluster"]["worker"][config["task"]["index"]].split(":")[0]


def killed():
    if os.environ.get("KMIRROR_TEST_DOWN"):
        Path(os.environ["KMIRROR_TEST_DOWN"], host()).touch()
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
    results["history"] = tracked_fit(model, 4, callbacks)
    results["weights"] = model.get_weights()
    results["samples_seen"] = model.samples_seen
    stopped = autologged_fit(
        make(), 30, [keras.callbacks.EarlyStopping(patience=1, min_delta=0.05)]
    )
    results["early_stopped_epochs"] = len(stopped["loss"])
    # Keras' own callbacks, every process given the same folder; an MLflow run opened on the
    # chief alone, as docs/callbacks.md shows.
    results["keras history"] = chief_run_fit(make(), KERAS_EPOCHS, keras_callbacks(out / "keras"))
elif mode == "backup":
    size = kmirror.cluster.process()[1]
    print(f"rank {rank} of {size} on {host()}", flush=True)
    model = make("adam")
    keras.utils.set_random_seed(7)  # every process alike: they draw what one device draws
    faults = []
    if os.environ.get("KMIRROR_TEST_KILL") == str(rank):
        faults.append(Fault((3, 2), out / "killed", killed))
    if os.environ.get("KMIRROR_TEST_TERM") == str(rank):
        term = functools.partial(os.kill, os.getpid(), signal.SIGTERM)
        faults.append(Fault((2, 2), out / "termed", term))
    # KMIRROR_TEST_KERAS_BACKUP=1: Keras' own callback, which kmirror runs as its own.
    keras_own = os.environ.get("KMIRROR_TEST_KERAS_BACKUP") == "1"
    backup_class = (
        keras.callbacks.BackupAndRestore if keras_own else kmirror.callbacks.BackupAndRestore
    )
    backup = backup_class(out / f"backup{rank}", save_freq=2)
    batches = Batches()
    history = fit(
        model,
        5,
        [backup, batches, *faults],
        shuffle=True,
        rows=bool(os.environ.get("KMIRROR_TEST_ROWS")),
    )
    results = {
        "history": history,
        "weights": model.get_weights(),
        "optimizer": [v.numpy() for v in model.optimizer.variables],
        "processes": size,
        "batches": batches.count,
    }

with open(out / f"{mode}-rank{rank}.pkl", "wb") as f:
    pickle.dump(results, f)
