"""Gradient compression under Horovod: time per step and the effect on the final loss.

Gradients can travel as float16 or bfloat16 instead of float32: half the bytes on the wire, at
the cost of precision. In one 2-process job this benchmark times a training step of the benchmark
model with each compression (interleaved, medians), and trains a digits classifier for a number
of epochs with each, reporting the final loss beside the float32 run's.

Writes `"compression"` to benchmarks/results.json.

    python benchmarks/bench_compression.py [--rounds 5] [--samples 8192] [--epochs 20]
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

BATCH = 256
COMPRESSIONS = ("none", "fp16", "bf16")


def final_loss(compression: str, epochs: int) -> float:
    import keras

    import kmirror

    x, y = common.digits()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    common.compile_model(model)
    model = kmirror.wrap(model, reducer=kmirror.reducers.Horovod(compression=compression))
    history = model.fit(x, y, batch_size=128, epochs=epochs, shuffle=False, verbose=0)
    return history.history["loss"][-1]


def child(samples: int, rounds: int, epochs: int, out: str) -> None:
    import kmirror

    steps = {}
    for compression in COMPRESSIONS:
        model, x, y = common.model_and_data(samples)
        reducer = kmirror.reducers.Horovod(compression=compression)
        model = kmirror.wrap(common.compile_model(model), reducer=reducer)
        common.seconds_per_step(model, x, y, BATCH)  # warm-up: tracing
        steps[compression] = lambda m=model, x=x, y=y: common.seconds_per_step(m, x, y, BATCH)
    medians = common.interleaved(steps, rounds)
    losses = {compression: final_loss(compression, epochs) for compression in COMPRESSIONS}
    if model.is_chief:
        with open(out, "w") as f:
            json.dump({"seconds": medians, "losses": losses}, f)


def main():
    args = common.options(__doc__, rounds=5, samples=8192, epochs=20)
    if args.child:
        return child(args.samples, args.rounds, args.epochs, args.child)

    arguments = common.command_line(samples=args.samples, rounds=args.rounds, epochs=args.epochs)
    measured = common.run_job(__file__, arguments)
    seconds, losses = measured["seconds"], measured["losses"]
    results = {
        "processes": 2,
        "global_batch": BATCH,
        "ms_per_step": {c: round(1e3 * t, 3) for c, t in seconds.items()},
        "time_vs_fp32": {c: round(t / seconds["none"], 4) for c, t in seconds.items()},
        "final_loss": {c: round(v, 6) for c, v in losses.items()},
        "final_loss_vs_fp32": {c: round(v / losses["none"], 5) for c, v in losses.items()},
        "loss_model": f"digits, Dense 64 + 10, batch 128, {args.epochs} epochs",
        "machine": common.machine(),
    }
    common.update_results("compression", results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
