"""What the experiment trackers' runs of a job hold: an MLflow file store's runs and W&B's
offline runs, each as its metrics' (step, value) pairs."""

import json
import os
import struct
from pathlib import Path

#: The environment of a process using the trackers with local stores alone: MLflow's file store
#: allowed, and neither MLflow's usage reports nor W&B's error reports (each looks a host up).
OFFLINE = {
    "MLFLOW_ALLOW_FILE_STORE": "true",
    "DO_NOT_TRACK": "true",
    "WANDB_ERROR_REPORTING": "false",
    "WANDB_SILENT": "true",
}
os.environ.update(OFFLINE)  # this process's too (it reads the stores)

#: A W&B run file: a 7-byte header, then records in blocks of 32 KiB, each record split into
#: chunks with a 7-byte header of their own (checksum, length, kind), as LevelDB's log writes.
WANDB_MAGIC, BLOCK, CHUNK_HEADER = b":W&B", 32768, 7
WHOLE, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def mlflow_runs(store: Path) -> list[dict]:
    """Each run in the MLflow file store `store`, of any experiment: {metric: [(step, value)]}."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.as_uri())
    experiments = [e.experiment_id for e in client.search_experiments()]
    return [
        {
            key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in run.data.metrics
        }
        for run in client.search_runs(experiments)
    ]


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == WANDB_MAGIC, f"{path} is not a W&B run file"
    position, chunks = CHUNK_HEADER, b""
    while position + CHUNK_HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < CHUNK_HEADER:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + CHUNK_HEADER])
        if kind not in (WHOLE, FIRST, MIDDLE, LAST):
            break
        chunks += data[position + CHUNK_HEADER : position + CHUNK_HEADER + length]
        position += CHUNK_HEADER + length
        if kind in (WHOLE, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_runs(folder: Path) -> list[dict]:
    """Each offline W&B run under `folder` (a `wandb.init(dir=...)`): {metric: [(step, value)]},
    the step being Keras' epoch (`WandbMetricsLogger` logs "epoch/<name>")."""
    runs = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        metrics = {}
        for record in _records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            for key, value in row.items():
                if key.startswith("epoch/") and key != "epoch/epoch":
                    metrics.setdefault(key.removeprefix("epoch/"), []).append(
                        (row["epoch/epoch"], value)
                    )
        runs.append(metrics)
    return runs
