"""The horovod reducer: 2 processes, each starting from its own weights, train exactly as one device
would with the same global batch, under kmirror.launch (everything) and under horovodrun (the
ranks it starts, and their first training)."""

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import jobs
import numpy as np
import pytest
from features import MULTI_PROCESS
from models import assert_same_history, dense_data, dense_model, max_weight_difference
from multi_process import (
    Weights,
    assert_backed_up_reached_state_equals_single_device,
    assert_chief_weights_before_any_fit,
    assert_each_process_loads_only_its_rows,
    assert_equal_across_ranks,
    assert_every_process_raised_for_a_diverged_weight,
    assert_feature_equals_single_device,
    assert_own_evaluation_equals_single_device,
    assert_real_models_equal_single_device,
    assert_sharded_input_equals_single_device,
    assert_uneven_local_batches_are_refused,
    reference,
)

import kmirror

HERE = Path(__file__).parent
PYTHON = sys.executable
HOROVODRUN = str(Path(PYTHON).with_name("horovodrun"))
#: A bound for a hang, not a measure: the job with every part takes about 300 s alone here, and
#: up to twice that while the other test process and its jobs share the 2 cores.
JOB_TIMEOUT = 1200


def command(launcher: str, script: list[str], n: int = 2) -> list[str]:
    if launcher == "horovodrun":
        return [HOROVODRUN, "-np", str(n), "-H", f"localhost:{n}", "--gloo", PYTHON, *script]
    return [PYTHON, "-m", "kmirror.launch", "-n", str(n), "--timeout", str(JOB_TIMEOUT), *script]


@functools.cache
def job(launcher: str, folder: str) -> list[dict]:
    # Everything runs under kmirror.launch; horovodrun starts the same Horovod ranks, so under it
    # the job trains its first models only (test_horovodrun_starts_the_same_ranks).
    parts = "real_models,rest,features" if launcher == "kmirror.launch" else ""
    script = [str(HERE / "multi_process_job.py"), folder, parts]
    return jobs.results(command(launcher, script), Path(folder), 2, JOB_TIMEOUT + 30)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launched("kmirror.launch", tmp_path_factory)


def launched(launcher: str, tmp_path_factory) -> list[dict]:
    """The job under `launcher`, run once per session."""
    folder = tmp_path_factory.getbasetemp() / f"job-{launcher}"
    folder.mkdir(exist_ok=True)
    return job(launcher, str(folder))


@pytest.mark.parametrize(
    "scenario",
    ["numpy", "tf.data", "xla", "multi_io", "multi_io, num_packs=0", "multi_io, num_packs=3"],
)
def test_two_ranks_equal_single_device(ranks, scenario):
    """Different initial weights per rank, SGD with momentum, an uneven final batch (3*33+2);
    gradients packed into 1 buffer (default), 3, or handed to Horovod one by one."""
    model, history = reference(scenario)
    assert_equal_across_ranks(ranks, scenario)
    for rank in ranks:
        assert max_weight_difference(model, Weights(rank[scenario]["weights"])) < 1e-5
        assert_same_history(history, rank[scenario]["history"])


def test_a_weight_written_differently_raises_in_every_process(tmp_path_factory):
    assert_every_process_raised_for_a_diverged_weight(launched("kmirror.launch", tmp_path_factory))


def test_a_backup_holds_state_no_walk_finds_and_the_relaunch_resumes_it(ranks):
    """A seed generator held by an object that is not a layer, backed up and resumed on 2
    Horovod ranks (`assert_backed_up_reached_state_equals_single_device`)."""
    assert_backed_up_reached_state_equals_single_device(ranks)


def test_a_deep_model_and_the_transfer_learning_flow_equal_single_device(ranks):
    """MobileNetV2 in float64 and the keras.io transfer-learning flow (unfreezing through the
    user's reference), each rank starting from its own weights."""
    assert_real_models_equal_single_device(ranks)


def test_horovodrun_starts_the_same_ranks(tmp_path_factory):
    """Under horovodrun (Gloo): rank 0 is the chief of 2 replicas, every rank starts from its
    weights before any fit, and trains as one device would."""
    ranks = launched("horovodrun", tmp_path_factory)
    assert [r["numpy"]["is_chief"] for r in ranks] == [True, False]
    assert [r["numpy"]["num_replicas"] for r in ranks] == [2, 2]
    assert_chief_weights_before_any_fit(ranks)
    model, history = reference("numpy")
    assert_equal_across_ranks(ranks, "numpy")
    for rank in ranks:
        assert max_weight_difference(model, Weights(rank["numpy"]["weights"])) < 1e-5
        assert_same_history(history, rank["numpy"]["history"])


@pytest.mark.parametrize("name", MULTI_PROCESS)
def test_two_ranks_equal_single_device_for_every_feature(tmp_path_factory, name):
    ranks = launched("kmirror.launch", tmp_path_factory)
    assert_feature_equals_single_device(ranks, name)


def test_only_rank_0_is_chief_and_the_job_has_two_replicas(ranks):
    assert [r["numpy"]["is_chief"] for r in ranks] == [True, False]
    assert [r["numpy"]["num_replicas"] for r in ranks] == [2, 2]
    assert [r["numpy"]["reducer"] for r in ranks] == ["horovod", "horovod"]
    assert [r["xla"]["replica_jit_compile"] for r in ranks] == [True, True]


def test_later_epochs_and_fits_do_not_retrace_the_step(ranks):
    """Traced once per batch shape; every process seeded alike once, at the first fit (seeding
    again would clear TensorFlow's kernel caches and rebuild the step at every fit)."""
    for rank in ranks:
        counts = rank["traces"]["after each fit"]  # 3 fits of 2 shuffled epochs
        assert 1 <= counts[0] <= 2 and counts == [counts[0]] * 3, counts
        assert rank["traces"]["seedings"] == 1


def test_shuffled_epochs_see_every_sample_once_on_one_rank(ranks):
    """Ranks seeded differently still shuffle alike: with a frozen model, an epoch's logged loss
    and accuracy are those of the whole data set."""
    for rank in ranks:
        loss, accuracy = rank["shuffled"]["evaluate"]
        np.testing.assert_allclose(rank["shuffled"]["history"]["loss"], [loss, loss], rtol=1e-5)
        np.testing.assert_allclose(rank["shuffled"]["history"]["accuracy"], [accuracy] * 2)


def test_evaluate_and_predict_are_global_on_every_rank(ranks):
    model, _ = reference("numpy")
    x, y = dense_data()
    expected_evaluate = model.evaluate(x, y, batch_size=7, verbose=0)
    expected_predict = model.predict(x, batch_size=10, verbose=0)
    for rank in ranks:
        np.testing.assert_allclose(rank["numpy"]["evaluate"], expected_evaluate, rtol=1e-5)
        assert rank["numpy"]["predict"].shape == (101, 3)
        np.testing.assert_allclose(rank["numpy"]["predict"], expected_predict, atol=1e-5)


def test_evaluate_and_predict_before_any_fit_use_the_chief_weights(ranks):
    assert_chief_weights_before_any_fit(ranks)


def test_own_test_step_and_predict_step_equal_single_device(ranks):
    assert_own_evaluation_equals_single_device(ranks)


@pytest.mark.parametrize("compression, tolerance", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_compressed_gradients_train_close_to_exact(ranks, compression, tolerance):
    model, history = reference("numpy")
    assert_equal_across_ranks(ranks, compression)
    compressed = Weights(ranks[0][compression]["weights"])
    difference = max_weight_difference(model, compressed)
    assert 0 < difference < tolerance, "compressed gradients must be rounded, and only that much"
    np.testing.assert_allclose(ranks[0][compression]["history"]["loss"], history["loss"], rtol=1e-2)


def square_and_rank(value):
    import os

    return value * value, int(os.environ["HOROVOD_RANK"])


def test_launch_run_returns_every_ranks_result():
    assert kmirror.launch.run(square_and_rank, n=2, args=(7,), timeout=60) == [(49, 0), (49, 1)]


SLOW_JOB = """
import os, sys, time
sys.path.insert(0, {tests!r})
import lean_start
import keras, kmirror
from models import dense_data, dense_model
model = kmirror.wrap(dense_model(), reducer="horovod")
x, y = dense_data(n=20000)
class Mark(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:  # written whole, then renamed: the test never reads it half-written
            pid = os.path.join({folder!r}, "pid%s" % os.environ["HOROVOD_RANK"])
            with open(pid + ".partial", "w") as f:
                f.write(str(os.getpid()))
            os.replace(pid + ".partial", pid)
        time.sleep(0.01)
model.fit(x, y, batch_size=32, epochs=100, verbose=0, callbacks=[Mark()])
"""


@pytest.mark.parametrize("launcher", ["kmirror.launch", "horovodrun"])
def test_a_killed_rank_stops_the_other_with_a_message(launcher, tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(SLOW_JOB.format(tests=str(HERE), folder=str(tmp_path)))
    job = subprocess.Popen(
        command(launcher, [str(script)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        pid_file = tmp_path / "pid1"
        deadline = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        assert pid_file.exists(), "rank 1 never started training"
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        # The job ends by itself (a job that waits forever fails here instead of hanging CI).
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0
    if launcher == "horovodrun":
        # The surviving rank notices by itself and says why.
        assert "PeerLost" in output and "another rank of the Horovod job stopped" in output
    else:
        assert "kmirror.launch: rank 1 exited with code 137; stopping the other ranks" in output


def run_alone(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent)])
    return subprocess.run(
        [PYTHON, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_without_a_launcher_it_trains_as_one_replica_and_says_so():
    done = run_alone(
        "import kmirror, models, warnings\n"
        "x, y = models.dense_data()\n"
        "reference = models.dense_model()\n"
        "reference.fit(x, y, batch_size=33, epochs=2, shuffle=False, verbose=0)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    model = kmirror.wrap(models.dense_model(), reducer='horovod')\n"
        "print([str(w.message) for w in caught])\n"
        "model.fit(x, y, batch_size=33, epochs=2, shuffle=False, verbose=0)\n"
        "print('replicas', model.num_replicas, 'chief', model.is_chief)\n"
        "print('difference', models.max_weight_difference(reference, model))\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "started without a launcher, so it trains as a single replica" in done.stdout
    assert "replicas 1 chief True" in done.stdout
    assert float(done.stdout.split("difference")[-1]) < 1e-6


def test_without_horovod_installed_the_error_names_the_install():
    done = run_alone(
        "import sys; sys.modules['horovod'] = None\n"
        "import kmirror, models\n"
        "try:\n"
        "    kmirror.wrap(models.dense_model(), reducer='horovod')\n"
        "except ImportError as error:\n"
        "    print('ImportError:', error)\n"
    )
    assert "ImportError: reducer='horovod' needs Horovod" in done.stdout, done.stderr[-2000:]
    assert "python -m kmirror.install_horovod" in done.stdout


def test_the_horovod_install_ships_in_the_wheel_and_runs_from_it(tmp_path):
    """A user who installed kmirror from a wheel has the command the error names: the wheel
    holds it, and it runs (here Horovod is installed already: it says so and changes nothing)."""
    source = tmp_path / "source"  # a copy: building writes into the tree it builds
    ignored = shutil.ignore_patterns("__pycache__")
    shutil.copytree(HERE.parent / "kmirror", source / "kmirror", ignore=ignored)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(HERE.parent / name, source / name)
    built = subprocess.run(
        [PYTHON, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("kmirror-*.whl")
    assert "kmirror/install_horovod.py" in zipfile.ZipFile(wheel).namelist()
    done = subprocess.run(
        [PYTHON, "-m", "kmirror.install_horovod"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "horovod 0.28.1 already installed" in done.stdout


def test_horovod_is_not_given_devices():
    with pytest.raises(ValueError, match="do not pass devices="):
        kmirror.wrap(dense_model(), reducer="horovod", devices=["/cpu:0"])


@pytest.mark.parametrize(
    "scenario", ["shard", "shard, shuffled", "rows", "local batches", "own step, shard"]
)
def test_sharded_input_equals_single_device(ranks, scenario):
    """Each rank holds only its rows of every global batch (kmirror.data.shard over row indices,
    in order or shuffled with a seed; a RowDataset; a dataset sharded by hand and wrapped with
    kmirror.data.local_batches; a model's own train_step on kmirror.data.shard's dataset): the
    training of one device on the global batches."""
    assert_sharded_input_equals_single_device(ranks, scenario)


def test_each_rank_loads_only_its_rows(ranks):
    assert_each_process_loads_only_its_rows(ranks)


def test_processes_whose_own_batches_differ_in_number_are_refused(ranks):
    assert_uneven_local_batches_are_refused(ranks)
