"""kmirror's horovod reducer against a hand-written Horovod training loop, in one 2-process job.

Hand-written: the same model and global batch, each rank taking its half of every batch from a
tf.data pipeline, a `tf.function` step with `hvd.grouped_allreduce` of the gradients,
`optimizer.apply`, and the loss and accuracy tracked per rank and averaged over the ranks at the
end of the epoch, the way Horovod's TensorFlow examples train. Both sides alternate epoch by epoch
in the same processes, one core each; rank 0 reports the medians.

For scale, the same run also times plain Keras `fit` against the same hand-written loop on one
process without Horovod (`"keras_fit_vs_loop"`): what Keras' own training loop costs per step.

Writes `"wrapper_overhead": {"horovod": kmirror_time / handwritten_time}` to results.json.

    python benchmarks/bench_horovod.py [--rounds 7] [--samples 8192]
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


def handwritten(samples: int, horovod: bool = True):
    """A training loop written by hand (with Horovod, or on one process without it); returns a
    function that trains one epoch and returns its seconds per step."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    model, x, y = common.model_and_data(samples)
    common.compile_model(model)
    size, rank = (hvd.size(), hvd.rank()) if horovod else (1, 0)
    if horovod:
        hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    optimizer, loss_fn = model.optimizer, model.loss
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)

    mean_loss, accuracy = keras.metrics.Mean(), keras.metrics.SparseCategoricalAccuracy()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            y_pred = model(xb, training=True)
            loss = loss_fn(yb, y_pred)
        grads = tape.gradient(loss, model.trainable_variables)
        if horovod:
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply(grads, model.trainable_variables)
        mean_loss.update_state(loss)
        accuracy.update_state(yb, y_pred)

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    data = data.map(lambda xb, yb: (xb[rows], yb[rows]))

    def epoch():
        start = time.perf_counter()
        for metric in (mean_loss, accuracy):
            metric.reset_state()
        for xb, yb in data:
            step(xb, yb)
        logs = tf.stack([mean_loss.result(), accuracy.result()])
        if horovod:
            hvd.allreduce(logs, op=hvd.Average)
        return (time.perf_counter() - start) / (samples // BATCH)

    return epoch


def child(samples: int, rounds: int, out: str) -> None:
    import kmirror

    model, x, y = common.model_and_data(samples)
    wrapped = kmirror.wrap(common.compile_model(model), reducer="horovod")
    sides = {
        "kmirror": lambda: common.seconds_per_step(wrapped, x, y, BATCH),
        "handwritten": handwritten(samples),
    }
    for run in sides.values():  # warm-up: tracing
        run()
    medians = common.interleaved(sides, rounds)
    plain, x, y = common.model_and_data(samples)
    common.compile_model(plain)
    keras_sides = {
        "keras_fit": lambda: common.seconds_per_step(plain, x, y, BATCH),
        "loop": handwritten(samples, horovod=False),
    }
    for run in keras_sides.values():
        run()
    medians.update(common.interleaved(keras_sides, rounds))
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

    medians = common.run_job(__file__, "horovod", args.rounds, args.samples)
    common.record_overhead("horovod", medians, "handwritten", processes=2)
    common.update_results("keras_fit_vs_loop", round(medians["keras_fit"] / medians["loop"], 4))


if __name__ == "__main__":
    main()
