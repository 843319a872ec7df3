"""A multi-process job for the tests: each rank starts from its own random weights (seeded by its
rank), trains several models and writes what it ended with to OUT/rank<r>.pkl.

    python -m kmirror.launch -n 2 multi_process_job.py OUT [PARTS]           (or horovodrun)
    python -m kmirror.launch --workers 2 multi_process_job.py OUT [PARTS] --reducer ring --devices 2

It always runs the first scenarios (evaluate and predict before any fit, the first fit on numpy
arrays), then the PARTS named (comma-separated): "real_models" (a deep model and the
transfer-learning flow), "rest" (every other scenario), "features" (the feature matrix).
"""

import argparse
import os
import pickle
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lean_start  # noqa: E402, F401 - before Keras

import kmirror  # noqa: E402

PARTS = ("real_models", "rest", "features")
parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("parts", nargs="?", default="")
parser.add_argument("--reducer", default="horovod")
parser.add_argument("--devices", type=int, help="simulated devices per worker (ring)")
OPTIONS = parser.parse_args()
ASKED = {part for part in OPTIONS.parts.split(",") if part}
if ASKED - set(PARTS):
    parser.error(f"unknown parts {sorted(ASKED - set(PARTS))}; choose from {', '.join(PARTS)}")
REDUCER = OPTIONS.reducer
if REDUCER == "ring":
    if OPTIONS.devices:
        kmirror.devices.simulate(OPTIONS.devices)
    kmirror.cluster.connect()

import global_steps  # noqa: E402
import keras  # noqa: E402
import state_steps  # noqa: E402
import tensorflow as tf  # noqa: E402
from features import FEATURES, MULTI_PROCESS, rows_seen, trained_state  # noqa: E402
from features import fit as features_fit  # noqa: E402
from models import (  # noqa: E402
    BATCH,
    Rows,
    dense_data,
    dense_model,
    multi_io_data,
    multi_io_model,
)
from multi_process import LOCAL_BATCH, sharded_elements  # noqa: E402
from own_steps import own_evaluation  # noqa: E402
from real_models import DEEP, precision, transfer_flow, transfer_model  # noqa: E402

EPOCHS = 3


def fit(model, *args, **kwargs):
    return model.fit(*args, batch_size=BATCH, shuffle=False, verbose=0, **kwargs).history


def main(out):
    rank = kmirror.cluster.process()[0]
    seed = 1 + 10 * rank  # different initial weights on every rank
    x, y = dense_data()
    results = {}
    # Before any fit, evaluate and predict already use the chief's weights on every process.
    model = kmirror.wrap(dense_model("sgd", seed=seed), reducer=REDUCER)
    results["before fit"] = {
        "evaluate": model.evaluate(x, y, batch_size=7, verbose=0),
        "predict": model.predict(x, batch_size=10, verbose=0),
    }
    model = kmirror.wrap(dense_model("sgd", seed=seed), reducer=REDUCER)
    results["predict first"] = model.predict(x, batch_size=10, verbose=0)

    model = kmirror.wrap(dense_model("sgd", seed=seed), reducer=REDUCER)
    history = fit(model, x, y, epochs=EPOCHS)
    results["numpy"] = {
        "weights": model.get_weights(),
        "history": history,
        "evaluate": model.evaluate(x, y, batch_size=7, verbose=0),
        "predict": model.predict(x, batch_size=10, verbose=0),
        "is_chief": model.is_chief,
        "num_replicas": model.num_replicas,
        "reducer": model.reducer,
    }
    if "real_models" in ASKED:
        run_real_models(results, seed)
    if "rest" in ASKED:
        run_rest(results, seed, x, y)
    if "features" in ASKED:
        run_features(results)
    save(out, rank, results)


def run_rest(results, seed, x, y):
    """Every other scenario."""

    # A model's own test_step and predict_step.
    model = kmirror.wrap(own_evaluation(), reducer=REDUCER)
    results["own evaluation"] = {
        "evaluate": model.evaluate(x, y, batch_size=33, verbose=0),
        "predict": model.predict(x, batch_size=33, verbose=0),
    }

    model = kmirror.wrap(dense_model("sgd", seed=seed), reducer="auto")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    history = model.fit(data, epochs=EPOCHS, verbose=0).history
    results["tf.data"] = {"weights": model.get_weights(), "history": history}

    run_sharded_input(results, seed)

    model = kmirror.wrap(dense_model("sgd", seed=seed, jit_compile=True), reducer=REDUCER)
    history = fit(model, x, y, epochs=EPOCHS)
    results["xla"] = {
        "weights": model.get_weights(),
        "history": history,
        "replica_jit_compile": model.replica_jit_compile,
    }

    xs, ys, weights = multi_io_data()
    model = kmirror.wrap(multi_io_model("sgd", seed=seed), reducer=REDUCER)
    history = fit(model, xs, ys, sample_weight=weights, epochs=EPOCHS)
    results["multi_io"] = {"weights": model.get_weights(), "history": history}

    # Gradients handed to Horovod one by one; and the small ones (here: under 256 bytes) packed
    # into 3 buffers, the others sent as they are (default: 1 buffer, under 1 MiB).
    for num_packs in (0, 3) if REDUCER == "horovod" else ():
        reducer = kmirror.reducers.Horovod(num_packs=num_packs)
        model = kmirror.wrap(multi_io_model("sgd", seed=seed), reducer=reducer)
        default = kmirror.reducers.packing.PACK_BELOW_BYTES
        kmirror.reducers.packing.PACK_BELOW_BYTES = 256
        history = fit(model, xs, ys, sample_weight=weights, epochs=EPOCHS)
        kmirror.reducers.packing.PACK_BELOW_BYTES = default
        results[f"multi_io, num_packs={num_packs}"] = {
            "weights": model.get_weights(),
            "history": history,
        }

    for compression in ("fp16", "bf16") if REDUCER == "horovod" else ():
        reducer = kmirror.reducers.Horovod(compression=compression, sparse_as_dense=True)
        model = kmirror.wrap(dense_model("sgd", seed=seed), reducer=reducer)
        history = fit(model, x, y, epochs=EPOCHS)
        results[compression] = {"weights": model.get_weights(), "history": history}

    # Traces of the training step: one per batch shape, none more in later epochs or fits; and
    # TensorFlow seeded once (seeding clears its kernel caches: the step is built again).
    traces, seedings = [], []
    trace, seed_all = kmirror._core.step.train, keras.utils.set_random_seed

    def counting(*args, **kwargs):
        traces.append(1)
        return trace(*args, **kwargs)

    def seeding(value):
        seedings.append(value)
        return seed_all(value)

    model = kmirror.wrap(dense_model("sgd", seed=seed), reducer=REDUCER)
    kmirror._core.step.train, keras.utils.set_random_seed = counting, seeding
    counts = []
    for _ in range(3):
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=True, verbose=0)
        counts.append(len(traces))
    kmirror._core.step.train, keras.utils.set_random_seed = trace, seed_all
    results["traces"] = {"after each fit": counts, "seedings": len(seedings)}

    # Shuffled epochs with a frozen model: every sample seen once per epoch, by one rank.
    model = dense_model(seed=seed, compiled=False)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model = kmirror.wrap(model, reducer=REDUCER)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=True, verbose=0).history
    results["shuffled"] = {"history": history, "evaluate": model.evaluate(x, y, verbose=0)}


def run_sharded_input(results, seed):
    """Datasets that hold each process's rows only: kmirror.data.shard and a RowDataset
    (counting the rows each process loads), and a dataset sharded by hand, Horovod style."""
    x, y = dense_data()
    keras.utils.set_random_seed(0)  # every process builds the same shuffled pipeline
    for name, elements in sharded_elements().items():
        loaded = []

        def load(i, loaded=loaded):
            count = tf.py_function(lambda i: loaded.append(int(i)) or i, [i], tf.int64)
            count = tf.ensure_shape(count, [])  # py_function outputs have no static shape
            return tf.gather(x, count), tf.gather(y, count)

        model = kmirror.wrap(dense_model("sgd", seed=seed), reducer=REDUCER)
        data = kmirror.data.shard(elements, BATCH, map_fn=load)
        history = model.fit(data, epochs=EPOCHS, verbose=0).history
        weights = model.get_weights()
        loaded.clear()  # the rows one pass over the data (an evaluate) loads here
        evaluate = model.evaluate(data, verbose=0, return_dict=True)
        results[name] = {
            "weights": weights,
            "history": history,
            "loaded": list(loaded),
            "evaluate": evaluate,
        }
    # A model's own train_step on kmirror.data.shard's dataset: the step sees the global batch,
    # joined from the processes' rows (BatchNormalization on uneven rows, float64).
    xs, ys, _ = global_steps.labelled()
    with precision(global_steps.FLOATX):
        model = kmirror.wrap(global_steps.batch_norm_step(), reducer=REDUCER)
        data = kmirror.data.shard(
            tf.data.Dataset.range(len(xs)),
            BATCH,
            map_fn=lambda i: (tf.gather(xs, i), tf.gather(ys, i)),
        )
        history = model.fit(data, epochs=EPOCHS, verbose=0).history
    results["own step, shard"] = {"weights": model.get_weights(), "history": history}

    # A RowDataset: each process loads its rows of each batch.
    rows = Rows(x, y)
    model = kmirror.wrap(dense_model("sgd", seed=seed), reducer=REDUCER)
    history = model.fit(rows, epochs=EPOCHS, shuffle=False, verbose=0).history
    weights = model.get_weights()
    rows.loaded.clear()  # the rows one pass (an evaluate) loads here
    evaluate = model.evaluate(rows, verbose=0, return_dict=True)
    results["rows"] = {
        "weights": weights,
        "history": history,
        "loaded": list(rows.loaded),
        "evaluate": evaluate,
    }

    index, count = kmirror.data.process()
    mine = tf.data.Dataset.from_tensor_slices((x, y)).shard(count, index).batch(LOCAL_BATCH)
    model = kmirror.wrap(dense_model("sgd", seed=seed), reducer=REDUCER)
    history = model.fit(kmirror.data.local_batches(mine), epochs=EPOCHS, verbose=0).history
    results["local batches"] = {"weights": model.get_weights(), "history": history}

    # Processes whose own datasets yield different numbers of batches (3 and 5): refused before
    # training, on every process, instead of waiting for each other.
    uneven = tf.data.Dataset.from_tensor_slices((x, y)).take(40 + 30 * index).batch(LOCAL_BATCH)
    model = kmirror.wrap(dense_model("sgd", seed=seed), reducer=REDUCER)
    try:
        model.fit(kmirror.data.local_batches(uneven), epochs=1, verbose=0)
        results["uneven local batches"] = "trained"
    except ValueError as error:
        results["uneven local batches"] = str(error)


def run_real_models(results, seed):
    """A deep model and a keras.io example's (float64), and the keras.io transfer-learning flow,
    each rank starting from its own weights (tests/real_models.py)."""
    for name in ("MobileNetV2", "timeseries"):
        deep = DEEP[name]
        with precision(deep.floatx):
            model = kmirror.wrap(deep.build(seed=seed), reducer=REDUCER)
            history = deep.fit(model)
        results[f"deep {name}"] = {"weights": model.get_weights(), "history": history}
    model, base = transfer_model(seed=seed)
    wrapped = kmirror.wrap(model, reducer=REDUCER)
    history = transfer_flow(wrapped, base)
    results["transfer"] = {"weights": wrapped.get_weights(), "history": history}


def run_features(results):
    """The exactness matrix of tests/features.py."""
    for name in MULTI_PROCESS:
        feature = FEATURES[name]
        model = kmirror.wrap(feature.build(), reducer=REDUCER)
        history = features_fit(model, feature)
        results[f"feature {name}"] = {"weights": trained_state(model), "history": history}
    # A weight left at aggregation "none" that the replicas write differently (their row
    # counts, 16 and 17, each computing from its own rows): every process raises, at the same step.
    x, y = dense_data()
    model = kmirror.wrap(rows_seen("none"), reducer=REDUCER, sync_batch_norm=False)
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        results["diverged"] = "trained"
    except ValueError as error:
        results["diverged"] = str(error)
    run_backed_up_reached_state(results)
    # Threads the process holds after the matrix's thousands of collectives (Linux).
    results["threads"] = len(os.listdir("/proc/self/task"))


def run_backed_up_reached_state(results):
    """The gradient noise whose seed generator no walk finds (tests/state_steps.py), backed up
    every 2 batches: uninterrupted, and crashed inside its second epoch then resumed by a new
    model (the chief's folder alone holds the backup). A process of one replica (a Horovod rank,
    a ring worker of one device) finds the generator in its step, so the backup holds it."""
    feature = FEATURES["state_noisy_gradients"]
    folder = os.path.join(OPTIONS.out, "reached-backup")  # the chief's; the others read none
    whole = os.path.join(OPTIONS.out, "reached-whole")
    build = state_steps.noisy_gradients
    model = state_steps.fit_backed_up(kmirror.wrap(build(), reducer=REDUCER), feature, whole)
    results["reached state, whole"] = state_steps.everything(model)
    model = kmirror.wrap(build(), reducer=REDUCER)
    state_steps.fit_backed_up(model, feature, folder, crash=(1, 1))
    model = state_steps.fit_backed_up(kmirror.wrap(build(), reducer=REDUCER), feature, folder)
    results["reached state, resumed"] = state_steps.everything(model)


def save(out, rank, results):
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    print(f"rank {rank} done")


if __name__ == "__main__":
    main(OPTIONS.out)
