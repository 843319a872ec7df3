"""Turns benchmarks/results.json into PNG plots and markdown tables in docs/benchmarks.md.

The tables go between the `<!-- results -->` and `<!-- /results -->` markers of
docs/benchmarks.md (the text around them is kept) and also into benchmarks/results.md; the plots
into docs/img/benchmarks/. Figures quoted in the other pages sit between markers named after them
(`FIGURES`, e.g. `<!-- horovod-packing-gain -->5.66x<!-- /horovod-packing-gain -->`) and are
rewritten too (`benchmarks/markers.py`).

    python benchmarks/report.py
"""

from __future__ import annotations

import json
from pathlib import Path

import markers
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"
PAGE = ROOT / "docs" / "benchmarks.md"
PLOTS = ROOT / "docs" / "img" / "benchmarks"
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def figures(results: dict) -> dict[str, str]:
    """The figures the pages quote, by marker name."""
    found = {}
    if "fusion" in results:
        gain = results["fusion"]["horovod"]["packing_speedup"]
        found["horovod-packing-gain"] = f"{gain:.2f}x"
    return found


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def size_label(size: int) -> str:
    return f"{size // 1024} KiB" if size < 1024 * 1024 else f"{size // (1024 * 1024)} MiB"


def overhead(results: dict) -> str:
    ratios, details = results["wrapper_overhead"], results.get("wrapper_overhead_details", {})
    memory = results.get("wrapper_peak_memory", {})
    rows = []
    for reducer, ratio in ratios.items():
        d = details.get(reducer, {})
        times = ", ".join(
            f"{k.removesuffix('_ms_per_step')} {v} ms"
            for k, v in d.items()
            if k.endswith("_ms_per_step")
        )
        rows.append([reducer, f"{ratio:.3f}", memory.get(reducer, ""), times])
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(list(ratios), list(ratios.values()), color="tab:blue")
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.axhline(1.05, color="tab:red", linestyle="--", label="1.05")
    ax.set(ylabel="kmirror time / native time", title="Wrapper overhead per step")
    ax.legend()
    save(fig, "overhead.png")
    return (
        "### Wrapper overhead\n\n"
        + table(["reducer", "time ratio", "peak memory ratio", "median time per step"], rows)
        + "\n\n![wrapper overhead](img/benchmarks/overhead.png)\n"
    )


def allreduce(results: dict) -> str:
    section = results["allreduce_throughput"]
    copy = section["memory_copy_GBps"]
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = []
    for name, reducer in section["reducers"].items():
        sizes = [r["bytes"] for r in reducer["rows"]]
        ax.plot(sizes, [r["busbw_GBps"] for r in reducer["rows"]], "o-", label=name)
        for r in reducer["rows"]:
            rows.append([name, size_label(r["bytes"]), r["us"], r["algbw_GBps"], r["busbw_GBps"]])
    ax.axhline(copy, color="black", linestyle="--", label=f"memory copy {copy} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="bus bandwidth (GB/s)")
    ax.set_title("All-reduce bus bandwidth on 2 replicas")
    ax.legend()
    save(fig, "allreduce.png")
    return (
        f"### All-reduce throughput\n\nMemory-copy bandwidth of this machine: **{copy} GB/s**.\n\n"
        + table(["reducer", "message", "time (us)", "algbw GB/s", "busbw GB/s"], rows)
        + "\n\n![all-reduce bus bandwidth](img/benchmarks/allreduce.png)\n"
    )


def fusion(results: dict) -> str:
    section = results["fusion"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    text, rows = [], []
    for ax, key in zip(axes, ("in_process", "horovod")):
        part = section[key]
        names = list(part["ms_per_step"])
        ax.barh(names, [part["ms_per_step"][n] for n in names], color="tab:green")
        ax.set(xlabel="ms per step", title=key.replace("_", "-"))
        for name in names:
            rows.append([key.replace("_", "-"), name, part["ms_per_step"][name]])
        for name, ratio in part["default_vs_best"].items():
            text.append(f"- {key.replace('_', '-')}: default `{name}` at {ratio:.3f}x the best")
        text.append(
            f"- {key.replace('_', '-')}: packing gains {part['packing_speedup']:.2f}x over none"
        )
    fig.suptitle(section["model"])
    save(fig, "fusion.png")
    return (
        f"### Gradient fusion ({section['model']}, global batch {section['global_batch']})\n\n"
        + table(["where", "setting", "ms per step"], rows)
        + "\n\n"
        + "\n".join(text)
        + "\n\n![fusion](img/benchmarks/fusion.png)\n"
    )


def compression(results: dict) -> str:
    section = results["compression"]
    names = list(section["ms_per_step"])
    rows = [
        [
            n,
            section["ms_per_step"][n],
            section["time_vs_fp32"][n],
            section["final_loss"][n],
            section["final_loss_vs_fp32"][n],
        ]
        for n in names
    ]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    axes[0].bar(names, [section["ms_per_step"][n] for n in names], color="tab:orange")
    axes[0].set(ylabel="ms per step", title="time")
    axes[1].bar(names, [section["final_loss"][n] for n in names], color="tab:purple")
    axes[1].set(ylabel="final loss", title=section["loss_model"])
    save(fig, "compression.png")
    return (
        f"### Compression (Horovod, {section['processes']} processes)\n\n"
        + table(["compression", "ms per step", "time vs fp32", "final loss", "loss vs fp32"], rows)
        + "\n\n![compression](img/benchmarks/compression.png)\n"
    )


def scaling(results: dict) -> str:
    section = results["scaling"]
    measured = section["samples_per_second"]
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = []
    for name, by_count in measured["in_process"].items():
        counts = sorted(by_count, key=int)
        ax.plot([int(c) for c in counts], [by_count[c] for c in counts], "o-", label=name)
        rows += [["in-process", name, c, by_count[c]] for c in counts]
    horovod = measured["horovod"]
    counts = sorted(horovod, key=int)
    ax.plot([int(c) for c in counts], [horovod[c] for c in counts], "s--", label="horovod")
    rows += [["multi-process", "horovod", c, horovod[c]] for c in counts]
    ax.set(xlabel="replicas", ylabel="samples / s", xticks=[int(c) for c in counts])
    ax.set_title(f"per-replica batch {section['per_replica_batch']}, {section['devices']}")
    ax.legend()
    save(fig, "scaling.png")
    auto = section["auto"]
    return (
        "### Scaling\n\n"
        + table(["where", "reducer", "replicas", "samples/s"], rows)
        + f"\n\nFastest in-process reducer at {auto['replicas']} replicas: "
        f'`{auto["fastest_in_process"]}`; `reducer="auto"` picks `{auto["auto_picks"]}` here.'
        + "\n\n![scaling](img/benchmarks/scaling.png)\n"
    )


def accumulation(results: dict) -> str:
    a = results["accumulation"]
    return (
        f"### Gradient accumulation ({a['replicas']} replicas, "
        f"global batch {a['global_batch']})\n\n"
        + table(
            ["gradient_accumulation_steps", "reductions / micro-step", "time per micro-step"],
            [
                [a["steps"], a["reductions_per_micro_step"], f"{a['accumulating_ms_per_step']} ms"],
                [1, 1.0, f"{a['every_step_ms_per_step']} ms"],
            ],
        )
        + f"\n\n{a['reductions']} reductions in {a['micro_steps']} micro-steps; time ratio "
        f"{a['time_ratio']:.3f}.\n"
    )


def large_output(results: dict) -> str:
    r = results["large_output"]
    batch, length, classes = r["logits_per_batch"]
    sides = ["native MirroredStrategy", "kmirror"]
    memory = [
        ("tensors", "peak_memory", "peak tensor memory (TensorFlow's allocator)"),
        ("rss", "peak_rss", "peak resident memory (TensorFlow's allocator)"),
        ("rss_malloc", "peak_rss_malloc", "peak resident memory (malloc)"),
    ]
    fig, axes = plt.subplots(1, 1 + len(memory), figsize=(12, 3.2))
    axes[0].bar(sides, [r["native_ms_per_step"], r["kmirror_ms_per_step"]], color=["gray", "C0"])
    axes[0].set(ylabel="ms / step", title="time per step")
    for ax, (kind, _, title) in zip(axes[1:], memory):
        values = [r[f"native_{kind}_peak_mib"], r[f"kmirror_{kind}_peak_mib"]]
        ax.bar(sides, values, color=["gray", "C0"])
        ax.set(ylabel="MiB", title=title.replace(" (", "\n("))
    for ax in axes:
        ax.tick_params(axis="x", labelsize="small")
    save(fig, "large_output.png")
    rows = [["ms per step", r["native_ms_per_step"], r["kmirror_ms_per_step"], r["time"]]]
    rows += [
        [f"{title}, MiB", r[f"native_{kind}_peak_mib"], r[f"kmirror_{kind}_peak_mib"], r[ratio]]
        for kind, ratio, title in memory
    ]
    return (
        f"### Large output ({r['replicas']} replicas, logits {batch} x {length} x {classes})\n\n"
        + table(["", "native MirroredStrategy", "kmirror", "kmirror / native"], rows)
        + "\n\n![large output](img/benchmarks/large_output.png)\n"
    )


def own_step(results: dict) -> str:
    r = results["own_step"]
    rows = [
        [
            program,
            r[program]["native_ms_per_step"],
            r[program]["kmirror_ms_per_step"],
            r[program]["time"],
            r[program]["native_peak_mib"],
            r[program]["kmirror_peak_mib"],
            r[program]["peak_memory"],
        ]
        for program in ("dcgan", "simclr", "dpsgd")
        if program in r
    ]
    header = ["own train_step", "native ms/step", "kmirror ms/step", "time ratio"]
    header += ["native peak MiB", "kmirror peak MiB", "memory ratio"]
    alone = [
        [
            program,
            r[program]["one_device_ms_per_step"],
            r[program]["kmirror_ms_per_step"],
            r[program]["time_one_device"],
            r[program]["one_device_peak_mib"],
            r[program]["kmirror_peak_mib"],
            round(r[program]["kmirror_peak_mib"] / r[program]["one_device_peak_mib"], 4),
        ]
        for program in ("dpsgd",)
        if "time_one_device" in r.get(program, {})
    ]
    against = ["own train_step", "one device ms/step", "kmirror ms/step", "time ratio"]
    against += ["one device peak MiB", "kmirror peak MiB", "memory ratio"]
    return (
        f"### Own train_step ({r['replicas']} replicas, batch {r['batch']})\n\n"
        + "kmirror runs the step on the whole batch (one device's values), native "
        + "MirroredStrategy on each replica's rows; peak tensor memory of TensorFlow's "
        + "allocator in a step (median over the steps), with the replicas' passes running at "
        + "once as on devices (benchmarks/bench_own_step.py).\n\n"
        + table(header, rows)
        + "\n"
        + (_PER_ROW + table(against, alone) + "\n" if alone else "")
    )


_PER_ROW = (
    "`dpsgd` maps each row's gradient with `tf.vectorized_map`: kmirror maps each replica's rows "
    "and joins the per-row gradients, so every replica holds the whole batch's (its memory above "
    "native's, which holds its rows' only). Against one device:\n\n"
)


def real_models(results: dict) -> str:
    section = results["real_models"]
    setup = section["setup"]
    keys = [key for key in section if key != "setup"]
    figures = [
        ("first_step_s", "wrap_first_step", "wrap and first step", "s"),
        ("step_s", "step_time", "time per step", "s"),
        ("tensor_peak_mib", "peak_memory", "peak tensor memory", "MiB"),
    ]
    fig, axes = plt.subplots(1, len(figures), figsize=(12, 3.2))
    width = 0.38
    for ax, (name, _, title, unit) in zip(axes, figures):
        for offset, (side, color) in enumerate((("native", "gray"), ("kmirror", "C0"))):
            values = [section[key][f"{side}_{name}"] for key in keys]
            positions = [i + (offset - 0.5) * width for i in range(len(keys))]
            label = "native MirroredStrategy" if side == "native" else side
            ax.bar(positions, values, width, color=color, label=label)
        ax.set_xticks(range(len(keys)), keys)
        ax.set(ylabel=unit, title=title)
    axes[0].legend(fontsize="small")
    save(fig, "real_models.png")
    rows = [
        [
            key,
            f"{title}, {unit}",
            section[key][f"native_{name}"],
            section[key][f"kmirror_{name}"],
            f"{section[key][ratio]:.3f}",
        ]
        for key in keys
        for name, ratio, title, unit in figures
    ]
    return (
        f"### Real models ({', '.join(setup['models'])}, {setup['replicas']} replicas, global "
        f"batch {setup['global_batch']})\n\n"
        + table(["model", "", "native MirroredStrategy", "kmirror", "kmirror / native"], rows)
        + "\n\n![real models](img/benchmarks/real_models.png)\n"
    )


def input_sharding(results: dict) -> str:
    ratios, details = results["input_sharding"], results.get("input_sharding_details", {})
    modes = list(ratios)
    fig, ax = plt.subplots(figsize=(5, 3))
    width = 0.38
    for offset, (side, color) in enumerate((("handwritten", "gray"), ("kmirror", "C0"))):
        values = [details.get(m, {}).get(f"{side}_ms_per_step", 0) for m in modes]
        label = "dataset.shard(size, rank) loop" if side == "handwritten" else side
        positions = [i + (offset - 0.5) * width for i in range(len(modes))]
        ax.bar(positions, values, width, label=label, color=color)
    ax.set_xticks(range(len(modes)), modes)
    tallest = max(
        d.get(f"{side}_ms_per_step", 0)
        for d in details.values()
        if isinstance(d, dict)
        for side in ("handwritten", "kmirror")
    )
    ax.set(ylabel="ms / step", title="Input-bound pipeline, 2 processes", ylim=(0, tallest * 1.4))
    ax.legend(loc="upper left", fontsize="small")
    save(fig, "input_sharding.png")
    rows = [
        [
            mode,
            details.get(mode, {}).get("handwritten_ms_per_step", ""),
            details.get(mode, {}).get("kmirror_ms_per_step", ""),
            f"{ratio:.3f}",
        ]
        for mode, ratio in ratios.items()
    ]
    return (
        f"### Input sharding ({details.get('processes', 2)} processes, global batch "
        f"{details.get('batch', '')})\n\n"
        + table(["reducer", "dataset.shard loop ms/step", "kmirror ms/step", "ratio"], rows)
        + "\n\n![input sharding](img/benchmarks/input_sharding.png)\n"
    )


def save(fig, name: str) -> None:
    PLOTS.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(PLOTS / name, dpi=90)
    plt.close(fig)


def body(results: dict) -> str:
    """The markdown of every section (drawing its plot into PLOTS)."""
    machine = results["wrapper_overhead_details"].get("machine", {})
    parts = [
        "Measured on: "
        + ", ".join(f"{k} {v}" for k, v in machine.items())
        + " (benchmarks/results.json holds every number).\n"
    ]
    for section, render in (
        ("wrapper_overhead", overhead),
        ("allreduce_throughput", allreduce),
        ("fusion", fusion),
        ("compression", compression),
        ("scaling", scaling),
        ("accumulation", accumulation),
        ("large_output", large_output),
        ("own_step", own_step),
        ("input_sharding", input_sharding),
        ("real_models", real_models),
    ):
        if section in results:
            parts.append(render(results))
        else:
            parts.append(f"### {section}\n\nNot measured yet: run `make bench`.\n")
    return "\n".join(parts)


def main():
    results = json.loads(RESULTS.read_text())
    tables = body(results)
    (ROOT / "benchmarks" / "results.md").write_text(tables)
    PAGE.write_text(markers.fill(PAGE.read_text(), "results", tables))
    for page in PAGES:
        text = page.read_text()
        for name, figure in figures(results).items():
            text = markers.fill(text, name, figure)
        page.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}, benchmarks/results.md and {PLOTS.relative_to(ROOT)}/")


if __name__ == "__main__":
    main()
