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

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

BATCH = 256


def handwritten(strategy, samples: int):
    import tensorflow as tf

    with strategy.scope():
        model, x, y = common.model_and_data(samples)
        common.compile_model(model)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    data = strategy.experimental_distribute_dataset(data.with_options(options))
    epoch = common.strategy_training(strategy, model, BATCH)
    return common.timed_epoch(lambda: epoch(data), samples // BATCH)


def child(samples: int, rounds: int, out: str) -> None:
    import kmirror

    joined = kmirror.cluster.connect()
    model, x, y = common.model_and_data(samples)
    wrapped = kmirror.wrap(common.compile_model(model), reducer="ring")
    sides = {
        "kmirror": lambda: common.seconds_per_step(wrapped, x, y, BATCH),
        "handwritten": handwritten(joined.strategy, samples),
    }
    medians = common.interleaved(sides, rounds, warm_up=True)
    common.write_from_chief(out, medians, wrapped.is_chief)


def main():
    args = common.options(__doc__, rounds=7, samples=8192)
    if args.child:
        return child(args.samples, args.rounds, args.child)

    arguments = common.command_line(rounds=args.rounds, samples=args.samples)
    medians = common.run_job(__file__, arguments, mode="ring")
    common.record_overhead("ring", medians, "handwritten", workers=2)


if __name__ == "__main__":
    main()
