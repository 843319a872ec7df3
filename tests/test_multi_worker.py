"""Multi-worker training on TensorFlow's collective ring: workers on loopback, each starting from
its own weights, train exactly as one device would with the same global batch."""

import contextlib
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jobs
import numpy as np
import pytest
from conftest import cpus
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
    square_and_task,
)

import kmirror
from kmirror import cluster
from kmirror._core.launching import rendezvous

HERE = Path(__file__).parent
PYTHON = sys.executable
#: A bound for a hang, not a measure: the feature job takes about 300 s alone here, and up to
#: twice that while the other test process and its jobs share the 2 cores.
TIMEOUT = 1200


def launch(script: list[str], workers: int = 2, timeout: int = TIMEOUT):
    return [
        PYTHON,
        "-m",
        "kmirror.launch",
        "--workers",
        str(workers),
        "--timeout",
        str(timeout),
        *script,
    ]


@functools.cache
def job(devices_per_worker: int, folder: str) -> list[dict]:
    # With one device per worker (2 replicas, one per process): the feature matrix, the first
    # scenarios and the real models; with two (4 replicas): every other scenario.
    parts = "real_models,features" if devices_per_worker == 1 else "rest"
    script = [str(HERE / "multi_process_job.py"), folder, parts, "--reducer", "ring"]
    script += ["--devices", str(devices_per_worker)]
    return jobs.results(launch(script), Path(folder), 2, TIMEOUT + 30)


@pytest.fixture(scope="module", params=[1, 2], ids=["1-device-per-worker", "2-devices-per-worker"])
def layouts(request, tmp_path_factory):
    """Both jobs, for what both run: the first fit and evaluation before any fit."""
    return request.param, launched(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """The job with 2 devices per worker, which runs every scenario."""
    return 2, launched(2, tmp_path_factory)


def launched(devices_per_worker: int, tmp_path_factory) -> list[dict]:
    """The 2-worker job with `devices_per_worker` replicas each, run once per session."""
    folder = tmp_path_factory.getbasetemp() / f"ring-{devices_per_worker}"
    folder.mkdir(exist_ok=True)
    return job(devices_per_worker, str(folder))


@pytest.mark.parametrize("name", MULTI_PROCESS)
def test_two_workers_equal_single_device_for_every_feature(tmp_path_factory, name):
    assert_feature_equals_single_device(launched(1, tmp_path_factory), name)


def test_a_backup_holds_state_no_walk_finds_and_the_relaunch_resumes_it(tmp_path_factory):
    """A seed generator held by an object that is not a layer, backed up and resumed on 2
    workers of one device (`assert_backed_up_reached_state_equals_single_device`)."""
    assert_backed_up_reached_state_equals_single_device(launched(1, tmp_path_factory))


def test_a_weight_written_differently_raises_in_every_process(tmp_path_factory):
    assert_every_process_raised_for_a_diverged_weight(launched(1, tmp_path_factory))


def test_a_long_job_keeps_few_threads(tmp_path_factory):
    """After the feature matrix's thousands of collectives, a worker holds a few hundred threads,
    not one per collective of the last `timeout_seconds` (12,000 with a 120 s timeout)."""
    for rank in launched(1, tmp_path_factory):
        assert rank["threads"] < 600


def test_a_deep_model_and_the_transfer_learning_flow_equal_single_device(tmp_path_factory):
    """MobileNetV2 in float64 and the keras.io transfer-learning flow, on 2 workers of one
    device each, each starting from its own weights."""
    assert_real_models_equal_single_device(launched(1, tmp_path_factory))


def test_two_workers_equal_single_device(layouts):
    """Different initial weights per worker, SGD with momentum, an uneven final batch (3*33+2)."""
    assert_scenario_equals_single_device(layouts[1], "numpy")


@pytest.mark.parametrize("scenario", ["tf.data", "xla", "multi_io"])
def test_two_workers_equal_single_device_with_other_input_and_models(workers, scenario):
    assert_scenario_equals_single_device(workers[1], scenario)


def assert_scenario_equals_single_device(ranks, scenario):
    model, history = reference(scenario)
    assert_equal_across_ranks(ranks, scenario)
    for rank in ranks:
        assert max_weight_difference(model, Weights(rank[scenario]["weights"])) < 1e-5
        assert_same_history(history, rank[scenario]["history"])


@pytest.mark.parametrize(
    "scenario", ["shard", "shard, shuffled", "rows", "local batches", "own step, shard"]
)
def test_sharded_input_equals_single_device(workers, scenario):
    """Each worker holds only its rows of every global batch (kmirror.data.shard, in order or
    shuffled with a seed; a RowDataset; a dataset sharded by hand, kmirror.data.local_batches;
    a model's own train_step on kmirror.data.shard's dataset), split again over its devices: the
    training of one device on the global batches."""
    assert_sharded_input_equals_single_device(workers[1], scenario)


def test_each_worker_loads_only_its_rows(workers):
    assert_each_process_loads_only_its_rows(workers[1])


def test_chief_replicas_and_global_evaluate_and_predict(layouts):
    devices, ranks = layouts
    assert [r["numpy"]["is_chief"] for r in ranks] == [True, False]
    assert [r["numpy"]["num_replicas"] for r in ranks] == [2 * devices] * 2
    assert [r["numpy"]["reducer"] for r in ranks] == ["ring", "ring"]
    model, _ = reference("numpy")
    x, y = dense_data()
    expected_predict = model.predict(x, batch_size=10, verbose=0)
    for rank in ranks:
        np.testing.assert_allclose(
            rank["numpy"]["evaluate"], model.evaluate(x, y, batch_size=7, verbose=0), rtol=1e-5
        )
        np.testing.assert_allclose(rank["numpy"]["predict"], expected_predict, atol=1e-5)


def test_evaluate_and_predict_before_any_fit_use_the_chief_weights(layouts):
    assert_chief_weights_before_any_fit(layouts[1])


def test_own_test_step_and_predict_step_equal_single_device(workers):
    assert_own_evaluation_equals_single_device(workers[1])


def test_later_epochs_and_fits_do_not_retrace_the_step(workers):
    """Traced once per batch shape; every process seeded alike once, at the first fit (seeding
    again would clear TensorFlow's kernel caches and rebuild the step at every fit)."""
    _, ranks = workers
    for rank in ranks:
        counts = rank["traces"]["after each fit"]  # 3 fits of 2 shuffled epochs
        assert 1 <= counts[0] <= 2 and counts == [counts[0]] * 3, counts
        assert rank["traces"]["seedings"] == 1


def test_shuffled_epochs_see_every_sample_once(workers):
    _, ranks = workers
    for rank in ranks:
        loss, accuracy = rank["shuffled"]["evaluate"]
        np.testing.assert_allclose(rank["shuffled"]["history"]["loss"], [loss, loss], rtol=1e-5)
        np.testing.assert_allclose(rank["shuffled"]["history"]["accuracy"], [accuracy] * 2)


def consecutive_free_ports(count: int) -> int:
    """The first of `count` consecutive ports free on loopback now, from where the launcher picks
    free ports (below the kernel's ephemeral range: no other process's bind to port 0 takes them
    before the tasks bind them)."""
    below = range(rendezvous._LOWEST, rendezvous._ephemeral_start() - count)
    for first in random.sample(below, 100):
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError("no consecutive free ports on loopback")


def test_a_slurm_job_step_of_two_tasks_equals_single_device(tmp_path):
    """`srun -n 2` on one node, its environment set by hand: each task joins as the worker of its
    SLURM_PROCID (no TF_CONFIG, no launcher), and the job trains as one device."""
    slurm = {
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "KMIRROR_SLURM_PORT": str(consecutive_free_ports(2)),
    }
    environment = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    tasks = [
        subprocess.Popen(
            [PYTHON, str(HERE / "multi_process_job.py"), str(tmp_path), "--reducer", "ring"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=HERE.parent,
            env={**environment, **slurm, "SLURM_PROCID": str(task)},
        )
        for task in range(2)
    ]
    try:
        outputs = [task.communicate(timeout=TIMEOUT)[0] for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    ranks = jobs.rank_results(tmp_path, 2)
    assert [r["numpy"]["is_chief"] for r in ranks] == [True, False]
    assert [r["numpy"]["num_replicas"] for r in ranks] == [2, 2]
    assert_chief_weights_before_any_fit(ranks)
    assert_scenario_equals_single_device(ranks, "numpy")


def test_launch_run_in_ring_mode_returns_every_workers_result():
    results = kmirror.launch.run(square_and_task, n=2, mode="ring", args=(3,), timeout=120)
    assert results == [(9, 0, True), (9, 1, False)]


MISMATCHED = """
import json, os, sys
import kmirror
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
kmirror.devices.simulate(index + 1)
kmirror.cluster.connect()
sys.path.insert(0, {tests!r})
from models import dense_model
kmirror.wrap(dense_model(), reducer="ring")
"""


def test_workers_with_different_device_counts_fail_clearly_without_hanging(tmp_path):
    script = tmp_path / "mismatched.py"
    script.write_text(MISMATCHED.format(tests=str(HERE)))
    done = subprocess.run(
        launch([str(script)], timeout=120), capture_output=True, text=True, timeout=150
    )
    assert done.returncode not in (0, 124), "it must fail by itself, not at the launch's timeout"
    assert "timeout: the job ran longer" not in done.stdout + done.stderr
    assert "every worker must use the same number of local devices; the workers have 1, 2" in (
        done.stdout
    )


SLOW = """
import json, os, sys, time
import kmirror
kmirror.cluster.connect()
sys.path.insert(0, {tests!r})
import keras
from models import dense_data, dense_model
model = kmirror.wrap(dense_model(), reducer="ring")
x, y = dense_data(n=20000)
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
class Mark(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:  # written whole, then renamed: the test never reads it half-written
            pid = os.path.join({folder!r}, "pid%d" % index)
            with open(pid + ".partial", "w") as f:
                f.write(str(os.getpid()))
            os.replace(pid + ".partial", pid)
        time.sleep(0.01)
model.fit(x, y, batch_size=32, epochs=100, verbose=0, callbacks=[Mark()])
"""


def test_a_killed_worker_makes_the_other_fail_with_a_message(tmp_path):
    """Workers started by hand (no launcher to stop them): the survivor notices by itself."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW.format(tests=str(HERE), folder=str(tmp_path)))
    environments = kmirror._core.launching.rendezvous.tf_config_environment(2)
    processes = [
        subprocess.Popen(
            [PYTHON, str(script)],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for env in environments
    ]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid1").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (tmp_path / "pid1").exists(), "worker 1 never started training"
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
        # The survivor ends by itself (one that waits forever fails here instead of hanging CI).
        output, _ = processes[0].communicate(timeout=120)
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert processes[0].returncode != 0
    assert "PeerLost" in output and "another worker of the job stopped" in output


JOINED_BY_WRAP = """
import numpy as np
import keras
import kmirror


def unbuilt():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def compiled(model):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
    return model


rng = np.random.default_rng(0)
x, y = rng.normal(size=(70, 8)).astype("float32"), rng.integers(0, 3, size=70)
# No kmirror.cluster.connect(): TensorFlow has not started (nothing is built or compiled yet).
model = compiled(kmirror.wrap(unbuilt(), reducer="ring"))
history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
plain = compiled(unbuilt())
expected = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
pairs = zip(model.get_weights(), plain.get_weights())
weights = max(float(np.max(np.abs(a - b))) for a, b in pairs)
logs = max(abs(a - b) for k in expected for a, b in zip(history[k], expected[k]))
print("RESULT", model.num_replicas, weights, logs)
"""


def test_wrap_joins_the_tf_config_cluster_itself_before_tensorflow_starts(tmp_path):
    """A script that wraps its model before building or compiling it (TensorFlow not started)
    joins the cluster TF_CONFIG describes without calling `kmirror.cluster.connect()`."""
    script = tmp_path / "joined_by_wrap.py"
    script.write_text(JOINED_BY_WRAP)
    done = subprocess.run(
        launch([str(script)], timeout=240), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    results = [line.split()[-3:] for line in done.stdout.splitlines() if "RESULT" in line]
    assert len(results) == 2, done.stdout[-3000:]
    for replicas, weights, logs in results:
        assert int(replicas) == 2, "each worker joined the job of 2"
        assert float(weights) < 1e-6 and float(logs) < 1e-6


SPEC = {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]}


@pytest.mark.parametrize(
    "spec, task_type, task_id, match",
    [
        (SPEC, "worker", None, "task_id is missing"),
        (SPEC, "worker", 2, r"task_id=2 is out of range: job 'worker' has 2 task\(s\)"),
        (SPEC, "ps", 0, "task_type 'ps' is not a job of the cluster"),
        ({"ps": ["127.0.0.1:1"]}, "ps", 0, "at most one 'chief'"),
        ("worker:1111", "worker", 0, "cluster_spec must be a dict"),
    ],
)
def test_cluster_spec_mistakes_are_named(spec, task_type, task_id, match):
    with pytest.raises(ValueError, match=match):
        kmirror.wrap(
            dense_model(), reducer="ring", cluster_spec=spec, task_type=task_type, task_id=task_id
        )


def test_cluster_spec_forms_and_the_chief_rule():
    import tensorflow as tf

    for form in (SPEC, tf.train.ClusterSpec(SPEC), tf.train.ClusterSpec(SPEC).as_cluster_def()):
        described = cluster.describe(form, "worker", 1)
        assert described.num_workers == 2 and not described.is_chief
    assert cluster.describe(SPEC, "worker", 0).is_chief
    with_chief = {"chief": ["127.0.0.1:3"], **SPEC}
    assert cluster.describe(with_chief, "chief", 0).is_chief
    assert not cluster.describe(with_chief, "worker", 0).is_chief


def test_devices_together_with_a_cluster_spec():
    with pytest.raises(ValueError, match="devices cannot be given together with cluster_spec"):
        kmirror.wrap(
            dense_model(),
            reducer="ring",
            devices=cpus(2),
            cluster_spec=SPEC,
            task_type="worker",
            task_id=0,
        )


def test_in_process_reducers_across_workers_are_refused(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": SPEC, "task": {"type": "worker", "index": 0}})
    )
    for name in ("hierarchical_copy", "one_device", "horovod"):
        with pytest.raises(ValueError, match="does not run across workers.*'ring'"):
            kmirror.wrap(dense_model(), reducer=name)


def test_joining_a_cluster_after_tensorflow_started_says_to_connect_first():
    with pytest.raises(RuntimeError, match="must run before TensorFlow starts"):
        kmirror.wrap(
            dense_model(), reducer="ring", cluster_spec=SPEC, task_type="worker", task_id=0
        )


def test_a_tf_config_not_joined_after_tensorflow_started_says_where_to_connect(monkeypatch):
    """Ray Train sets TF_CONFIG in each worker; a loop that builds its model before joining gets
    the place of `kmirror.cluster.connect()` (before TensorFlow starts, wrap joins by itself)."""
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": SPEC, "task": {"type": "worker", "index": 0}})
    )
    model = dense_model()
    with pytest.raises(RuntimeError, match="at the top of train_loop_per_worker") as error:
        kmirror.wrap(model, reducer="ring")
    assert "Call kmirror.cluster.connect() first thing in the script" in str(error.value)
    model.fit(*dense_data(), epochs=1, verbose=0)  # untouched: it trains on one device


def test_processes_whose_own_batches_differ_in_number_are_refused(workers):
    assert_uneven_local_batches_are_refused(workers[1])
