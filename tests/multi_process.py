"""What the multi-process tests (Horovod, multi-worker) share: the single-device reference of each
scenario of multi_process_job.py, and checks across ranks."""

import functools

import numpy as np
from models import BATCH, dense_data, dense_model, multi_io_data, multi_io_model

EPOCHS = 3  # as in multi_process_job.py


@functools.cache
def reference(scenario: str):
    x, y = dense_data()
    if scenario.startswith("multi_io"):
        xs, ys, weights = multi_io_data()
        model = multi_io_model("sgd")
        history = model.fit(
            xs, ys, sample_weight=weights, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
        )
    else:
        model = dense_model("sgd", jit_compile=scenario == "xla")
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model, history.history


def assert_equal_across_ranks(ranks, scenario):
    first, second = (r[scenario] for r in ranks)
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(a, b)
    assert first["history"] == second["history"]


class Weights:
    def __init__(self, weights):
        self.weights = weights

    def get_weights(self):
        return self.weights


def square_and_task(value):
    import json
    import os

    import kmirror

    return (
        value * value,
        json.loads(os.environ["TF_CONFIG"])["task"]["index"],
        kmirror.cluster.connected().is_chief,
    )
