"""kmirror's ring reducer against a hand-written multi-worker loop, in one 2-worker job.

Hand-written: the same model built in the job's MultiWorkerMirroredStrategy scope, a distributed
tf.data pipeline, and a `tf.function` step that runs `strategy.run` with the loss averaged over the
global batch and `optimizer.apply_gradients` in replica context (the same collective all-reduce),
tracking loss and accuracy; the way TensorFlow's custom-training-loop tutorial trains. Both sides
alternate epoch by epoch in the same processes, one core each; worker 0 reports the medians.

Writes `"wrapper_overhead": {"ring": kmirror_time / handwritten_time}` to results.json.

    python benchmarks/bench_ring.py [--rounds 7] [--samples 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

BATCH = 256


def handwritten(strategy, samples: int):
    import keras
    import tensorflow as tf

    with strategy.scope():
        model, x, y = common.model_and_data(samples)
        common.compile_model(model)
        mean_loss, accuracy = keras.metrics.Mean(), keras.metrics.SparseCategoricalAccuracy()
    per_sample = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    optimizer = model.optimizer
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    data = strategy.experimental_distribute_dataset(data.with_options(options))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            y_pred = model(xb, training=True)
            loss = tf.nn.compute_average_loss(per_sample(yb, y_pred), global_batch_size=BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        mean_loss.update_state(loss * strategy.num_replicas_in_sync)
        accuracy.update_state(yb, y_pred)

    @tf.function
    def step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    def epoch():
        start = time.perf_counter()
        for metric in (mean_loss, accuracy):
            metric.reset_state()
        for xb, yb in data:
            step(xb, yb)
        mean_loss.result(), accuracy.result()
        return (time.perf_counter() - start) / (samples // BATCH)

    return epoch


def child(samples: int, rounds: int, out: str) -> None:
    import kmirror

    joined = kmirror.cluster.connect()
    model, x, y = common.model_and_data(samples)
    wrapped = kmirror.wrap(common.compile_model(model), reducer="ring")
    sides = {
        "kmirror": lambda: common.seconds_per_step(wrapped, x, y, BATCH),
        "handwritten": handwritten(joined.strategy, samples),
    }
    for run in sides.values():  # warm-up: tracing
        run()
    medians = common.interleaved(sides, rounds)
    if wrapped.is_chief:
        with open(out, "w") as f:
            json.dump(medians, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.samples, args.rounds, args.child)

    arguments = ["--rounds", str(args.rounds), "--samples", str(args.samples)]
    medians = common.run_job(__file__, arguments, mode="ring")
    common.record_overhead("ring", medians, "handwritten", workers=2)


if __name__ == "__main__":
    main()
