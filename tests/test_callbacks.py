"""Chief-only, atomic checkpoints and summaries, and resuming after a crash, in one process
(2 simulated devices), under Horovod (2 ranks) and with 2 multi-worker workers."""

import functools
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from models import (
    BATCH,
    KERAS_EPOCHS,
    assert_same_history,
    dense_data,
    dense_model,
    keras_callbacks,
)

import kmirror

HERE = Path(__file__).parent
JOB = str(HERE / "callbacks_job.py")
TIMEOUT = 300
MODES = ["one_device", "horovod", "ring"]


def run_job(
    mode: str, out: Path, reducer: str, env=None, restarts: int = 0
) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    if reducer in ("horovod", "ring"):
        processes = ["-n", "2"] if reducer == "horovod" else ["--workers", "2"]
        processes += ["--max-restarts", str(restarts), "--timeout", str(TIMEOUT)]
        command = [sys.executable, "-m", "kmirror.launch", *processes]
    else:
        command = [sys.executable]
    return subprocess.run(
        [*command, JOB, mode, str(out), reducer],
        capture_output=True,
        text=True,
        timeout=TIMEOUT + 30,
        env={**os.environ, **(env or {})},
        cwd=HERE.parent,
    )


def results(out: Path, mode: str, reducer: str) -> list[dict]:
    ranks = 1 if reducer == "one_device" else 2
    return [pickle.loads((out / f"{mode}-rank{r}.pkl").read_bytes()) for r in range(ranks)]


@functools.cache
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


def test_early_stopping_stops_every_rank_at_the_single_device_epoch(job):
    _, _, ranks = job
    x, y = dense_data()
    xv, yv = dense_data(n=40, seed=5)
    reference = dense_model("sgd").fit(
        x,
        y,
        batch_size=BATCH,
        epochs=30,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=[keras.callbacks.EarlyStopping(patience=1, min_delta=0.05)],
    )
    epochs = [r["early_stopped_epochs"] for r in ranks]
    assert 1 < epochs[0] < 30
    assert epochs == [len(reference.history["loss"])] * len(ranks)


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


def test_keras_backup_and_restore_is_refused_naming_kmirrors(tmp_path):
    x, y = dense_data()
    model = kmirror.wrap(dense_model("sgd"), devices=["/cpu:0", "/cpu:1"])
    before = model.get_weights()
    backup = keras.callbacks.BackupAndRestore(tmp_path / "backup")
    with pytest.raises(ValueError, match=r"use kmirror\.callbacks\.BackupAndRestore"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[backup])
    assert not (tmp_path / "backup").exists()
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


# In one process: tests/test_backup.py.
@pytest.mark.parametrize("reducer", ["horovod", "ring"])
def test_crash_and_relaunch_with_backup_ends_as_an_uninterrupted_run(reducer, tmp_path):
    """Rank 1 is killed inside epoch 4 of a training on numpy arrays in order, then of one on a
    shuffled RowDataset (the order drawn by Python's random, whose state the chief's backup
    holds). `kmirror.launch --max-restarts 2` starts the job again after each crash; each restart
    resumes from the chief's backup of that epoch's first 2 batches (rank 1's own folder is
    empty) and ends as the uninterrupted run. (Shuffled numpy arrays resume in one process,
    tests/test_backup.py.)"""
    # The first attempt also runs each training uninterrupted, before the crashing ones.
    crashing = tmp_path / "crashing"
    done = run_job("backup", crashing, reducer, env={"KMIRROR_TEST_CRASH": "1"}, restarts=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("starting it again (restart") == 2
    assert all((crashing / f"crashed-{scenario}").exists() for scenario in ("ordered", "rows"))
    assert not (crashing / "backup1").exists(), "only the chief writes"
    assert not (crashing / "whole0").exists(), "the backup is removed after a normal end"

    for scenario in ("ordered", "rows"):
        mode = f"backup-{scenario}"
        whole = results(crashing, f"backup-whole-{scenario}", reducer)
        for expected, resumed in zip(whole, results(crashing, mode, reducer), strict=True):
            assert len(resumed["history"]["loss"]) == 2, "the relaunch resumes in epoch 4 of 5"
            np.testing.assert_allclose(
                resumed["history"]["loss"][-1], expected["history"]["loss"][-1], rtol=1e-6
            )
            for a, b in zip(resumed["weights"], expected["weights"]):
                np.testing.assert_allclose(a, b, atol=1e-6)
            for a, b in zip(resumed["optimizer"], expected["optimizer"]):
                np.testing.assert_allclose(a, b, atol=1e-6)


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
