"""Ray Train: `TensorflowTrainer` runs a kmirror job (tests/ray_job.py) on a local Ray cluster of 2
CPU workers, reducer="ring" on the TF_CONFIG Ray sets; a worker killed inside epoch 2 and Ray's
`FailureConfig(max_failures=1)` start the worker group again, which resumes from kmirror's backup
and ends as one device trained without a stop. Ray's `ReportCheckpointCallback` reports one
device's losses from every worker, and its checkpoint from the chief alone."""

import json
import pickle
import sys
import tempfile
from pathlib import Path

import jobs
import keras
import numpy as np
from models import BATCH, dense_data, dense_model

HERE = Path(__file__).parent


def test_ray_train_runs_a_kmirror_job_that_resumes_after_a_worker_dies(tmp_path):
    done = jobs.run([sys.executable, str(HERE / "ray_job.py"), str(tmp_path), "--kill"], 900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert (tmp_path / "killed").exists(), "worker 1 exited inside epoch 2"
    assert not (tmp_path / "backup").exists(), "the backup is removed after the normal end"
    result = pickle.loads((tmp_path / "result.pkl").read_bytes())
    assert result["files"] == [".metadata.json", "model.keras"], "the last epoch's checkpoint"
    reports = [
        [json.loads(line) for line in (tmp_path / f"reports-{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    ]

    x, y = dense_data()
    reference = dense_model("adam", seed=1)
    keras.utils.set_random_seed(7)
    expected = reference.fit(x, y, batch_size=BATCH, epochs=3, shuffle=True, verbose=0).history
    with tempfile.NamedTemporaryFile(suffix=".keras") as file:
        file.write(result["model"])
        file.flush()
        trained = keras.saving.load_model(file.name)
    for a, b in zip(trained.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # The relaunched fit resumed inside epoch 2: its first epoch logs the batches it trained.
    history = reports[0][-1]["metrics"]["history"]
    assert len(history["loss"]) == 2
    for key, values in history.items():
        np.testing.assert_allclose(values[1:], expected[key][-1:], rtol=1e-6, atol=1e-6)
    # Every report of each worker: epoch 1's end, the relaunch's ends of epochs 2 and 3, then
    # the loop's own; checkpoints from the chief only, the same (global) losses from each.
    chief, worker = reports
    assert [r["checkpoint"] for r in chief] == [True, True, True, False]
    assert [r["checkpoint"] for r in worker] == [False] * 4
    assert chief[-1]["metrics"]["chief"] is True and worker[-1]["metrics"]["rank"] == 1
    losses = [r["metrics"]["loss"] for r in chief[:3]]
    assert losses == [r["metrics"]["loss"] for r in worker[:3]]
    assert result["metrics"]["loss"] == losses[2], "the metrics reported with the checkpoint"
    np.testing.assert_allclose(losses[0], expected["loss"][0], rtol=1e-6)
    assert losses[1] == history["loss"][0], "the relaunch's epoch 2: the batches it trained"
    np.testing.assert_allclose(losses[2], expected["loss"][2], rtol=1e-6)
