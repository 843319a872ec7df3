"""kmirror's sharded input against a hand-written `dataset.shard(size, rank)` loop, on an
input-bound pipeline, in one 2-process job per reducer (horovod, ring).

The pipeline maps every element through expensive per-element work (a few hundred element-wise
operations on a 784-vector), which dominates the step of a small model. kmirror:
`kmirror.data.shard(indices, BATCH, map_fn=load)` and `fit` with the global batch. Hand-written:
the Horovod convention, `indices.shard(size, rank).map(load).batch(BATCH // size)` and a
`tf.function` step that all-reduces the gradients (Horovod: `hvd.grouped_allreduce`; ring: the
same pipeline through `distribute_datasets_from_function` and `strategy.run` in the job's
MultiWorkerMirroredStrategy), tracking loss and accuracy. Both sides alternate epoch by epoch in
the same processes, one core each; the chief reports the medians.

Writes `"input_sharding": {"horovod": r, "ring": r}` (kmirror time per step / hand-written) to
results.json.

    python benchmarks/bench_input_sharding.py [--rounds 5] [--samples 4096]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

BATCH = 128
#: Element-wise operations per element: the per-element work that makes the pipeline input-bound.
WORK = 300


def loader(x, y):
    """The expensive per-element work: row `i`, passed through WORK element-wise operations."""
    import tensorflow as tf

    def load(i):
        row = tf.gather(x, i)
        for _ in range(WORK):
            row = tf.math.sin(row) + 0.5
        return row, tf.gather(y, i)

    return load


def small_model(samples: int):
    import keras

    _, x, y = common.model_and_data(samples)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((784,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    return common.compile_model(model), x, y


def kmirror_side(reducer: str, samples: int):
    import tensorflow as tf

    import kmirror

    model, x, y = small_model(samples)
    wrapped = kmirror.wrap(model, reducer=reducer)
    data = kmirror.data.shard(tf.data.Dataset.range(samples), BATCH, map_fn=loader(x, y))
    epoch = common.timed_epoch(lambda: wrapped.fit(data, epochs=1, verbose=0), samples // BATCH)
    return wrapped, epoch


def handwritten_horovod(samples: int):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    model, x, y = small_model(samples)
    size, rank = hvd.size(), hvd.rank()
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    data = tf.data.Dataset.range(samples).shard(size, rank)
    data = data.map(loader(x, y), num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH // size)
    data = data.prefetch(tf.data.AUTOTUNE)
    epoch = common.horovod_training(model)
    return common.timed_epoch(lambda: epoch(data), samples // BATCH)


def handwritten_ring(strategy, samples: int):
    import tensorflow as tf

    with strategy.scope():
        model, x, y = small_model(samples)

    def pipeline(context):
        data = tf.data.Dataset.range(samples)
        data = data.shard(context.num_input_pipelines, context.input_pipeline_id)
        data = data.map(loader(x, y), num_parallel_calls=tf.data.AUTOTUNE)
        return data.batch(context.get_per_replica_batch_size(BATCH)).prefetch(tf.data.AUTOTUNE)

    data = strategy.distribute_datasets_from_function(pipeline)
    epoch = common.strategy_training(strategy, model, BATCH)
    return common.timed_epoch(lambda: epoch(data), samples // BATCH)


def child(mode: str, samples: int, rounds: int, out: str) -> None:
    import kmirror

    joined = kmirror.cluster.connect() if mode == "ring" else None
    wrapped, ours = kmirror_side(mode, samples)
    if mode == "ring":
        theirs = handwritten_ring(joined.strategy, samples)
    else:
        theirs = handwritten_horovod(samples)
    sides = {"kmirror": ours, "handwritten": theirs}
    medians = common.interleaved(sides, rounds, warm_up=True)
    common.write_from_chief(out, medians, wrapped.is_chief)


def main():
    args = common.options(__doc__, rounds=5, samples=4096, mode="horovod")
    if args.child:
        return child(args.mode, args.samples, args.rounds, args.child)

    ratios, details = {}, {}
    for mode in ("horovod", "ring"):
        arguments = common.command_line(rounds=args.rounds, samples=args.samples, mode=mode)
        medians = common.run_job(__file__, arguments, mode=mode)
        ratios[mode] = round(medians["kmirror"] / medians["handwritten"], 4)
        details[mode] = {f"{side}_ms_per_step": round(1e3 * t, 3) for side, t in medians.items()}
        print(f"input_sharding {mode}: time x{ratios[mode]:.3f}  {details[mode]}")
    common.update_results("input_sharding", ratios)
    common.update_results(
        "input_sharding_details",
        {**details, "batch": BATCH, "processes": 2, "work_per_element": WORK},
    )


if __name__ == "__main__":
    main()
