"""Scaling: samples per second at 1, 2 and 4 replicas for a fixed per-replica batch.

In one process, replicas are `--devices`-many simulated devices (or GPUs where present), with
each in-process reducer; across processes, Horovod ranks started by kmirror.launch, one thread
each. The global batch grows with the replicas (per-replica batch times replicas), as it does
when a job gains devices. On a CPU-only machine the replicas share the same cores, so this shows
kmirror's cost of replication, not a speed-up; on GPUs it shows the speed-up.

Also records which in-process reducer was fastest at the largest replica count beside the one
`reducer="auto"` picks on this machine.

Writes `"scaling"` to benchmarks/results.json.

    python benchmarks/bench_scaling.py [--replicas 1 2 4] [--per-replica 64] [--rounds 3]
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

IN_PROCESS = ("one_device", "hierarchical_copy")


def horovod_child(per_replica: int, rounds: int, samples: int, out: str) -> None:
    import kmirror

    model, x, y = common.model_and_data(samples)
    model = kmirror.wrap(common.compile_model(model), reducer="horovod")
    batch = per_replica * model.num_replicas
    step = {"step": lambda: common.seconds_per_step(model, x, y, batch)}
    common.write_from_chief(out, common.interleaved(step, rounds, warm_up=True), model.is_chief)


def horovod_samples_per_second(n: int, per_replica: int, rounds: int, samples: int) -> float:
    arguments = common.command_line(rounds=rounds, per_replica=per_replica, samples=samples)
    step = common.run_job(__file__, arguments, n=n)["step"]
    return per_replica * n / step


def main():
    args = common.options(__doc__, replicas=[1, 2, 4], per_replica=64, rounds=3, samples=8192)
    if args.child:
        return horovod_child(args.per_replica, args.rounds, args.samples, args.child)

    import kmirror

    gpus = kmirror.devices.gpu_count()
    devices = kmirror.devices.gpus() if gpus else kmirror.devices.simulate(max(args.replicas))
    reducers = IN_PROCESS + (("nccl",) if gpus >= 2 else ())
    counts = [n for n in args.replicas if n <= len(devices)]
    runs = {}
    for reducer in reducers:
        for n in counts:
            if n == 1 and reducer != reducers[0]:
                continue  # one replica: no reduction, the same for every reducer
            model, x, y = common.model_and_data(args.samples)
            name = "single device" if n == 1 else reducer
            model = kmirror.wrap(common.compile_model(model), reducer, devices=devices[:n])
            batch = args.per_replica * n
            common.seconds_per_step(model, x, y, batch)  # warm-up: tracing
            runs[(name, n)] = lambda m=model, x=x, y=y, b=batch: common.seconds_per_step(m, x, y, b)
    medians = common.interleaved(runs, args.rounds)
    in_process: dict = {}
    for (name, n), seconds in medians.items():
        in_process.setdefault(name, {})[str(n)] = round(args.per_replica * n / seconds, 1)
    horovod = {
        str(n): round(horovod_samples_per_second(n, args.per_replica, args.rounds, args.samples), 1)
        for n in args.replicas
    }
    largest = str(max(counts))
    fastest = max(reducers, key=lambda r: in_process[r].get(largest, 0.0))
    results = {
        "per_replica_batch": args.per_replica,
        "devices": "GPU" if gpus else "simulated CPU devices (sharing the cores)",
        "samples_per_second": {"in_process": in_process, "horovod": horovod},
        "auto": {
            "replicas": int(largest),
            "fastest_in_process": fastest,
            "auto_picks": kmirror.reducers.auto(devices[: int(largest)]),
        },
        "machine": common.machine(),
    }
    common.update_results("scaling", results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
