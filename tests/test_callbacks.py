"""Chief-only, atomic checkpoints and summaries, experiment trackers (MLflow, W&B) and callbacks
given to `chief_only` logging one run, and resuming after a crash, in one process (2 simulated
devices), under Horovod (2 ranks) and with 2 multi-worker workers."""

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import jobs
import keras
import numpy as np
import pytest
import tensorflow as tf
import trackers
from models import (
    BATCH,
    KERAS_EPOCHS,
    Rows,
    assert_same_history,
    dense_data,
    dense_model,
    keras_callbacks,
)

import kmirror
from kmirror._core.callbacks import keras_own

HERE = Path(__file__).parent
JOB = str(HERE / "callbacks_job.py")
TIMEOUT = 300
MODES = ["one_device", "horovod", "ring"]


def run_job(
    mode: str, out: Path, reducer: str, env=None, restarts=0, processes=2, options=()
) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    if reducer in ("horovod", "ring"):
        processes = ["-n" if reducer == "horovod" else "--workers", str(processes), *options]
        processes += ["--max-restarts", str(restarts), "--timeout", str(TIMEOUT)]
        command = [sys.executable, "-m", "kmirror.launch", *processes]
    else:
        command = [sys.executable]
    return jobs.run([*command, JOB, mode, str(out), reducer], TIMEOUT + 30, env)


def results(out: Path, mode: str, reducer: str) -> list[dict]:
    return jobs.rank_results(out, 1 if reducer == "one_device" else 2, f"{mode}-rank")


def callbacks_job(reducer: str, folder: str):
    done = run_job("callbacks", Path(folder), reducer)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return Path(folder), results(Path(folder), "callbacks", reducer)


@pytest.fixture(scope="module", params=MODES)
def job(request, tmp_path_factory):
    return (request.param, *callbacks_job(request.param, str(tmp_path_factory.mktemp("cb"))))


@functools.cache
def single_device_history():
    """The same training on one device, with Keras' own ModelCheckpoint picking the best epoch."""
    x, y = dense_data()
    xv, yv = dense_data(n=40, seed=5)
    model = dense_model("sgd")
    return model.fit(
        x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, validation_data=(xv, yv)
    ).history


def test_checkpoints_are_written_once_by_the_chief(job):
    reducer, out, _ = job
    expected = {f"ckpt_0{e}.keras" for e in range(1, 5)} | {"best.keras", "last.weights.h5"}
    assert {p.name for p in (out / "checkpoints0").iterdir()} == expected
    assert not (out / "checkpoints1").exists(), "a non-chief rank wrote checkpoints"


def test_best_checkpoint_is_the_single_device_best_and_reproduces_its_metrics(job):
    _, out, ranks = job
    reference = single_device_history()
    history = ranks[0]["history"]
    assert int(np.argmin(history["val_loss"])) == int(np.argmin(reference["val_loss"]))
    best = keras.models.load_model(out / "checkpoints0" / "best.keras")
    xv, yv = dense_data(n=40, seed=5)
    loss, accuracy = best.evaluate(xv, yv, verbose=0)
    best_epoch = int(np.argmin(history["val_loss"]))
    assert loss == pytest.approx(min(reference["val_loss"]), rel=1e-5)
    assert accuracy == pytest.approx(history["val_accuracy"][best_epoch])


def test_checkpoint_continues_with_its_optimizer_state(job):
    _, out, ranks = job
    last = keras.models.load_model(out / "checkpoints0" / "ckpt_04.keras")
    for a, b in zip(last.get_weights(), ranks[0]["weights"]):
        np.testing.assert_array_equal(a, b)
    wrapped = kmirror.wrap(last, devices=["/cpu:0", "/cpu:1"])
    assert int(wrapped.optimizer.iterations.numpy()) == 4 * 4
    plain = dense_model("sgd")
    plain.load_weights(out / "checkpoints0" / "last.weights.h5")
    for a, b in zip(plain.get_weights(), ranks[0]["weights"]):
        np.testing.assert_array_equal(a, b)


def scalars(folder: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag: [tf.make_ndarray(e.tensor_proto) for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
    }


def test_tensorboard_is_written_by_the_chief_with_kmirrors_scalars(job):
    reducer, out, ranks = job
    assert not (out / "tensorboard1").exists(), "a non-chief rank wrote event files"
    train = scalars(out / "tensorboard0" / "train")
    history = ranks[0]["history"]
    np.testing.assert_allclose([float(v) for v in train["epoch_loss"]], history["loss"], rtol=1e-6)
    assert [float(v) for v in train["epoch_replicas"]] == [2.0] * 4
    # Speeds are measured, so only their relation is checked: the samples of an epoch (101, in
    # 4 steps) over its seconds, against its seconds per step.
    speeds = [float(v) for v in train["epoch_samples_per_second"]]
    step_times = [float(v) for v in train["epoch_step_time"]]
    assert len(speeds) == len(step_times) == 4 and min(speeds) > 0
    np.testing.assert_allclose(np.multiply(speeds, step_times) * 4, 101, rtol=1e-4)
    assert train["reducer"][0].flatten()[0].decode() == reducer
    assert ranks[0]["samples_seen"] == 4 * 101
    validation = scalars(out / "tensorboard0" / "validation")
    np.testing.assert_allclose(
        [float(v) for v in validation["epoch_loss"]], history["val_loss"], rtol=1e-6
    )


@functools.cache
def single_device_early_stopped():
    x, y = dense_data()
    xv, yv = dense_data(n=40, seed=5)
    return (
        dense_model("sgd")
        .fit(
            x,
            y,
            batch_size=BATCH,
            epochs=30,
            shuffle=False,
            verbose=0,
            validation_data=(xv, yv),
            callbacks=[keras.callbacks.EarlyStopping(patience=1, min_delta=0.05)],
        )
        .history
    )


def test_early_stopping_stops_every_rank_at_the_single_device_epoch(job):
    _, _, ranks = job
    epochs = [r["early_stopped_epochs"] for r in ranks]
    assert 1 < epochs[0] < 30
    assert epochs == [len(single_device_early_stopped()["loss"])] * len(ranks)


def assert_logged(run: dict, history: dict) -> None:
    """A tracker's run holds each value of one device's `history`, at its epoch, within 1e-6."""
    for key, values in history.items():
        logged = run.get(key, [])
        assert {step for step, _ in logged} == set(range(len(values))), (key, logged)
        for step, value in logged:
            assert value == pytest.approx(values[step], rel=1e-6, abs=1e-6), (key, step)


def processes(reducer: str) -> int:
    return 1 if reducer == "one_device" else 2


def test_mlflow_callback_logs_one_run_with_one_devices_metrics(job):
    """Every process opens an MLflow run and gives `fit` MLflow's callback: the chief's run holds
    one device's metrics, and the other process's run (the script's) holds none."""
    reducer, out, _ = job
    runs = trackers.mlflow_runs(out / "mlruns" / "callbacks")
    assert len(runs) == processes(reducer), "each process opened a run"
    logged = [run for run in runs if run]
    assert len(logged) == 1, f"{len(logged)} runs have metrics"
    assert_logged(logged[0], single_device_history())


def test_an_mlflow_run_opened_on_the_chief_alone_is_the_jobs_one_run(job, tmp_path_factory):
    """docs/callbacks.md's form: `mlflow.start_run()` on the chief alone, MLflow's callback given
    to `fit` in every process (beside Keras' own callbacks): one run, one device's metrics."""
    _, out, _ = job
    runs = trackers.mlflow_runs(out / "mlruns" / "chief")
    assert len(runs) == 1, f"{len(runs)} runs"
    reference = tmp_path_factory.getbasetemp() / "keras-one-device"
    assert_logged(runs[0], single_device_with_keras_callbacks(str(reference)))


def test_mlflow_autolog_logs_one_run_with_one_devices_metrics(job):
    reducer, out, _ = job
    runs = trackers.mlflow_runs(out / "mlruns" / "autolog")
    assert len(runs) == 1, f"autologging opened {len(runs)} runs"
    assert_logged(runs[0], single_device_early_stopped())


def test_wandb_metrics_logger_logs_one_run_with_one_devices_metrics(job):
    """Every process opens an offline W&B run and gives `fit` `WandbMetricsLogger`."""
    reducer, out, _ = job
    runs = [
        run
        for rank in range(processes(reducer))
        for run in trackers.wandb_runs(out / f"wandb{rank}")
    ]
    assert len(runs) == processes(reducer), "each process opened a run"
    logged = [run for run in runs if run]
    assert len(logged) == 1, f"{len(logged)} runs have metrics"
    assert_logged(logged[0], single_device_history())


def test_a_callback_given_to_chief_only_runs_on_the_chief_alone(job):
    """The script's own callback, appending each epoch's logs to one file from every process,
    given to `kmirror.callbacks.chief_only`: one line per epoch, one device's values."""
    _, out, _ = job
    lines = (out / "epochs.jsonl").read_text().splitlines()
    epochs = [json.loads(line) for line in lines]
    reference = single_device_history()
    assert len(epochs) == len(reference["loss"]), f"{len(epochs)} lines for 4 epochs"
    assert_logged({k: [(i, e[k]) for i, e in enumerate(epochs)] for k in epochs[0]}, reference)


class Lines(keras.callbacks.Callback):
    """A callback class of the test's own."""


def test_chief_only_marks_a_callback_or_a_class_and_refuses_anything_else():
    """On a process that is not the chief, `written_once` leaves out a marked callback, every
    callback of a marked class, and the trackers' callbacks; the chief runs them all."""
    import mlflow.keras

    marked, of_class, tracker, other = (
        Lines(),
        Lines(),
        mlflow.keras.MlflowCallback(),
        keras.callbacks.EarlyStopping(),
    )
    assert kmirror.callbacks.chief_only(marked) is marked
    given = [marked, tracker, other]
    for is_chief, expected in [(False, [other]), (True, given)]:
        with keras_own.written_once(
            given, SimpleNamespace(is_chief=is_chief, num_processes=2)
        ) as chosen:
            assert chosen == expected
    assert kmirror.callbacks.chief_only(Lines) is Lines
    with keras_own.written_once(
        [of_class, other], SimpleNamespace(is_chief=False, num_processes=2)
    ) as chosen:
        assert chosen == [other]
    with pytest.raises(TypeError, match="takes a keras.callbacks.Callback or a subclass"):
        kmirror.callbacks.chief_only("runs.jsonl")
    for deciding in (keras.callbacks.EarlyStopping(), kmirror.callbacks.BackupAndRestore("b")):
        with pytest.raises(ValueError, match="changes training, so every process must run it"):
            kmirror.callbacks.chief_only(deciding)
    with pytest.raises(ValueError, match="ReduceLROnPlateau changes training"):
        kmirror.callbacks.chief_only(keras.callbacks.ReduceLROnPlateau)


def files(folder: Path) -> list[str]:
    """The files under `folder`, an event file named by its writer's folder only (its name holds
    the host, the process and the time)."""
    found = []
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            name = path.relative_to(folder).as_posix()
            found.append(name.rsplit("/", 1)[0] + "/<events>" if "tfevents" in name else name)
    return sorted(found)


def csv_rows(path: Path) -> tuple[str, np.ndarray]:
    header, *rows = path.read_text().splitlines()
    return header, np.array([[float(v) for v in row.split(",")] for row in rows])


@functools.cache
def single_device_with_keras_callbacks(folder: str) -> dict:
    x, y = dense_data()
    xv, yv = dense_data(n=40, seed=5)
    return (
        dense_model("sgd")
        .fit(
            x,
            y,
            batch_size=BATCH,
            epochs=KERAS_EPOCHS,
            shuffle=False,
            verbose=0,
            validation_data=(xv, yv),
            callbacks=keras_callbacks(folder),
        )
        .history
    )


def test_keras_own_callbacks_write_the_files_one_device_writes(job, tmp_path_factory):
    """ModelCheckpoint(save_best_only=True), CSVLogger, TensorBoard, ReduceLROnPlateau and
    EarlyStopping given to every process with one folder: one checkpoint, one CSV log, one event
    file per writer, as one device writes them; the learning rate lowered and training stopped at
    the epochs one device lowers and stops at."""
    _, out, ranks = job
    reference = tmp_path_factory.getbasetemp() / "keras-one-device"
    history = single_device_with_keras_callbacks(str(reference))
    assert len(history["loss"]) < KERAS_EPOCHS and min(history["learning_rate"]) < 0.1
    shared = out / "keras"
    assert files(shared) == files(reference)
    assert files(shared) == ["best.keras", "board/train/<events>", "board/validation/<events>"] + [
        "log.csv"
    ]
    for rank in ranks:
        assert_same_history(history, rank["keras history"])
    header, rows = csv_rows(shared / "log.csv")
    expected_header, expected_rows = csv_rows(reference / "log.csv")
    assert header == expected_header
    np.testing.assert_allclose(rows, expected_rows, rtol=1e-5, atol=1e-6)
    best, expected_best = (keras.models.load_model(f / "best.keras") for f in (shared, reference))
    for a, b in zip(best.get_weights(), expected_best.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    board = scalars(shared / "board" / "train")
    np.testing.assert_allclose([float(v) for v in board["epoch_loss"]], history["loss"], rtol=1e-5)


class OwnBackup(keras.callbacks.BackupAndRestore):
    """A subclass of Keras' BackupAndRestore: its hooks are the user's."""


def test_a_subclass_of_keras_backup_and_restore_is_refused_naming_kmirrors(tmp_path):
    x, y = dense_data()
    model = kmirror.wrap(dense_model("sgd"), devices=["/cpu:0", "/cpu:1"])
    before = model.get_weights()
    backup = OwnBackup(tmp_path / "backup")
    with pytest.raises(ValueError, match=r"OwnBackup, a subclass of keras.callbacks.Backup"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[backup])
    assert not (tmp_path / "backup").exists()
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


# In one process: tests/test_backup.py.
#: `ssh` for hosts that are this machine: 127.0.0.2 is another host to kmirror and horovodrun.
SSH = {"PATH": f"{HERE / 'ssh'}{os.pathsep}{os.environ['PATH']}"}


@functools.cache
def one_device_backup_run(rows: bool) -> tuple[dict, list]:
    """The backup job's training on one device, uninterrupted: history and weights."""
    x, y = dense_data()
    xv, yv = dense_data(n=40, seed=5)
    model = dense_model("adam")
    keras.utils.set_random_seed(7)
    given = {"x": Rows(x, y)} if rows else {"x": x, "y": y, "batch_size": BATCH}
    fit = model.fit(**given, epochs=5, shuffle=True, verbose=0, validation_data=(xv, yv))
    return fit.history, model.get_weights()


def assert_resumed_as_one_device(ranks: list[dict], rows: bool, epochs: int) -> None:
    history, weights = one_device_backup_run(rows)
    for rank in ranks:
        assert len(rank["history"]["loss"]) == epochs, "the relaunch resumes inside an epoch"
        for key, values in rank["history"].items():
            # The resumed epoch logs its remaining batches' loss and metrics (docs/callbacks.md).
            first = 0 if key.startswith("val_") else 1
            expected = history[key][-epochs:][first:]
            np.testing.assert_allclose(values[first:], expected, rtol=1e-6, atol=1e-6)
        for a, b in zip(rank["weights"], weights, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("reducer, backup", [("horovod", "kmirror's"), ("ring", "Keras' own")])
def test_a_process_killed_with_its_host_resumes_on_the_hosts_left(reducer, backup, tmp_path):
    """`kmirror.launch --hosts 127.0.0.1,127.0.0.2 --max-restarts 1 --min-np 1`: Horovod's job
    handed to horovodrun, the ring's second worker started through ssh (tests/ssh/ssh runs it on
    this machine). Rank 1 is killed inside epoch 4 of a shuffled RowDataset, and its host cannot
    be reached any more: the job starts again on the first host alone, resumes from the chief's
    backup of that epoch's first 2 batches (rank 1's folder is empty), and ends as one device.
    The ring job is given Keras' own BackupAndRestore: kmirror runs it as its own."""
    out, down = tmp_path / "out", tmp_path / "down"
    down.mkdir()
    env = {**SSH, "KMIRROR_TEST_KILL": "1", "KMIRROR_TEST_ROWS": "1"}
    env["KMIRROR_TEST_KERAS_BACKUP"] = str(int(backup == "Keras' own"))
    env["KMIRROR_TEST_DOWN"] = str(down)
    hosts = ["--hosts", "127.0.0.1,127.0.0.2", "--min-np", "1"]
    done = run_job("backup", out, reducer, env=env, restarts=1, options=hosts)
    output = done.stdout
    assert done.returncode == 0, output[-3000:] + done.stderr[-3000:]
    assert "rank 0 of 2 on 127.0.0.1" in output and "rank 1 of 2 on 127.0.0.2" in output
    assert "host 127.0.0.2 cannot be reached; the job goes on without it" in output
    assert "starting it again with 1 processes (restart 1 of 1)" in output
    assert "rank 0 of 1 on 127.0.0.1" in output
    assert (out / "killed").exists() and not (out / "backup1").exists(), "only the chief writes"
    assert not (out / "backup0").exists(), "the backup is removed after a normal end"
    resumed = jobs.rank_results(out, 1, "backup-rank")
    assert resumed[0]["processes"] == 1
    assert_resumed_as_one_device(resumed, rows=True, epochs=2)


@pytest.mark.parametrize("reducer", ["horovod", "ring"])
def test_sigterm_to_one_process_backs_up_at_one_step_and_the_job_resumes_on_three(
    reducer, tmp_path
):
    """Rank 1 of 2 gets SIGTERM after batch 3 of epoch 3 (shuffled numpy arrays): both stop
    before batch 4, the chief backs up there (between the backups every 2 batches), and both
    exit with EXIT_PREEMPTED. A job of 3 processes on two hosts (`--hosts 127.0.0.1:2,127.0.0.2`,
    the second reached through tests/ssh/ssh) resumes there and ends as one device."""
    out = tmp_path / "out"
    every_step = {"KMIRROR_PREEMPTION_CHECK_SECONDS": "0"}  # the agreed step is known
    done = run_job("backup", out, reducer, env={**every_step, "KMIRROR_TEST_TERM": "1"})
    assert done.returncode == kmirror.callbacks.EXIT_PREEMPTED == 75, done.stdout[-3000:]
    for rank in (0, 1):
        assert (
            f"[{rank}] kmirror: SIGTERM: training stopped before batch 4 of epoch 3 on every "
            "process" in done.stdout
        )
    assert "starting it again" not in done.stdout
    index = json.loads((out / "backup0" / "backup.json").read_text())
    assert (index["epoch"], index["step"]) == (2, 3) and not (out / "backup1").exists()
    assert not (out / "backup-rank0.pkl").exists(), "no process went on training"

    hosts = ["--hosts", "127.0.0.1:2,127.0.0.2"]
    resumed = run_job("backup", out, reducer, env=SSH, processes=3, options=hosts)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for rank, host in enumerate(["127.0.0.1", "127.0.0.1", "127.0.0.2"]):
        assert f"rank {rank} of 3 on {host}" in resumed.stdout
    ranks = jobs.rank_results(out, 3, "backup-rank")
    assert [r["processes"] for r in ranks] == [3, 3, 3]
    assert_resumed_as_one_device(ranks, rows=False, epochs=3)


@pytest.mark.parametrize("reducer, signalled", [("horovod", 0), ("ring", 1)])
def test_sigterm_pending_at_the_last_step_keeps_the_end_and_the_relaunch_trains_nothing(
    reducer, signalled, tmp_path
):
    """The chief (Horovod) or the other process (ring) gets SIGTERM inside epoch 3 of 5, and the
    check interval lies past the end of training: the signal is still pending at the last step.
    Training ends on both, the chief backs up the end (not removing the backup), and both exit
    with EXIT_PREEMPTED before the script's code after `fit`. The relaunch trains no batch, writes
    the script's results, and ends as one device (the uninterrupted job). Which process was
    signalled reaches the others through the same gather of every process's flag, whichever it
    is: each reducer carries it one way, and each way is tested."""
    out = tmp_path / "out"
    late = {"KMIRROR_PREEMPTION_CHECK_SECONDS": "1000", "KMIRROR_TEST_TERM": str(signalled)}
    done = run_job("backup", out, reducer, env=late)
    assert done.returncode == kmirror.callbacks.EXIT_PREEMPTED == 75, done.stdout[-3000:]
    for rank in (0, 1):
        assert (
            f"[{rank}] kmirror: SIGTERM: training ended (after epoch 5) on every process"
            in done.stdout
        ), done.stdout[-3000:]
    index = json.loads((out / "backup0" / "backup.json").read_text())
    assert (index["epoch"], index["step"]) == (5, 0) and not (out / "backup1").exists()
    assert not (out / "backup-rank0.pkl").exists(), "no process ran the script after fit"

    resumed = run_job("backup", out, reducer)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    ranks = jobs.rank_results(out, 2, "backup-rank")
    _, weights = one_device_backup_run(rows=False)
    for rank in ranks:
        assert rank["batches"] == 0, "no batch is trained twice"
        for a, b in zip(rank["weights"], weights, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)
    assert not (out / "backup0").exists(), "the backup is removed after the normal end"


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    """The process is killed while writing the second checkpoint's bytes."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(HERE)!r})
        import kmirror
        kmirror.devices.simulate(2)
        import keras.src.saving.saving_lib as saving_lib
        from models import dense_data, dense_model
        save = saving_lib.save_model
        calls = []
        def save_then_die(model, filepath, *args, **kwargs):
            calls.append(filepath)
            if len(calls) == 2:
                with open(filepath, "wb") as f:
                    f.write(b"PK-half-written")
                os.kill(os.getpid(), signal.SIGKILL)
            return save(model, filepath, *args, **kwargs)
        saving_lib.save_model = save_then_die
        model = kmirror.wrap(dense_model(), reducer="one_device")
        x, y = dense_data()
        checkpoint = kmirror.callbacks.ChiefCheckpoint({str(tmp_path / "model.keras")!r})
        model.fit(x, y, batch_size=33, epochs=3, verbose=0, callbacks=[checkpoint])
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert int(loaded.optimizer.iterations) == 4, "the first epoch's checkpoint, whole"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "model.keras"]
    assert all(name.startswith(".model.partial-") for name in leftovers)
