"""All-reduce throughput of every reducer that runs here, by message size, beside the memory-copy
bandwidth of the same machine (the physical limit of moving bytes within one host).

Algorithm bandwidth is bytes / time; bus bandwidth is algbw * 2(n-1)/n, the nccl-tests convention
that makes numbers comparable across replica counts (a ring all-reduce moves 2(n-1)/n of the data
through each replica). In-process reducers run on `--devices` simulated devices in this process;
horovod runs in 2 processes started by kmirror.launch.

Writes `"allreduce_throughput"` to benchmarks/results.json.

    python benchmarks/bench_allreduce.py [--devices 2] [--max-mib 64] [--repeats 20]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

IN_PROCESS = ("one_device", "hierarchical_copy")


def sizes(max_mib: int) -> list[int]:
    """Message sizes in bytes: 4 KiB, 16 KiB, ... up to max_mib MiB."""
    out, size = [], 4 * 1024
    while size <= max_mib * 1024 * 1024:
        out.append(size)
        size *= 4
    return out


def time_call(fn, repeats: int) -> float:
    fn()  # warm-up: tracing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(size: int, seconds: float, n: int) -> dict:
    algbw = size / seconds / 1e9
    return {
        "bytes": size,
        "us": round(seconds * 1e6, 1),
        "algbw_GBps": round(algbw, 3),
        "busbw_GBps": round(algbw * 2 * (n - 1) / n, 3),
    }


def in_process(name: str, n: int, max_mib: int, repeats: int) -> list[dict]:
    import tensorflow as tf

    from kmirror import reducers

    reducer = reducers.get(name, devices=[f"/cpu:{i}" for i in range(n)])
    reducer.bind(devices=[f"/cpu:{i}" for i in range(n)])
    strategy = reducer.strategy
    rows = []
    for size in sizes(max_mib):
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx, size=size: tf.fill([size // 4], float(ctx.replica_id_in_sync_group))
        )

        @tf.function
        def reduce(values=values):
            return strategy.run(
                lambda t: tf.distribute.get_replica_context().all_reduce("sum", t), args=(values,)
            )

        def wait(reduce=reduce):
            return [t[:1].numpy() for t in strategy.experimental_local_results(reduce())]

        seconds = time_call(wait, repeats)
        rows.append(row(size, seconds, n))
    return rows


def horovod_child(max_mib: int, repeats: int, out: str) -> None:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rows = []
    for size in sizes(max_mib):
        value = tf.fill([size // 4], float(hvd.rank()))
        reduce = tf.function(lambda value=value: hvd.allreduce(value, op=hvd.Sum))
        seconds = time_call(lambda reduce=reduce: reduce()[:1].numpy(), repeats)
        rows.append(row(size, seconds, hvd.size()))
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def memory_copy_GBps(max_mib: int, repeats: int) -> float:
    """Bytes copied per second (read + write counted once, as a message moved) by numpy."""
    import numpy as np

    source = np.ones(max_mib * 1024 * 1024 // 4, dtype=np.float32)
    target = np.empty_like(source)
    seconds = time_call(lambda: np.copyto(target, source), repeats)
    return round(source.nbytes / seconds / 1e9, 3)


def main():
    args = common.options(__doc__, devices=2, max_mib=64, repeats=20)
    if args.child:
        return horovod_child(args.max_mib, args.repeats, args.child)

    import kmirror

    kmirror.devices.simulate(args.devices)
    table = {"memory_copy_GBps": memory_copy_GBps(args.max_mib, args.repeats), "reducers": {}}
    for name in IN_PROCESS:
        table["reducers"][name] = {
            "replicas": args.devices,
            "rows": in_process(name, args.devices, args.max_mib, args.repeats),
        }
    arguments = common.command_line(max_mib=args.max_mib, repeats=args.repeats)
    rows = common.run_job(__file__, arguments, one_core=False)
    table["reducers"]["horovod"] = {"replicas": 2, "rows": rows}
    table["machine"] = common.machine()
    common.update_results("allreduce_throughput", table)

    print(f"memory copy: {table['memory_copy_GBps']} GB/s")
    print("| reducer | bytes | time (us) | algbw GB/s | busbw GB/s |")
    print("|---|---|---|---|---|")
    for name, result in table["reducers"].items():
        for r in result["rows"]:
            cells = (name, f"{r['bytes']:,}", r["us"], r["algbw_GBps"], r["busbw_GBps"])
            print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
