"""kmirror's horovod reducer against hand-written Horovod training, in one 2-process job.

Horovod's own Keras API does not run on Keras 3, so the native equivalent is written by hand, the
way a Keras user would: a Keras model whose `train_step` takes its rank's half of the batch,
all-reduces the gradients with `hvd.grouped_allreduce`, applies them, and logs what one device
would log, as kmirror does: the loss summed over the ranks and the metrics of the whole batch
(predictions gathered from every rank), trained with `fit` (`"handwritten"`, the baseline of the
ratio). Reported beside it: the same step logging each rank's own metrics instead, which trains
alike but logs other numbers (`"handwritten_local_logs"`), and a bare `tf.function` loop over a
`tf.data` pipeline, the way Horovod's TensorFlow examples train (`"loop"`). All sides alternate
epoch by epoch in the same processes, one core each; rank 0 reports the medians.

Plain Keras `fit` against the same bare loop on one process without Horovod
(`"keras_fit_vs_loop"`) shows what Keras' own training loop costs per step.

Writes `"wrapper_overhead": {"horovod": kmirror_time / handwritten_time}` to results.json.

    python benchmarks/bench_horovod.py [--rounds 7] [--samples 8192]
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

BATCH = 256


def handwritten_train_step(samples: int, global_logs: bool = True):
    """Keras fit of a model whose train_step does Horovod's all-reduce by hand; returns a function
    that trains one epoch and returns its seconds per step.

    With `global_logs`, the step logs what one device would, as kmirror does: the loss summed over
    the ranks and the metrics of the whole batch (predictions gathered from every rank). Without,
    each rank logs the metrics of its own half.
    """
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    size, rank = hvd.size(), hvd.rank()

    class HorovodModel(keras.Model):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.loss_tracker = keras.metrics.Mean(name="loss")

        def call(self, x, training=False):
            return self.inner(x, training=training)

        def train_step(self, data):
            x, y = data
            rows = tf.shape(x)[0]
            start, stop = rows * rank // size, rows * (rank + 1) // size
            with tf.GradientTape() as tape:
                y_pred = self(x[start:stop], training=True)
                loss = self.loss(y[start:stop], y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
            self.optimizer.apply(grads, self.trainable_variables)
            if not global_logs:
                self.loss_tracker.update_state(loss)
                return self.compute_metrics(x[start:stop], y[start:stop], y_pred)
            share = tf.cast(stop - start, loss.dtype) / tf.cast(rows, loss.dtype)
            self.loss_tracker.update_state(hvd.allreduce(loss * share, op=hvd.Sum))
            return self.compute_metrics(x, y, hvd.allgather(y_pred))

    inner, x, y = common.model_and_data(samples)
    model = common.compile_model(HorovodModel(inner))
    model.build((None, 784))
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    return lambda: common.seconds_per_step(model, x, y, BATCH)


def handwritten(samples: int, horovod: bool = True):
    """A training loop written by hand (with Horovod, or on one process without it); returns a
    function that trains one epoch and returns its seconds per step."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    model, x, y = common.model_and_data(samples)
    common.compile_model(model)
    size, rank = (hvd.size(), hvd.rank()) if horovod else (1, 0)
    if horovod:
        hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    data = data.map(lambda xb, yb: (xb[rows], yb[rows]))
    epoch = common.horovod_training(model, horovod)
    return common.timed_epoch(lambda: epoch(data), samples // BATCH)


def child(samples: int, rounds: int, out: str) -> None:
    import kmirror

    model, x, y = common.model_and_data(samples)
    wrapped = kmirror.wrap(common.compile_model(model), reducer="horovod")
    sides = {
        "kmirror": lambda: common.seconds_per_step(wrapped, x, y, BATCH),
        "handwritten": handwritten_train_step(samples),
        "handwritten_local_logs": handwritten_train_step(samples, global_logs=False),
        "loop": handwritten(samples),
    }
    for run in sides.values():  # warm-up: tracing
        run()
    medians = common.interleaved(sides, rounds)
    plain, x, y = common.model_and_data(samples)
    common.compile_model(plain)
    keras_sides = {
        "keras_fit": lambda: common.seconds_per_step(plain, x, y, BATCH),
        "single_loop": handwritten(samples, horovod=False),
    }
    for run in keras_sides.values():
        run()
    medians.update(common.interleaved(keras_sides, rounds))
    if wrapped.is_chief:
        with open(out, "w") as f:
            json.dump(medians, f)


def main():
    args = common.options(__doc__, rounds=7, samples=8192)
    if args.child:
        return child(args.samples, args.rounds, args.child)

    medians = common.run_job(
        __file__, common.command_line(rounds=args.rounds, samples=args.samples)
    )
    common.record_overhead("horovod", medians, "handwritten", processes=2)
    common.update_results(
        "keras_fit_vs_loop", round(medians["keras_fit"] / medians["single_loop"], 4)
    )


if __name__ == "__main__":
    main()
