"""Models users train, kmirror against native MirroredStrategy: ResNet50 and MobileNetV2.

Each side trains `keras.applications.<model>(weights=None)` on 32 x 32 images, global batch 64,
on 2 simulated devices, with Adam: kmirror wraps the model built outside any scope
(`kmirror.wrap`, which mirrors its variables in place); native MirroredStrategy builds the model
in its scope. Every run is a fresh child process (TensorFlow's own allocator on the CPU,
`TF_CPU_ALLOCATOR_USE_BFC=true`); the sides' children alternate, `--runs` each, and each ratio is
of the medians:

- `wrap_first_step`: from before the model is built to the end of its first training step
  (building, wrapping or the strategy's scope, tracing, the first step);
- `step_time`: the median time of the steps after the first;
- `peak_memory`: the peak of the memory TensorFlow's allocator held for tensors.

Writes `"real_models": {"resnet50": {"step_time": r, "peak_memory": r, "wrap_first_step": r,
...}, "mobilenet_v2": {...}}` to benchmarks/results.json (the absolute figures beside them).

    python benchmarks/bench_real_models.py [--runs 3] [--steps 8]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

MODELS = {"resnet50": "ResNet50", "mobilenet_v2": "MobileNetV2"}
SIDES = ("kmirror", "native")
BATCH, SIZE, DEVICES = 64, 32, 2


def child(side: str, model_key: str, steps: int) -> None:
    """Trains one side for `steps` steps and prints its timings and peak memory as JSON."""
    import kmirror

    devices = kmirror.devices.simulate(DEVICES)
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.random((steps * BATCH, SIZE, SIZE, 3), dtype=np.float32)
    y = rng.integers(0, 10, steps * BATCH)

    def build():
        keras.utils.set_random_seed(0)
        model = getattr(keras.applications, MODELS[model_key])(
            weights=None, input_shape=(SIZE, SIZE, 3), classes=10
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    ends = []
    start = time.perf_counter()
    if side == "kmirror":
        model = kmirror.wrap(build(), reducer="hierarchical_copy", devices=devices)
    else:
        strategy = tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.HierarchicalCopyAllReduce()
        )
        with strategy.scope():
            model = build()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[Steps()])
    later = [b - a for a, b in zip(ends[1:], ends[2:])]
    common.print_peak_memory(
        first_step_s=ends[0] - start,
        step_s=statistics.median(later),
        tensor_peak_mib=common.tensor_peak_mib(devices),
    )


def measured(side: str, model_key: str, steps: int) -> dict[str, float]:
    arguments = ["--child", side, "--model", model_key, "--steps", str(steps)]
    env = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
    return common.measured_in_child(__file__, arguments, timeout=1200, env=env)


def main():
    args = common.options(__doc__, runs=3, steps=8, model="")
    if args.child:
        return child(args.child, args.model, args.steps)
    results = {}
    for key in MODELS:
        runs = {side: [] for side in SIDES}
        for _ in range(args.runs):
            for side in SIDES:
                runs[side].append(measured(side, key, args.steps))

        def median(side, name, runs=runs):
            return statistics.median(run[name] for run in runs[side])

        figures = {
            name: {side: median(side, name) for side in SIDES}
            for name in ("first_step_s", "step_s", "tensor_peak_mib", "peak_mib")
        }

        def ratio(name, figures=figures):
            return round(figures[name]["kmirror"] / figures[name]["native"], 4)

        results[key] = {
            "wrap_first_step": ratio("first_step_s"),
            "step_time": ratio("step_s"),
            "peak_memory": ratio("tensor_peak_mib"),
            "peak_rss": ratio("peak_mib"),
            **{
                f"{side}_{name}": round(figures[name][side], 3)
                for name in figures
                for side in SIDES
            },
        }
        print(key, results[key], flush=True)
    import kmirror

    kmirror.devices.simulate(DEVICES)
    results["setup"] = {
        "models": list(MODELS.values()),
        "image": [SIZE, SIZE, 3],
        "global_batch": BATCH,
        "replicas": DEVICES,
        "runs_per_side": args.runs,
        "steps": args.steps,
        "machine": common.machine(),
    }
    common.update_results("real_models", results)
    print(f"wrote {common.RESULTS}")


if __name__ == "__main__":
    main()
