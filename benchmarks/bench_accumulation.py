"""Gradient accumulation: one reduction per update, and what a step costs with and without it.

The same model trains with `gradient_accumulation_steps=4` and without, on the same in-process
replicas, timed side by side (interleaved rounds, medians). A reducer that counts its
`reduce_gradients` calls as they run (not as they are traced) shows how many reductions the
accumulating run made per micro-step.

Writes `"accumulation": {"steps": k, "micro_steps": m, "reductions": r,
"reductions_per_micro_step": r / m, "time_ratio": time_k / time_1, ...}` to
benchmarks/results.json.

    python benchmarks/bench_accumulation.py [--devices 2] [--rounds 5] [--samples 8192]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

BATCH = 256
STEPS = 4


def counting_reducer():
    """A hierarchical_copy reducer that counts the reductions it runs."""
    import tensorflow as tf

    import kmirror

    class Counting(kmirror.reducers.HierarchicalCopy):
        def __init__(self):
            super().__init__()
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False)

        def reduce_gradients(self, gradients):
            self.count.assign_add(1)  # runs each time a reduction runs
            return super().reduce_gradients(gradients)

    return Counting()


def build(devices, samples: int, accumulation: int | None):
    import keras

    import kmirror

    model, x, y = common.model_and_data(samples)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=accumulation),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    reducer = counting_reducer()
    return kmirror.wrap(model, reducer=reducer, devices=devices), x, y, reducer


def main():
    args = common.options(__doc__, devices=2, rounds=5, samples=8192)

    import kmirror

    devices = kmirror.devices.simulate(args.devices)
    sides = {
        "accumulating": build(devices, args.samples, STEPS),
        "every_step": build(devices, args.samples, None),
    }
    for model, x, y, _ in sides.values():  # warm-up: tracing
        common.seconds_per_step(model, x, y, BATCH)
    medians = common.interleaved(
        {name: (lambda s=s: common.seconds_per_step(*s[:3], BATCH)) for name, s in sides.items()},
        rounds=args.rounds,
    )

    model, x, _, reducer = sides["accumulating"]
    micro_steps = (1 + args.rounds) * (len(x) // BATCH)
    reductions = int(reducer.count.numpy())
    result = {
        "steps": STEPS,
        "micro_steps": micro_steps,
        "reductions": reductions,
        "reductions_per_micro_step": round(reductions / micro_steps, 4),
        "time_ratio": round(medians["accumulating"] / medians["every_step"], 4),
        "accumulating_ms_per_step": round(1e3 * medians["accumulating"], 3),
        "every_step_ms_per_step": round(1e3 * medians["every_step"], 3),
        "replicas": args.devices,
        "global_batch": BATCH,
        "machine": common.machine(),
    }
    print(result)
    common.update_results("accumulation", result)
    print(f"wrote {common.RESULTS}")


if __name__ == "__main__":
    main()
