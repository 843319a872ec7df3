"""What the multi-process tests (Horovod, multi-worker) share: the single-device reference of each
scenario of multi_process_job.py, and checks across ranks."""

import functools
import tempfile

import global_steps
import numpy as np
from features import FEATURES, assert_same_logs, one_device
from models import (
    BATCH,
    Weights,
    assert_same_history,
    dense_data,
    dense_model,
    max_weight_difference,
    multi_io_data,
    multi_io_model,
)
from real_models import precision
from shared_cache import shared
from state_steps import everything, fit_backed_up, noisy_gradients

EPOCHS = 3  # as in multi_process_job.py
#: Each process's batch in the "local batches" scenario (the job's: one per process).
LOCAL_BATCH = 16


def sharded_elements() -> dict:
    """The row indices kmirror.data.shard takes in multi_process_job.py, by scenario (built after
    keras.utils.set_random_seed(0))."""
    import tensorflow as tf

    rows = tf.data.Dataset.range(dense_data()[0].shape[0])
    return {"shard": rows, "shard, shuffled": rows.shuffle(64, seed=5)}


def sharded_reference(scenario: str):
    """One device trained on the global batches of a sharded-input scenario: (model, history,
    the dataset of those batches)."""
    import keras
    import tensorflow as tf

    if scenario == "own step, shard":
        x, y, _ = global_steps.labelled()
        with precision(global_steps.FLOATX):
            model = global_steps.batch_norm_step()
            rows = tf.data.Dataset.range(len(x))
            data = rows.map(lambda i: (tf.gather(x, i), tf.gather(y, i))).batch(BATCH)
            return model, model.fit(data, epochs=EPOCHS, verbose=0).history, data
    x, y = dense_data()
    model = dense_model("sgd")
    if scenario == "local batches":  # step k: process 0's batch k, then process 1's
        parts = [np.arange(p, len(x), 2) for p in range(2)]
        order = []
        for k in range(0, len(parts[0]), LOCAL_BATCH):
            order += [i for part in parts for i in part[k : k + LOCAL_BATCH]]
        data = tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(2 * LOCAL_BATCH)
    else:  # a RowDataset ("rows") in order, as "shard"
        keras.utils.set_random_seed(0)
        rows = sharded_elements()["shard" if scenario == "rows" else scenario]
        data = rows.map(lambda i: (tf.gather(x, i), tf.gather(y, i))).batch(BATCH)
    history = model.fit(data, epochs=EPOCHS, verbose=0)
    return model, history.history, data


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


def assert_feature_equals_single_device(ranks, name):
    weights, history = one_device(name)
    model = Weights(weights)
    scenario = f"feature {name}"
    assert_equal_across_ranks(ranks, scenario)
    for rank in ranks:
        weights = Weights(rank[scenario]["weights"])
        assert len(weights.get_weights()) == len(model.get_weights())
        assert max_weight_difference(model, weights) < FEATURES[name].tolerance
        assert_same_logs(FEATURES[name], history, rank[scenario]["history"])


def backed_up_reference() -> list:
    """One device's uninterrupted run of the gradient noise backed up (`everything` of it),
    trained once per run."""

    def train():
        with tempfile.TemporaryDirectory() as folder:
            feature = FEATURES["state_noisy_gradients"]
            return everything(fit_backed_up(noisy_gradients(), feature, folder))

    return shared("backed-up-noisy-gradients", train)


def assert_backed_up_reached_state_equals_single_device(ranks):
    """A seed generator held by an object that is not a layer, in a model's own step, with
    kmirror's BackupAndRestore (tests/multi_process_job.py): uninterrupted, and crashed inside
    the second epoch then resumed, each equals one device's uninterrupted run (its generator's
    state too), in every process."""
    expected = backed_up_reference()
    for rank in ranks:
        for run in ("whole", "resumed"):
            got = rank[f"reached state, {run}"]
            assert len(got) == len(expected)
            for a, b in zip(expected, got):
                np.testing.assert_allclose(b, a, rtol=0, atol=1e-10)


def assert_every_process_raised_for_a_diverged_weight(ranks):
    """A weight left at aggregation "none" that the replicas wrote differently: every process
    raised the error naming the weight and the fix (none waits for the others)."""
    for rank in ranks:
        assert "rows_seen/seen, whose aggregation is 'none'" in rank["diverged"]
        assert "aggregation='sum'" in rank["diverged"]


def assert_real_models_equal_single_device(ranks):
    """A deep model and a keras.io example's in float64, and the transfer-learning flow, as on
    one device."""
    from real_models import DEEP, TRANSFER_TOLERANCE, deep_reference, transfer_reference

    for name in ("MobileNetV2", "timeseries"):
        weights, history = deep_reference(name)
        tolerance, scenario = DEEP[name].tolerance, f"deep {name}"
        assert_equal_across_ranks(ranks, scenario)
        for rank in ranks:
            trained = rank[scenario]
            assert max_weight_difference(Weights(weights), Weights(trained["weights"])) < tolerance
            assert_same_history(history, trained["history"], rtol=tolerance, atol=tolerance)
    weights, history, _ = transfer_reference()
    assert_equal_across_ranks(ranks, "transfer")
    for rank in ranks:
        trained = rank["transfer"]
        assert (
            max_weight_difference(Weights(weights), Weights(trained["weights"]))
            < TRANSFER_TOLERANCE
        )
        assert_same_history(
            history, trained["history"], rtol=TRANSFER_TOLERANCE, atol=TRANSFER_TOLERANCE
        )


def assert_chief_weights_before_any_fit(ranks):
    """Every process evaluates and predicts with the chief's initial weights (seed 1), though each
    built its model with its own seed."""
    model = dense_model("sgd")
    x, y = dense_data()
    expected_evaluate = model.evaluate(x, y, batch_size=7, verbose=0)
    expected_predict = model.predict(x, batch_size=10, verbose=0)
    for rank in ranks:
        np.testing.assert_allclose(rank["before fit"]["evaluate"], expected_evaluate, rtol=1e-5)
        np.testing.assert_allclose(rank["before fit"]["predict"], expected_predict, atol=1e-5)
        np.testing.assert_allclose(rank["predict first"], expected_predict, atol=1e-5)


def assert_own_evaluation_equals_single_device(ranks):
    """A model's own test_step and predict_step give the single-device values on every process."""
    from own_steps import own_evaluation

    model = own_evaluation()
    x, y = dense_data()
    expected_evaluate = model.evaluate(x, y, batch_size=33, verbose=0)
    expected_predict = model.predict(x, batch_size=33, verbose=0)
    for rank in ranks:
        np.testing.assert_allclose(rank["own evaluation"]["evaluate"], expected_evaluate, rtol=1e-5)
        np.testing.assert_allclose(rank["own evaluation"]["predict"], expected_predict, atol=1e-5)


def square_and_task(value):
    import json
    import os

    import kmirror

    return (
        value * value,
        json.loads(os.environ["TF_CONFIG"])["task"]["index"],
        kmirror.cluster.connected().is_chief,
    )


def assert_sharded_input_equals_single_device(ranks, scenario):
    model, history, data = sharded_reference(scenario)
    assert_equal_across_ranks(ranks, scenario)
    tolerance = 1e-10 if scenario == "own step, shard" else 1e-5  # float64, float32
    for rank in ranks:
        assert max_weight_difference(model, Weights(rank[scenario]["weights"])) < tolerance
        assert_same_history(history, rank[scenario]["history"], rtol=tolerance, atol=tolerance)
        if "evaluate" in rank[scenario]:
            expected = model.evaluate(data, verbose=0, return_dict=True)
            for name, value in expected.items():
                np.testing.assert_allclose(rank[scenario]["evaluate"][name], value, rtol=1e-5)


def assert_each_process_loads_only_its_rows(ranks):
    """In one pass over kmirror.data.shard's dataset or a RowDataset (global batches of 33, 33,
    33, 2 rows), process p loads only rows [p*B//2, (p+1)*B//2) of each batch: 49 and 52 of
    101, each row once over the job."""
    rows = dense_data()[0].shape[0]
    for scenario in ("shard", "shard, shuffled", "rows"):
        loaded = [rank[scenario]["loaded"] for rank in ranks]
        assert [len(part) for part in loaded] == [16 * 3 + 1, 17 * 3 + 1], scenario
        assert sorted(loaded[0] + loaded[1]) == list(range(rows)), scenario
    for scenario in ("shard", "rows"):
        in_order = ranks[0][scenario]["loaded"]
        assert sorted(in_order) == [*range(0, 16), *range(33, 49), *range(66, 82), 99]


def assert_uneven_local_batches_are_refused(ranks):
    for rank in ranks:
        message = rank["uneven local batches"]
        assert "yield 3, 5 batches (in process order)" in message, message
        assert "drop_remainder=True" in message and "steps_per_epoch" in message
