"""Gradient fusion: step time on a model of many small layers, by how gradients are packed.

A model of 100 Dense layers of 64 units has 202 small gradients. Each all-reduce has a fixed cost,
so reducers pack gradients together first: TensorFlow's all-reduces by `num_packs`, Horovod by its
fusion buffer (`HOROVOD_FUSION_THRESHOLD` bytes). This benchmark times one training step of the
same model and global batch with:

- in one process (`--devices` simulated devices): `hierarchical_copy` with `num_packs` 0 (no
  packing: one all-reduce per gradient), 1, 2 and 4, and `one_device` (no packing option);
- under Horovod (2 processes): kmirror's packing (`num_packs` 1, 2 and 4), and without it
  (`num_packs=0`) Horovod's tensor fusion alone, or neither (fusion threshold 0).

and marks kmirror's defaults, so that each default can be checked against the best measured.
Writes `"fusion"` to benchmarks/results.json.

    python benchmarks/bench_fusion.py [--devices 2] [--rounds 7] [--samples 8192]
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

BATCH = 256
#: In-process settings: name -> (reducer, options). kmirror's default is the reducer's defaults.
IN_PROCESS = {
    "hierarchical_copy, no packing (num_packs=0)": ("hierarchical_copy", {"num_packs": 0}),
    "hierarchical_copy, num_packs=1 (default)": ("hierarchical_copy", {}),
    "hierarchical_copy, num_packs=2": ("hierarchical_copy", {"num_packs": 2}),
    "hierarchical_copy, num_packs=4": ("hierarchical_copy", {"num_packs": 4}),
    "one_device (no packing option)": ("one_device", {}),
}
#: Horovod settings: name -> (num_packs, HOROVOD_FUSION_THRESHOLD or None for Horovod's default).
HOROVOD = {
    "horovod, no packing, no fusion (num_packs=0, threshold 0)": (0, "0"),
    "horovod, Horovod's fusion only (num_packs=0)": (0, None),
    "horovod, num_packs=1": (1, None),
    "horovod, num_packs=2 (default)": (2, None),
    "horovod, num_packs=4": (4, None),
}


def horovod_child(samples: int, rounds: int, num_packs: int, out: str) -> None:
    import kmirror

    model, x, y = common.many_small_layers(samples)
    reducer = kmirror.reducers.Horovod(num_packs=num_packs)
    model = kmirror.wrap(common.compile_model(model), reducer=reducer)
    step = {"step": lambda: common.seconds_per_step(model, x, y, BATCH)}
    common.write_from_chief(out, common.interleaved(step, rounds, warm_up=True), model.is_chief)


def horovod_step(num_packs: int, threshold: str | None, samples: int, rounds: int) -> float:
    # Horovod reads its fusion threshold from the environment when it starts.
    if threshold is not None:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = threshold
    try:
        arguments = common.command_line(samples=samples, rounds=rounds, num_packs=num_packs)
        return common.run_job(__file__, arguments)["step"]
    finally:
        os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)


def summarise(times: dict[str, float]) -> dict:
    """Milliseconds per step, the best setting, and how far each default is from it."""
    best = min(times, key=times.get)
    rows = {name: round(1e3 * t, 3) for name, t in times.items()}
    defaults = {name: round(t / times[best], 4) for name, t in times.items() if "(default)" in name}
    return {"ms_per_step": rows, "best": best, "default_vs_best": defaults}


def main():
    args = common.options(__doc__, devices=2, rounds=7, samples=8192, num_packs=1)
    if args.child:
        return horovod_child(args.samples, args.rounds, args.num_packs, args.child)

    import kmirror

    devices = kmirror.devices.simulate(args.devices)
    settings = dict(IN_PROCESS)
    if kmirror.devices.gpu_count() >= 2:
        settings["nccl, no packing (num_packs=0)"] = ("nccl", {"num_packs": 0})
        settings["nccl, num_packs=1 (default)"] = ("nccl", {})
    models = {}
    for name, (reducer, options) in settings.items():
        model, x, y = common.many_small_layers(args.samples)
        model = kmirror.wrap(
            common.compile_model(model), reducer=reducer, devices=devices, **options
        )
        common.seconds_per_step(model, x, y, BATCH)  # warm-up: tracing
        models[name] = lambda model=model, x=x, y=y: common.seconds_per_step(model, x, y, BATCH)
    in_process = common.interleaved(models, args.rounds)
    horovod = {
        name: horovod_step(num_packs, threshold, args.samples, args.rounds)
        for name, (num_packs, threshold) in HOROVOD.items()
    }
    results = {
        "model": "100 Dense layers of 64 units (202 gradients)",
        "global_batch": BATCH,
        "in_process": {"replicas": args.devices, **summarise(in_process)},
        "horovod": {"processes": 2, **summarise(horovod)},
        "machine": common.machine(),
    }
    packed = in_process["hierarchical_copy, num_packs=1 (default)"]
    unpacked = in_process["hierarchical_copy, no packing (num_packs=0)"]
    results["in_process"]["packing_speedup"] = round(unpacked / packed, 4)
    packed = horovod["horovod, num_packs=2 (default)"]
    unpacked = horovod["horovod, no packing, no fusion (num_packs=0, threshold 0)"]
    results["horovod"]["packing_speedup"] = round(unpacked / packed, 4)
    common.update_results("fusion", results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
