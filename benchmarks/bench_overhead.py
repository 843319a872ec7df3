"""kmirror's fit step against the hand-written native equivalent, side by side in one run.

Native: the same model built inside `tf.distribute.MirroredStrategy(devices, cross_device_ops)`'s
scope and trained with Keras' own `fit` (the batch divides by the replica count, so native runs).
kmirror: the same model wrapped with the same devices and cross-device ops. Timings are
interleaved (kmirror, native, kmirror, ...) and the medians compared; peak memory is measured in
separate processes (one per side), since one process cannot tell two peaks apart.

Writes `"wrapper_overhead": {reducer: kmirror_time / native_time}` and
`"wrapper_peak_memory": {reducer: kmirror_peak / native_peak}` to benchmarks/results.json.

    python benchmarks/bench_overhead.py [--devices 2] [--rounds 7] [--samples 8192]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

REDUCERS = ("one_device", "hierarchical_copy")
BATCH = 256


def native_ops(reducer: str):
    import tensorflow as tf

    return {
        "one_device": tf.distribute.ReductionToOneDevice(),
        "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce(),
        "nccl": tf.distribute.NcclAllReduce(),
    }[reducer]


def build(side: str, reducer: str, devices: list[str], samples: int):
    import tensorflow as tf

    import kmirror

    if side == "native":
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=native_ops(reducer))
        with strategy.scope():
            model, x, y = common.model_and_data(samples)
            common.compile_model(model)
        return model, x, y
    model, x, y = common.model_and_data(samples)
    return kmirror.wrap(common.compile_model(model), reducer=reducer, devices=devices), x, y


def one_side(side: str, reducer: str, n: int, samples: int, steps: int) -> None:
    """Child process: train `steps` epochs of one side and print its peak memory."""
    import kmirror

    devices = kmirror.devices.simulate(n)
    model, x, y = build(side, reducer, devices, samples)
    for _ in range(steps):
        common.seconds_per_step(model, x, y, BATCH)
    common.print_peak_memory()


def peak_memory(side: str, reducer: str, n: int, samples: int) -> float:
    arguments = ["--child", side, reducer, "--devices", str(n), "--samples", str(samples)]
    return common.peak_memory_of(__file__, arguments, timeout=600)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "REDUCER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return one_side(*args.child, args.devices, args.samples, steps=3)

    import kmirror

    devices = kmirror.devices.simulate(args.devices)
    reducers = REDUCERS + (("nccl",) if kmirror.devices.gpu_count() >= 2 else ())
    overhead, memory, details = {}, {}, {}
    for reducer in reducers:
        sides = {
            side: build(side, reducer, devices, args.samples) for side in ("kmirror", "native")
        }
        for model, x, y in sides.values():  # warm-up: tracing
            common.seconds_per_step(model, x, y, BATCH)
        medians = common.interleaved(
            {side: (lambda s=s: common.seconds_per_step(*s, BATCH)) for side, s in sides.items()},
            rounds=args.rounds,
        )
        peaks = {side: peak_memory(side, reducer, args.devices, args.samples) for side in sides}
        overhead[reducer] = round(medians["kmirror"] / medians["native"], 4)
        memory[reducer] = round(peaks["kmirror"] / peaks["native"], 4)
        details[reducer] = {
            "kmirror_ms_per_step": round(1e3 * medians["kmirror"], 3),
            "native_ms_per_step": round(1e3 * medians["native"], 3),
            "kmirror_peak_mib": round(peaks["kmirror"], 1),
            "native_peak_mib": round(peaks["native"], 1),
        }
        print(
            f"{reducer}: time x{overhead[reducer]:.3f}, peak memory x{memory[reducer]:.3f}  "
            f"{details[reducer]}"
        )

    common.update_results("wrapper_overhead", overhead)
    common.update_results("wrapper_peak_memory", memory)
    common.update_results(
        "wrapper_overhead_details",
        {
            "replicas": args.devices,
            "global_batch": BATCH,
            "rounds": args.rounds,
            "machine": common.machine(),
            **details,
        },
    )
    print(f"wrote {common.RESULTS}")


if __name__ == "__main__":
    main()
