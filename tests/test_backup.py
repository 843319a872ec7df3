"""BackupAndRestore with Keras' arguments: backups every few batches, a relaunch that resumes inside
the interrupted epoch and ends as the uninterrupted run (1e-6), and the fallback to the previous
backup when the latest is corrupt. Here in one process (2 simulated devices), the crash an
exception and the relaunch a new model, dataset and callback after seeding as a script would;
killed processes under Horovod and across workers with their own folders: test_callbacks.py."""

import functools
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from models import BATCH, Crash, CrashAt, dense_data, dense_model

import kmirror
from kmirror._core.callbacks import backup_folder
from kmirror._core.files import digest

HERE = Path(__file__).parent

EPOCHS = 4  # of 4 batches (101 rows in batches of 33)


class Batches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


class Loaded(keras.utils.PyDataset):
    """4 batches of 33, 33, 33 and 2 rows; counts the batches it loads."""

    def __init__(self):
        super().__init__()
        self.x, self.y = dense_data()
        self.loaded = 0

    def __len__(self):
        return 4

    def __getitem__(self, index):
        self.loaded += 1
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


def inputs(kind: str):
    x, y = dense_data()
    if kind.startswith("py_dataset"):  # in order, or in the order Python's random draws
        return {"x": Loaded(), "shuffle": kind == "py_dataset, shuffled"}
    if kind == "dataset":  # reshuffled at every pass, seeded
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(101, seed=5).batch(BATCH)
        return {"x": data}
    return {"x": x, "y": y, "batch_size": BATCH, "shuffle": kind == "shuffled"}


def train(
    backup_dir,
    kind,
    callbacks=(),
    replicas=2,
    validation_data=None,
    backup_class=kmirror.callbacks.BackupAndRestore,
    **backup,
):
    """One launch of the script, on `replicas` replicas: seeded, a new model and input; returns
    (model, batches trained, batches loaded: a PyDataset's count, else None)."""
    keras.utils.set_random_seed(11)
    model = kmirror.wrap(dense_model("adam"), "hierarchical_copy", devices=cpus(replicas))
    counter = Batches()
    callbacks = [backup_class(backup_dir, **backup), counter, *callbacks]
    given = inputs(kind)
    model.fit(
        **given, epochs=EPOCHS, verbose=0, callbacks=callbacks, validation_data=validation_data
    )
    return model, counter.count, getattr(given["x"], "loaded", None)


@functools.cache
def uninterrupted(kind: str) -> list:
    """The state after the uninterrupted run (backed up every 2 batches), trained once per kind
    of input; its backup is removed at the normal end."""
    with tempfile.TemporaryDirectory() as folder:
        model, _, _ = train(Path(folder) / "whole", kind, save_freq=2)
        assert not (Path(folder) / "whole").exists(), "the backup is removed after a normal end"
        return state(model)


def state(model):
    return [v.numpy() for v in model.weights + model.optimizer.variables]


def assert_same_state(expected, actual):
    for a, b in zip(expected, actual, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


# save_freq=2 with 4 batches per epoch: backups after batches 2, 4 (the epoch's end), 6, ... A
# crash after batch 2 of epoch 2 (0-based; the backup holds its first 2) redoes one batch; a crash
# after its batch 0 resumes at the epoch's start (the backup of epoch 1's last batch).
@pytest.mark.parametrize(
    "kind, crash, backed_up, batches",
    [
        ("ordered", (2, 2), (2, 2), 2 + 4),
        ("shuffled", (2, 2), (2, 2), 2 + 4),
        ("dataset", (2, 2), (2, 2), 2 + 4),
        ("dataset", (2, 0), (2, 0), 4 + 4),  # the reshuffling dataset across an epoch's end
        ("py_dataset", (2, 2), (2, 2), 2 + 4),
        ("py_dataset, shuffled", (2, 2), (2, 2), 2 + 4),
        ("py_dataset, shuffled", (2, 0), (2, 0), 4 + 4),
    ],
)
def test_a_crash_mid_epoch_resumes_to_the_uninterrupted_run(
    kind, crash, backed_up, batches, tmp_path
):
    whole = uninterrupted(kind)

    with pytest.raises(Crash):
        train(tmp_path / "backup", kind, [CrashAt(*crash)], save_freq=2)
    index = json.loads((tmp_path / "backup" / "backup.json").read_text())
    assert (index["epoch"], index["step"]) == backed_up
    resumed, trained, loaded = train(tmp_path / "backup", kind, save_freq=2)
    assert trained == batches, "the relaunch trains the batches not backed up, no more"
    if loaded is not None:  # and loads them, after the first two (their shapes)
        assert loaded == 2 + batches
    assert_same_state(whole, state(resumed))


def test_keras_own_backup_and_restore_resumes_mid_epoch_as_kmirrors(tmp_path):
    """Keras' BackupAndRestore, given to a wrapped model, is run as kmirror's (Keras' restarts
    the interrupted epoch): the relaunch trains only the batches not backed up."""
    whole = uninterrupted("shuffled")
    keras_own = {"backup_class": keras.callbacks.BackupAndRestore, "save_freq": 2}
    with pytest.raises(Crash):
        train(tmp_path / "backup", "shuffled", [CrashAt(2, 2)], **keras_own)
    index = json.loads((tmp_path / "backup" / "backup.json").read_text())
    assert (index["epoch"], index["step"]) == (2, 2)
    resumed, trained, _ = train(tmp_path / "backup", "shuffled", **keras_own)
    assert trained == 2 + 4
    assert_same_state(whole, state(resumed))
    assert not (tmp_path / "backup").exists(), "the backup is removed after a normal end"


#: Keras' own test files of its checkpoint callbacks, run with every model wrapped.
KERAS_TESTS = ["backup_and_restore_test.py", "model_checkpoint_test.py"]


def test_keras_own_checkpoint_tests_pass_with_every_model_wrapped(tmp_path):
    """Every test passes but the one that counts the interrupted epoch's first batches trained a
    second time: Keras restarts the epoch (2 + 15 calls of its counting layer); kmirror resumes
    inside it, as the uninterrupted run trains (2 + 13, 15 in all)."""
    folder = Path(keras.__file__).parent / "src" / "callbacks"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "wrap_every_model"]
        + ["-W", "ignore::pytest.PytestUnknownMarkWarning"]
        + [str(folder / test) for test in KERAS_TESTS],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    failed = [
        line.split("::", 1)[1].split(" - ")[0]
        for line in done.stdout.splitlines()
        if line[:6] == "FAILED"
    ]
    assert failed == ["BackupAndRestoreCallbackTest::test_best_case_step"], done.stdout[-5000:]
    assert "AssertionError: 15 != 17" in done.stdout, done.stdout[-5000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 8, done.stdout[-3000:]


@pytest.mark.parametrize("replicas", [3, 1])
def test_a_backup_resumes_on_another_replica_count_to_the_uninterrupted_run(replicas, tmp_path):
    """A crash inside a shuffled epoch on 2 replicas, relaunched on 3 or on 1: the same global
    batches, so the same trajectory as the uninterrupted run on 2."""
    whole = uninterrupted("shuffled")
    with pytest.raises(Crash):
        train(tmp_path / "backup", "shuffled", [CrashAt(2, 2)], save_freq=2)
    resumed, trained, _ = train(tmp_path / "backup", "shuffled", replicas=replicas, save_freq=2)
    assert resumed.num_replicas == replicas
    assert trained == 2 + 4, "the relaunch resumes inside epoch 2"
    assert_same_state(whole, state(resumed))
    keras.utils.set_random_seed(11)  # as train() does: the batch order one device draws
    one_device = dense_model("adam")
    x, y = dense_data()
    one_device.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0)
    assert_same_state(one_device.get_weights(), resumed.get_weights())


class SignalAt(CrashAt):
    """Sends this process SIGTERM after batch `batch` of epoch `epoch` (0-based)."""

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("kind", ["shuffled", "py_dataset, shuffled"])
def test_sigterm_backs_up_before_the_next_step_exits_and_the_relaunch_resumes_there(kind, tmp_path):
    """SIGTERM after batch 3 of epoch 3 (between the backups every 2 batches): training stops
    before batch 4, backed up there, with SystemExit(EXIT_PREEMPTED); the handler SIGTERM had
    before `fit` is back. The relaunch trains the 1 + 4 batches left and ends as the
    uninterrupted run."""
    whole = uninterrupted(kind)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        train(tmp_path / "backup", kind, [SignalAt(2, 2)], save_freq=2)
    assert stopped.value.code == kmirror.callbacks.EXIT_PREEMPTED
    assert signal.getsignal(signal.SIGTERM) is before
    index = json.loads((tmp_path / "backup" / "backup.json").read_text())
    assert (index["epoch"], index["step"]) == (2, 3)
    resumed, trained, _ = train(tmp_path / "backup", kind, save_freq=2)
    assert trained == 1 + 4, "no batch is lost or trained twice"
    assert_same_state(whole, state(resumed))


def test_sigterm_in_the_last_validation_keeps_the_end_and_the_relaunch_trains_nothing(
    tmp_path,
):
    """A signal noted during the last epoch's validation (after the last check) is found when
    training ends: the backup of the end is kept, not removed, and `fit` exits with
    EXIT_PREEMPTED (the script's handler is not called, the signal is acted on). The relaunch
    trains no batch, ends as the uninterrupted run, and removes the backup at its normal end."""
    whole = uninterrupted("ordered")
    received = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        xv, yv = dense_data(n=40, seed=5)

        class AtLastValidation(keras.callbacks.Callback):
            def on_test_begin(self, logs=None):
                if self.model.optimizer.iterations.numpy() == EPOCHS * 4:
                    os.kill(os.getpid(), signal.SIGTERM)

        with pytest.raises(SystemExit) as stopped:
            train(
                tmp_path / "backup",
                "ordered",
                [AtLastValidation()],
                validation_data=(xv, yv),
                save_freq=2,
            )
        assert signal.getsignal(signal.SIGTERM) is not None and received == []
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.code == kmirror.callbacks.EXIT_PREEMPTED
    index = json.loads((tmp_path / "backup" / "backup.json").read_text())
    assert (index["epoch"], index["step"]) == (EPOCHS, 0), "the end of training, kept"
    resumed, trained, _ = train(tmp_path / "backup", "ordered", save_freq=2)
    assert trained == 0, "no batch is trained twice"
    assert_same_state(whole, state(resumed))
    assert not (tmp_path / "backup").exists(), "a normal end: the backup is removed"


class OtherProcess(kmirror.reducers.Job):
    """This process (`index`) of a job of 2, whose other process answers `theirs(check)` at the
    check-th exchange; `asked` lists the calls at which this process exchanged."""

    def __init__(self, index, theirs):
        self.index, self.theirs, self.asked, self.calls = index, theirs, [], 0

    @property
    def num_processes(self):
        return 2

    @property
    def process_index(self):
        return self.index

    def gather_counts(self, count):
        self.asked.append(self.calls)
        answers = [count, self.theirs(len(self.asked))]
        return answers if self.index == 0 else answers[::-1]

    def broadcast(self, variables):
        pass

    def agree_on_seed(self):
        pass


def test_processes_check_for_a_signal_as_often_as_the_chief_counts(monkeypatch, tmp_path):
    """Steps of 10 ms and KMIRROR_PREEMPTION_CHECK_SECONDS=0.5: after the first two checks the
    chief asks every 50 steps, and sends that count (2 * 49 + its signal bit); a process follows
    the chief's count, and learns of a signal at the next check."""
    from kmirror._core.callbacks import preemption

    clock = [0.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv("KMIRROR_PREEMPTION_CHECK_SECONDS", "0.5")
    backup = kmirror.callbacks.BackupAndRestore(tmp_path)

    def calls(watch, job, count):
        found = []
        for _ in range(count):
            job.calls += 1
            clock[0] += 0.01
            found.append(watch._signalled_anywhere())
        return found

    chief = OtherProcess(0, lambda check: 0)
    watch = preemption.Watch(backup, chief)
    assert not any(calls(watch, chief, 120))
    assert chief.asked == [1, 2, 52, 102]
    follower = OtherProcess(1, lambda check: 0 if check < 2 else 2 * 49 + (check == 3))
    watch = preemption.Watch(backup, follower)
    signalled = calls(watch, follower, 60)
    assert follower.asked == [1, 2, 52] and signalled.index(True) == 52 - 1


def test_a_corrupt_latest_backup_falls_back_to_the_previous_one(tmp_path):
    whole = uninterrupted("dataset")
    backup = tmp_path / "backup"
    with pytest.raises(Crash):
        train(backup, "dataset", [CrashAt(2, 2)], save_freq=2, double_checkpoint=True)
    index = json.loads((backup / "backup.json").read_text())
    assert (index["epoch"], index["step"]) == (2, 2)
    assert (index["previous"]["epoch"], index["previous"]["step"]) == (2, 0)
    latest = backup / index["weights"]
    latest.write_bytes(latest.read_bytes()[:100])  # a truncated file

    with pytest.warns(UserWarning, match="missing or corrupt; resuming from the previous"):
        resumed, trained, _ = train(backup, "dataset", save_freq=2, double_checkpoint=True)
    assert trained == 8, "resumed at epoch 2's start, the previous backup"
    assert_same_state(whole, state(resumed))


def test_a_corrupt_file_of_reached_state_is_the_one_named_and_the_previous_backup_taken(tmp_path):
    """A backup whose weights are intact but whose reached state's file is not: the warning
    names that file, and the previous backup is the one resumed."""
    entries = []
    for number in range(2):
        names = {"weights": f"{number}.weights.h5", "reached": f"{number}.reached.npz"}
        for name in names.values():
            (tmp_path / name).write_bytes(name.encode())
        entries.append(
            {
                "epoch": number,
                "step": 0,
                "python_random": [],
                **names,
                "sha256": digest(tmp_path / names["weights"]),
                "reached_sha256": digest(tmp_path / names["reached"]),
            }
        )
    index = {**entries[1], "previous": entries[0]}
    (tmp_path / backup_folder.INDEX).write_text(json.dumps(index))
    (tmp_path / "1.reached.npz").write_bytes(b"truncated")

    with pytest.warns(UserWarning, match=r"1\.reached\.npz is missing or corrupt; resuming"):
        backup = backup_folder.latest(tmp_path, double_checkpoint=True)
    assert backup.position == backup_folder.Position(0, 0)
    assert backup.reached == tmp_path / "0.reached.npz"


def test_a_corrupt_backup_without_a_previous_one_is_refused_and_kept(tmp_path):
    backup = tmp_path / "backup"
    with pytest.raises(Crash):
        train(backup, "ordered", [CrashAt(1, 2)], save_freq=2)
    latest = backup / json.loads((backup / "backup.json").read_text())["weights"]
    latest.write_bytes(b"not a weights file")
    files = {p.name: p.read_bytes() for p in backup.iterdir()}
    with pytest.raises(
        ValueError,
        match="Delete the folder to train from the start, or pass double_checkpoint=True",
    ):
        train(backup, "ordered", save_freq=2)
    assert {p.name: p.read_bytes() for p in backup.iterdir()} == files


def test_epoch_backups_resume_at_the_next_epoch(tmp_path):
    whole = uninterrupted("dataset")
    with pytest.raises(Crash):
        train(tmp_path / "backup", "dataset", [CrashAt(2, 1)])
    resumed, trained, _ = train(tmp_path / "backup", "dataset")
    assert trained == 8
    assert_same_state(whole, state(resumed))


def test_input_that_cannot_skip_batches_restarts_the_epoch_and_says_so(tmp_path):
    def run(callbacks=()):
        keras.utils.set_random_seed(11)
        model = kmirror.wrap(dense_model("adam"), "hierarchical_copy", devices=cpus(2))
        counter = Batches()
        backup = kmirror.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=2)
        callbacks = [backup, counter, *callbacks]
        model.fit(Loaded(), steps_per_epoch=4, epochs=EPOCHS, verbose=0, callbacks=callbacks)
        return counter.count

    with pytest.raises(Crash):
        run([CrashAt(2, 2)])
    with pytest.warns(UserWarning, match="resumes at the start of epoch 3"):
        assert run() == 8


@pytest.mark.parametrize(
    "keras_callback, ours",
    [
        (keras.callbacks.BackupAndRestore, kmirror.callbacks.BackupAndRestore),
        (keras.callbacks.ModelCheckpoint, kmirror.callbacks.ChiefCheckpoint),
        (keras.callbacks.TensorBoard, kmirror.callbacks.ChiefTensorBoard),
    ],
)
def test_every_keras_argument_is_taken_in_the_same_place(keras_callback, ours):
    """Replacing Keras' callback by kmirror's is a rename: the same names, order and defaults."""
    expected = [
        (p.name, p.kind, p.default)
        for p in inspect.signature(keras_callback.__init__).parameters.values()
    ]
    actual = [
        (p.name, p.kind, p.default) for p in inspect.signature(ours.__init__).parameters.values()
    ]
    assert actual == expected


@pytest.mark.parametrize("save_freq", [0, -3, "batch", 2.5, True])
def test_a_bad_save_freq_names_the_choices(save_freq, tmp_path):
    with pytest.raises(ValueError, match="'epoch', a number of batches >= 1, or False"):
        kmirror.callbacks.BackupAndRestore(tmp_path, save_freq=save_freq)
