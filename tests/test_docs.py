"""The documentation site builds without a warning, and its API reference covers the public API."""

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kmirror

ROOT = Path(__file__).parent.parent


#: The plots `make bench` draws into docs/benchmarks.md.
PLOTS = (
    "overhead",
    "allreduce",
    "fusion",
    "compression",
    "scaling",
    "input_sharding",
    "real_models",
)


def test_docs_build_strictly(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in kmirror.__all__:
        assert f'id="kmirror.{name}"' in api, f"kmirror.{name} is missing from the API reference"
    for plot in PLOTS:
        assert (tmp_path / "site" / "img" / "benchmarks" / f"{plot}.png").exists(), plot


def public_examples() -> dict[str, str]:
    """The first python example of every public name's docstring, read as mkdocstrings reads it."""
    import griffe

    package = griffe.load("kmirror", search_paths=[str(ROOT)])
    examples = {}
    for name in kmirror.__all__:
        docstring = package[name].docstring
        found = re.search(r"```python\n(.*?)```", docstring.value if docstring else "", re.DOTALL)
        examples[name] = textwrap.dedent(found.group(1)) if found else ""
    return examples


def test_every_public_name_has_a_runnable_example(tmp_path):
    """Each public name's docstring example runs as written, in order, in one fresh process."""
    examples = public_examples()
    assert all(examples.values()), [name for name, code in examples.items() if not code]
    script = "\n".join(
        f"print('--- kmirror.{name}', flush=True)\n{code}" for name, code in examples.items()
    )
    (tmp_path / "examples.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "examples.py"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in kmirror.__all__:
        assert f"--- kmirror.{name}" in done.stdout
    assert "[(0, 2), (1, 2)]" in done.stdout  # kmirror.launch.run's two ranks
    assert (tmp_path / "best.keras").exists() and (tmp_path / "trained.keras").exists()


def test_every_documented_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    listed = set(re.findall(r":\s*([\w-]+\.md)", nav))
    assert pages == listed


#: Bad inputs tested beside the features that need a cluster or a Horovod job.
BAD_INPUT_ELSEWHERE = [
    "tests/test_multi_worker.py::test_cluster_spec_mistakes_are_named",
    "tests/test_multi_worker.py::test_devices_together_with_a_cluster_spec",
    "tests/test_multi_worker.py::test_in_process_reducers_across_workers_are_refused",
    "tests/test_multi_worker.py::test_joining_a_cluster_after_tensorflow_started_says_to_connect_first",
    "tests/test_multi_worker.py::test_workers_with_different_device_counts_fail_clearly_without_hanging",
    "tests/test_horovod.py::test_without_a_launcher_it_trains_as_one_replica_and_says_so",
    "tests/test_horovod.py::test_without_horovod_installed_the_error_names_the_install",
    "tests/test_horovod.py::test_horovod_is_not_given_devices",
    "tests/test_own_steps.py::test_a_gradient_taken_inside_a_condition_is_refused_with_the_fix",
    "tests/test_in_place.py::test_a_raw_tf_variable_in_a_tuple_is_refused_naming_it",
    "tests/test_data.py::test_data_mistakes_are_named",
    "tests/test_data.py::test_predict_on_a_sharded_dataset_says_to_pass_the_inputs",
    "tests/test_horovod.py::test_processes_whose_own_batches_differ_in_number_are_refused",
    "tests/test_multi_worker.py::test_processes_whose_own_batches_differ_in_number_are_refused",
    "tests/test_prefetch.py::test_prefetch_must_be_a_boolean_or_none",
    "tests/test_backup.py::test_a_corrupt_backup_without_a_previous_one_is_refused_and_kept",
    "tests/test_backup.py::test_a_bad_save_freq_names_the_choices",
    "tests/test_layer_state.py::test_a_none_weight_written_differently_raises_naming_aggregation_and_updates_nothing",
    "tests/test_horovod.py::test_a_weight_written_differently_raises_in_every_process",
    "tests/test_multi_worker.py::test_a_weight_written_differently_raises_in_every_process",
    "tests/test_callbacks.py::test_a_subclass_of_keras_backup_and_restore_is_refused_naming_kmirrors",
    "tests/test_callbacks.py::test_chief_only_marks_a_callback_or_a_class_and_refuses_anything_else",
    "tests/test_multi_worker.py::test_a_tf_config_not_joined_after_tensorflow_started_says_where_to_connect",
    "tests/test_reached_state.py::test_a_backup_of_reached_state_another_program_wrote_is_refused_naming_the_fix",
]
#: Every fault case (the table of docs/reliability.md).
FAULTS = [
    "tests/test_faults.py",
    "tests/test_horovod.py::test_a_killed_rank_stops_the_other_with_a_message",
    "tests/test_multi_worker.py::test_a_killed_worker_makes_the_other_fail_with_a_message",
    "tests/test_callbacks.py::test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable",
    "tests/test_callbacks.py::test_a_process_killed_with_its_host_resumes_on_the_hosts_left",
    "tests/test_callbacks.py::test_sigterm_to_one_process_backs_up_at_one_step_and_the_job_resumes_on_three",
    "tests/test_callbacks.py::test_sigterm_pending_at_the_last_step_keeps_the_end_and_the_relaunch_trains_nothing",
    "tests/test_backup.py::test_sigterm_backs_up_before_the_next_step_exits_and_the_relaunch_resumes_there",
    "tests/test_backup.py::test_sigterm_in_the_last_validation_keeps_the_end_and_the_relaunch_trains_nothing",
    "tests/test_backup.py::test_a_crash_mid_epoch_resumes_to_the_uninterrupted_run",
    "tests/test_backup.py::test_a_corrupt_latest_backup_falls_back_to_the_previous_one",
    "tests/test_backup.py::test_keras_own_backup_and_restore_resumes_mid_epoch_as_kmirrors",
    "tests/test_ray.py",
]


def collected(*groups: list[str]) -> list[int]:
    """How many tests each group of selectors collects (one collection for all groups)."""
    selectors = sorted({s for group in groups for s in group})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *selectors],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    tests = [line for line in done.stdout.splitlines() if "::" in line]

    def selected(test: str, selector: str) -> bool:
        return test == selector or test.startswith(selector + ("[" if "::" in selector else "::"))

    return [sum(any(selected(t, s) for s in group) for t in tests) for group in groups]


def test_the_reliability_page_counts_what_the_tests_cover():
    page = (ROOT / "docs" / "reliability.md").read_text()
    bad = re.search(r"covers \*\*(\d+) bad inputs\*\*.*?suites (\d+) more", page, re.DOTALL)
    faults = re.search(r"(\d+) fault cases, with nothing lost", page)
    assert bad and faults, "docs/reliability.md states the counts"
    counts = collected(["tests/test_bad_input.py"], BAD_INPUT_ELSEWHERE, FAULTS)
    assert [int(bad.group(1)), int(bad.group(2)), int(faults.group(1))] == counts


def test_every_measured_figure_in_the_docs_is_the_last_runs(tmp_path, monkeypatch):
    """The benchmark tables, the soak table and every figure the pages quote are what
    benchmarks/results.json (the last `make bench` and `make soak`) gives; a ratio typed into a
    page by hand, outside the markers, is refused."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import markers
    import report
    import soak

    monkeypatch.setattr(report, "PLOTS", tmp_path)  # the plots of this check go nowhere
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    assert markers.held(benchmarks, "results") == report.body(results).strip()
    reliability = (ROOT / "docs" / "reliability.md").read_text()
    assert markers.held(reliability, "soak") == soak.render(results["soak"]).strip()
    figures = report.figures(results)
    quoted = 0
    for page in report.PAGES:
        text = page.read_text()
        for name in set(markers.names(text)) - {"results", "soak"}:
            assert name in figures, f"{page.name}: no benchmark gives the figure {name!r}"
            assert markers.held(text, name) == figures[name], f"{page.name}: {name}"
            quoted += 1
        prose = re.sub(r"<!-- ([\w-]+) -->.*?<!-- /\1 -->|```.*?```", "", text, flags=re.DOTALL)
        typed = re.findall(r"\b\d+(?:\.\d+)?x\b", prose)
        assert not typed, f"{page.name} quotes {typed} by hand: put them between markers"
    assert quoted >= 1


def test_the_public_names_are_the_same_in_the_package_the_readme_and_the_api_reference():
    """`kmirror.__all__`, the names the README's table shows and those the API reference
    documents are one list; no other module is reachable as `kmirror.<name>`."""
    public = set(kmirror.__all__)
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| | |") :].split("\n\n", 1)[0]
    shown = set(re.findall(r"kmirror\.(\w+)", table))
    documented = set(
        re.findall(r"^::: kmirror\.(\w+)", (ROOT / "docs" / "api.md").read_text(), re.M)
    )
    assert shown == documented == public
    # Every module of the package imported: the top-level names are the public ones and _core.
    for path in (ROOT / "kmirror").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if "horovod" not in module:  # needs Horovod, which test_horovod.py covers
            importlib.import_module(module)
    reachable = {
        name
        for name, value in vars(kmirror).items()
        if inspect.ismodule(value)
        and value.__name__.startswith("kmirror.")
        and not name.startswith("_")
    }
    assert reachable <= public
    for name in ("step", "model", "inputs", "tf_hooks"):
        with pytest.raises(AttributeError):
            getattr(kmirror, name)
