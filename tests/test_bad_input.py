"""Bad input gets an error of the right type that names the fix, and leaves the user's model as it
was and usable: a wrap that fails does not touch it, and an error in training leaves it as the
last step before the error left it."""

import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from models import BATCH, dense_data, dense_model, max_weight_difference

import kmirror

_BEFORE = {}  # each fixture model's weights when it was made


@pytest.fixture
def model():
    """A compiled model; each test ends with `assert_untouched(model)`."""
    original = dense_model()
    _BEFORE[id(original)] = [w.copy() for w in original.get_weights()]
    return original


def assert_untouched(model, wrapped=None):
    """The model is as it was before the error (given back by `wrapped` first, when a wrap
    succeeded), a plain Keras model again, and still trains."""
    if wrapped is not None:
        assert wrapped.unwrap() is model
    for w, b in zip(model.get_weights(), _BEFORE.pop(id(model)), strict=True):
        np.testing.assert_array_equal(w, b)
    assert int(model.optimizer.iterations) == 0
    x, y = dense_data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


@pytest.mark.parametrize(
    "reducer, match",
    [
        ("nccl_allreduce", "unknown reducer 'nccl_allreduce'. Did you mean 'nccl'"),
        ("one-device", "Did you mean 'one_device'"),
        ("banana", "Valid reducers: auto, nccl, hierarchical_copy, one_device, horovod, ring"),
    ],
)
def test_unknown_reducer_lists_the_valid_names(model, reducer, match):
    with pytest.raises(ValueError, match=match):
        kmirror.wrap(model, reducer=reducer, devices=cpus(2))
    assert_untouched(model)


def test_nccl_without_gpus_says_gpus_are_needed_and_what_to_use(model):
    with pytest.raises(ValueError, match="needs at least 2 GPUs") as error:
        kmirror.wrap(model, reducer="nccl", devices=cpus(2))
    assert "reducer='hierarchical_copy' or 'one_device' on CPUs" in str(error.value)
    with pytest.raises(ValueError, match="found 0 GPU"):
        kmirror.wrap(model, reducer=kmirror.reducers.Nccl(), devices=cpus(3))
    assert_untouched(model)


def test_ring_without_a_cluster_says_how_to_start_workers(model):
    with pytest.raises(ValueError, match="needs a cluster: set TF_CONFIG"):
        kmirror.wrap(model, reducer="ring", devices=cpus(2))
    assert_untouched(model)


def test_options_that_do_not_apply_are_refused(model):
    with pytest.raises(ValueError, match="does not take the option.*reduce_to_device.*num_packs"):
        kmirror.wrap(model, "hierarchical_copy", devices=cpus(2), reduce_to_device="/cpu:0")
    with pytest.raises(ValueError, match="num_packs must be a whole number >= 0"):
        kmirror.wrap(model, "hierarchical_copy", devices=cpus(2), num_packs=-1)
    with pytest.raises(ValueError, match="set them on the object instead"):
        kmirror.wrap(model, kmirror.reducers.OneDevice(), devices=cpus(2), num_packs=2)
    assert_untouched(model)


def test_duplicate_devices(model):
    with pytest.raises(ValueError, match="more than once; give each device once"):
        kmirror.wrap(model, devices=["/cpu:0", "/device:CPU:0"])
    assert_untouched(model)


def test_devices_and_num_gpus_together(model):
    with pytest.raises(ValueError, match="either devices=.* or num_gpus=N.*not both"):
        kmirror.wrap(model, devices=cpus(2), num_gpus=0)
    assert_untouched(model)


def test_devices_that_do_not_exist(model):
    with pytest.raises(ValueError, match="do not exist here.*kmirror.devices.simulate"):
        kmirror.wrap(model, devices=["/gpu:0", "/gpu:1"])
    with pytest.raises(ValueError, match="num_gpus=2 asks for more GPUs than this machine has"):
        kmirror.wrap(model, num_gpus=2)
    assert_untouched(model)


def test_a_reducer_object_serves_one_model(model):
    reducer = kmirror.reducers.OneDevice()
    kmirror.wrap(dense_model(), reducer, devices=cpus(2))
    with pytest.raises(ValueError, match="pass a new reducer object"):
        kmirror.wrap(model, reducer, devices=cpus(2))
    assert_untouched(model)


@pytest.mark.parametrize("thing", [object(), "model.keras", keras.layers.Dense(3)])
def test_something_that_is_not_a_model(thing):
    with pytest.raises(TypeError, match="kmirror.wrap expects a keras.Model"):
        kmirror.wrap(thing, devices=cpus(2))


def test_wrapping_twice(model):
    wrapped = kmirror.wrap(model, devices=cpus(2))
    with pytest.raises(ValueError, match="already a kmirror.MirroredModel.*unwrap"):
        kmirror.wrap(wrapped, devices=cpus(2))
    with pytest.raises(ValueError, match="already wrapped by kmirror.*unwrap"):
        kmirror.wrap(model, "one_device", devices=cpus(3))
    assert wrapped.num_replicas == 2, "the first wrap is as it was"
    assert_untouched(model, wrapped)
    with pytest.raises(ValueError, match="was unwrapped.*kmirror.wrap"):
        wrapped.fit(*dense_data(), verbose=0)


def test_a_model_built_in_a_strategy_scope_is_refused_untouched():
    strategy = tf.distribute.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = dense_model()
    before = model.get_weights()
    with pytest.raises(ValueError, match="already distributed.*outside any strategy scope"):
        kmirror.wrap(model, devices=cpus(2))
    assert all(type(v.value).__name__ == "MirroredVariable" for v in model.weights), (
        "the storage the model was built with"
    )
    for w, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(w, b)


def test_fit_before_compile_says_compile():
    x, y = dense_data()
    wrapped = kmirror.wrap(dense_model(compiled=False), devices=cpus(2))
    with pytest.raises(ValueError, match=r"must be compiled before `fit\(\)`.*model.compile"):
        wrapped.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match=r"must be compiled before `evaluate\(\)`"):
        wrapped.evaluate(x, y, verbose=0)


@pytest.mark.parametrize("batch_size", [-3, 0, 2.5, True])
def test_a_batch_size_that_is_not_a_count_is_named_before_anything_moves(model, batch_size):
    x, y = dense_data()
    wrapped = kmirror.wrap(model, devices=cpus(2))
    match = f"batch_size={batch_size!r}: give a whole number >= 1"
    with pytest.raises(ValueError, match=re.escape(match)):
        wrapped.fit(x, y, batch_size=batch_size, verbose=0)
    with pytest.raises(ValueError, match=re.escape("validation_" + match)):
        wrapped.fit(x, y, validation_data=(x, y), validation_batch_size=batch_size, verbose=0)
    for method in (wrapped.evaluate, wrapped.predict):
        with pytest.raises(ValueError, match=re.escape(match)):
            method(x, batch_size=batch_size, verbose=0)
    assert_untouched(model, wrapped)


@pytest.mark.parametrize(
    "validation, message",
    [
        (lambda x, y: (x[:, :5], y), "expected axis -1 of input shape to have value 8"),
        (lambda x, y: (x, np.ones((len(y), 4))), "validation_data does not fit the model"),
        (
            lambda x, y: tf.data.Dataset.from_tensor_slices((x[:, :5], y)).batch(7),
            "expected axis -1 of input shape to have value 8",
        ),
    ],
    ids=["inputs", "targets", "dataset"],
)
def test_validation_data_the_model_cannot_take_is_refused_before_the_first_step(
    model, validation, message
):
    """One device would train a whole epoch before it failed."""
    x, y = dense_data()
    wrapped = kmirror.wrap(model, devices=cpus(2))
    with pytest.raises(ValueError, match="validation_data does not fit the model") as error:
        wrapped.fit(x, y, batch_size=BATCH, validation_data=validation(x, y), verbose=0)
    assert message in str(error.value) and "Nothing was trained" in str(error.value)
    assert_untouched(model, wrapped)


def test_validation_split_of_a_dataset_is_named_with_the_fix(model):
    x, y = dense_data()
    wrapped = kmirror.wrap(model, devices=cpus(2))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with pytest.raises(ValueError, match="splits numpy arrays and tensors only; x is a"):
        wrapped.fit(data, validation_split=0.2, verbose=0)
    assert_untouched(model, wrapped)


def test_simulate_after_tensorflow_started_says_to_call_it_first():
    with pytest.raises(RuntimeError, match=r"Call kmirror.devices.simulate\(3\) first"):
        kmirror.devices.simulate(3)
    assert len(kmirror.devices.simulate(7)) == 7, "the same count again is harmless"
    with pytest.raises(ValueError, match="whole number n >= 1"):
        kmirror.devices.simulate(0)


def test_a_non_finite_loss_stops_training_before_its_update_and_says_what_to_look_for(model):
    x, y = dense_data()
    x[40, 0] = np.inf  # batch 2 of 33 rows
    wrapped = kmirror.wrap(model, devices=cpus(2))
    with pytest.raises(kmirror.errors.NonFiniteLoss, match="at epoch 1, batch 2") as error:
        wrapped.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert "np.isfinite(x).all()" in str(error.value) and "clipnorm" in str(error.value)
    # The model holds what the first batch's step made of it, on one device as on two.
    plain = wrapped.unwrap()
    reference = dense_model()
    reference.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert max_weight_difference(reference, plain) < 1e-6
    assert int(plain.optimizer.iterations) == 1
    _BEFORE.pop(id(model))


@pytest.mark.parametrize("callback", ["ChiefCheckpoint", "BackupAndRestore"])
def test_files_into_a_folder_that_cannot_be_written_fail_before_training(model, callback, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a folder")
    target = {
        "ChiefCheckpoint": lambda: kmirror.callbacks.ChiefCheckpoint(blocked / "ckpt" / "m.keras"),
        "BackupAndRestore": lambda: kmirror.callbacks.BackupAndRestore(blocked / "backup"),
    }[callback]()
    wrapped = kmirror.wrap(model, devices=cpus(2))
    x, y = dense_data()
    with pytest.raises(
        NotADirectoryError, match="is a file, not a folder. Give a path in a folder"
    ):
        wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[target])
    assert int(wrapped.optimizer.iterations.numpy()) == 0, "no step ran"
    assert blocked.read_text() == "a file, not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked"], "nothing was created"
    assert_untouched(model, wrapped)


@pytest.mark.parametrize("seconds", ["soon", "-1"])
def test_a_bad_preemption_check_interval_is_named_before_training(
    model, seconds, tmp_path, monkeypatch
):
    monkeypatch.setenv("KMIRROR_PREEMPTION_CHECK_SECONDS", seconds)
    wrapped = kmirror.wrap(model, devices=cpus(2))
    x, y = dense_data()
    backup = kmirror.callbacks.BackupAndRestore(tmp_path / "backup")
    with pytest.raises(ValueError, match="KMIRROR_PREEMPTION_CHECK_SECONDS must be a number"):
        wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[backup])
    assert int(wrapped.optimizer.iterations.numpy()) == 0, "no step ran"
    assert list(tmp_path.iterdir()) == [], "nothing was created"
    assert_untouched(model, wrapped)


LAUNCHER_MISTAKES = [
    (["-n", "0", "x.py"], "the number of processes must be a whole number >= 1"),
    (["-n", "-2", "x.py"], "the number of processes must be a whole number >= 1"),
    (["--workers", "0", "x.py"], "the number of processes must be a whole number >= 1"),
    (["--workers", "2", "-n", "2", "x.py"], "do not combine it with -n"),
    (["-n", "2"], "give the script to run"),
    (["x.py"], "give the number of processes with -n N"),
    (["-n", "2", "--port", "70000", "x.py"], "port must be a whole number from 1 to"),
    (["-n", "2", "--max-restarts", "-1", "x.py"], "max_restarts must be a whole number >= 0"),
    (["--hosts", "node1:0,node2", "x.py"], "write it as host1:2,host2:2"),
    (["--hosts", "node1,node2", "-n", "3", "x.py"], "3 processes do not fit on the hosts given"),
    (["--hosts", "node1:2", "--min-np", "0", "x.py"], "min_np must be a whole number >= 1"),
    (["--hosts", "node1,node2", "--port", "9000", "x.py"], "horovodrun picks its own"),
]


@pytest.mark.parametrize("arguments, message", LAUNCHER_MISTAKES)
def test_launcher_mistakes_are_named(arguments, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        kmirror.launch.main(arguments)
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and message in stderr, stderr[-1000:]


def test_the_launcher_command_exits_with_its_message():
    arguments, message = LAUNCHER_MISTAKES[0]
    done = subprocess.run(
        [sys.executable, "-m", "kmirror.launch", *arguments],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr[-1000:]


def test_launch_run_with_a_bad_count_or_mode_raises_before_starting_anything():
    with pytest.raises(ValueError, match="whole number >= 1"):
        kmirror.launch.run(print, n=0)
    with pytest.raises(ValueError, match="unknown mode 'mpi'; use one of horovod, ring"):
        kmirror.launch.run(print, n=2, mode="mpi")


@pytest.mark.parametrize(
    "library, version",
    [("keras", "3.11.2"), ("keras", "4.0.0"), ("tensorflow", "2.18.1"), ("tensorflow", "1.15.5")],
)
def test_an_unsupported_keras_or_tensorflow_is_named_with_the_supported_range(
    monkeypatch, library, version
):
    import tensorflow as tf

    monkeypatch.setattr(keras if library == "keras" else tf, "__version__", version)
    with pytest.raises(ImportError) as raised:
        kmirror.versions.check()
    message = str(raised.value)
    assert f"{library} {version}" in message
    assert "keras>=3.12,<4" in message and "tensorflow>=2.19" in message
    assert "pip install" in message


def test_supported_versions_pass_the_check(monkeypatch):
    import tensorflow as tf

    monkeypatch.setattr(keras, "__version__", "3.12.0")
    monkeypatch.setattr(tf, "__version__", "2.19.0")
    kmirror.versions.check()
    monkeypatch.setattr(tf, "__version__", "2.25.0rc1")  # newer TensorFlow releases
    kmirror.versions.check()


def test_the_versions_are_checked_at_first_use_and_importing_kmirror_starts_no_tensorflow():
    """`import kmirror` and the launcher start neither Keras nor TensorFlow (the launcher starts
    its processes at once); kmirror's first use that needs them checks their versions."""
    script = (
        "import sys\n"
        "import kmirror\n"
        "print(kmirror.launch.__name__)\n"  # its modules are imported on first use
        "import kmirror.launch\n"
        "print(sorted({'keras', 'tensorflow'} & set(sys.modules)))\n"
        "import keras\n"
        "keras.__version__ = '3.11.0'\n"
        "try:\n"
        "    kmirror.wrap\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    module, imported, message = done.stdout.splitlines()
    assert module == "kmirror.launch"
    assert imported == "[]"
    assert "keras 3.11.0" in message and "keras>=3.12,<4" in message, message
