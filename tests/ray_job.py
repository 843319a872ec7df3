"""Ray Train running a kmirror job: `TensorflowTrainer` with 2 workers on a local Ray cluster (CPU,
loopback), each wrapping its model with reducer="ring" (tests/test_ray.py).

    python ray_job.py OUT [--kill]

Each worker starts from its own weights (seeded by its rank) and trains the dense model of
tests/models.py for 3 epochs with kmirror's BackupAndRestore in OUT/backup and Ray Train's
`ReportCheckpointCallback` (a report at each epoch's end, with a checkpoint of the model), then
reports its history. With --kill, worker 1 exits after batch 2 of epoch 2 (once: OUT/killed marks
it) and Ray Train starts the worker group again (`FailureConfig(max_failures=1)`). Writes the
metrics of the last checkpoint, its files and its model file to OUT/result.pkl, and each report a
worker made (its metrics, whether it held a checkpoint) to OUT/reports-RANK.jsonl.
"""

import json
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Ray on this machine's loopback address only (as on a laptop: no cluster network).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train.tensorflow import TensorflowTrainer  # noqa: E402

EPOCHS = 3


def train_loop_per_worker(config):
    import kmirror

    kmirror.cluster.connect()  # the TF_CONFIG Ray Train set, before any model is built
    import keras
    from models import BATCH, dense_data, dense_model
    from ray.train.tensorflow.keras import ReportCheckpointCallback

    rank = ray.train.get_context().get_world_rank()
    out = Path(config["out"])
    ray.train.report = Recorded(ray.train.report, out / f"reports-{rank}.jsonl")
    callbacks = [
        kmirror.callbacks.BackupAndRestore(out / "backup", save_freq=2),
        ReportCheckpointCallback(),
    ]
    if config["kill"] and rank == 1 and not (out / "killed").exists():
        callbacks.append(Exit(out / "killed", epoch=1, batch=1))
    x, y = dense_data()
    model = kmirror.wrap(dense_model("adam", seed=1 + 10 * rank), reducer="ring")
    keras.utils.set_random_seed(7)  # every worker alike: they shuffle as one device
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0, callbacks=callbacks
    )
    metrics = {"history": history.history, "rank": rank, "chief": model.is_chief}
    ray.train.report(metrics)


class Recorded:
    """`ray.train.report`, each call noted in a file: the loss reported and whether a checkpoint
    went with it."""

    def __init__(self, report, file: Path):
        self.report, self.file = report, file

    def __call__(self, metrics, checkpoint=None, **kwargs):
        with open(self.file, "a") as f:
            f.write(json.dumps({"metrics": metrics, "checkpoint": checkpoint is not None}) + "\n")
        return self.report(metrics, checkpoint=checkpoint, **kwargs)


class Exit:
    """A Keras callback (made where Keras is imported) that ends the process after a batch."""

    def __new__(cls, marker: Path, epoch: int, batch: int):
        import keras

        class Exiting(keras.callbacks.Callback):
            def on_epoch_begin(self, number, logs=None):
                self.epoch = number

            def on_train_batch_end(self, number, logs=None):
                if self.epoch == epoch and number == batch:
                    marker.write_text("killed")
                    os._exit(1)

        return Exiting()


def main(out: Path, kill: bool) -> None:
    # Ray's sockets live in its folder, whose path must be short (AF_UNIX: 107 bytes).
    folder = tempfile.mkdtemp(prefix="kmirror-ray-")
    try:
        run(out, kill, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(out: Path, kill: bool, folder: str) -> None:
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=folder)
    trainer = TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config={"out": str(out), "kill": kill},
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(
            storage_path=str(out / "storage"),
            name="kmirror",
            failure_config=ray.train.FailureConfig(max_failures=1),
        ),
    )
    result = trainer.fit()
    with result.checkpoint.as_directory() as folder:
        files = sorted(os.listdir(folder))
        model = (Path(folder) / "model.keras").read_bytes()
    with open(out / "result.pkl", "wb") as f:
        pickle.dump({"metrics": result.metrics, "files": files, "model": model}, f)
    ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), kill="--kill" in sys.argv[2:])
