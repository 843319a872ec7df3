"""Test set-up: split the host CPU into 7 logical devices before TensorFlow initialises.

Tests pick 1 to 7 of them with `devices=cpus(n)`.

`make test` runs the suite in 3 processes on the 2 cores (pytest-xdist, `--dist loadgroup`): most of
a test's time is tracing TensorFlow graphs in Python, on one core, and a third process uses a core
while another waits on its jobs' processes. Tests run in groups, one process per group:
each module's tests together (they share references and jobs), each deep model's together (they
share its single-device reference), the feature matrix by replica count (its single-device
references are shared by every process: tests/shared_cache.py), and the tests that launch jobs of
several processes in two groups, so that no two jobs of a group start at once:

- "horovod jobs": Horovod's ranks bind port 0 (Gloo), and Ray Train picks its workers' ports by
  binding port 0 and releasing them, which another process's bind to port 0 could take before
  Ray's workers bind them.
- "ring jobs": the launcher picks the workers' ports below the kernel's ephemeral range, where no
  bind to port 0 reaches, so they run beside the Horovod jobs.

The costliest groups are handed out first, so that the last to end is a short one.
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The Horovod ranks the tests launch (they inherit this environment) run Horovod's background
# cycle every 5 ms, not every 1 (its default): an idle cycle still exchanges messages between the
# ranks, and on 2 cores shared by 3 test processes that polling costs more than it saves. Measured
# on the Horovod feature job (2 ranks): 345 s of CPU and 194 s wall at 1 ms, 288 s and 180 s at 5.
# Only when the ranks meet changes; what they compute does not.
os.environ.setdefault("HOROVOD_CYCLE_TIME", "5")

import shared_cache  # noqa: E402

import kmirror  # noqa: E402

MAX_DEVICES = 7
kmirror.devices.simulate(MAX_DEVICES)

#: The tests that launch jobs of several processes: modules, or tests by name. Those whose names
#: say "horovod", and Ray's, are the "horovod jobs"; the others the "ring jobs".
JOBS = (
    "tests/test_horovod.py",
    "tests/test_multi_worker.py",
    "tests/test_callbacks.py",
    "tests/test_faults.py",
    "tests/test_ray.py",
    "tests/test_examples.py::test_horovod_example_under_the_launcher",
    "tests/test_examples.py::test_multi_worker_example_under_the_launcher",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[03_horovod_ring.ipynb]",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[04_multi_worker.ipynb]",
    "tests/test_docs.py::test_every_public_name_has_a_runnable_example",
)
#: Groups handed out first, costliest first (the others follow in the order collected). The
#: test of what stays alive after a model goes scans every object of its process: run early,
#: while a test process holds few (3 s, against 177 s after most of the suite).
FIRST = (
    "tests/test_tracing.py",
    "horovod jobs",
    "ring jobs",
    "features on 3",
    "features on 2",
    "deep DenseNet121",
    "deep ResNet50",
    "deep EfficientNetB0",
    "deep ConvNeXtTiny",
    "deep MobileNetV2",
    "deep image_classification",
)


@pytest.fixture(scope="session", autouse=True)
def shared_folder(tmp_path_factory, worker_id):
    """Under pytest-xdist, the run's folder the test processes share (tests/shared_cache.py)."""
    if worker_id != "master":
        folder = tmp_path_factory.getbasetemp().parent / "shared"
        folder.mkdir(exist_ok=True)
        os.environ[shared_cache.SHARED] = str(folder)


@pytest.fixture(autouse=True)
def graphs_released():
    """Each `tf.custom_gradient` traced registers its gradient in TensorFlow's global registry,
    which keeps the traced graph alive for the life of the process, and every later garbage
    collection walks it (each test left 10 to 50 thousand objects alive). kmirror releases what
    its steps register (`MirroredModel`'s steps); a test also traces Keras' own steps
    on one device (its references), whose all-reduce on the default strategy is a custom
    gradient: released here."""
    from kmirror._core.tf_hooks import graphs

    kept = graphs.custom_gradients()
    yield
    graphs.release_custom_gradients(kept)


def cpus(n: int) -> list[str]:
    """The first n simulated CPU devices."""
    return [f"/device:CPU:{i}" for i in range(n)]


def group(item) -> str:
    if any(item.nodeid == job or item.nodeid.startswith(job + "::") for job in JOBS):
        horovod = "horovod" in item.nodeid or item.nodeid.startswith("tests/test_ray.py")
        return "horovod jobs" if horovod else "ring jobs"
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if "test_deep_model" in item.nodeid and params.get("name"):
        return f"deep {params['name']}"
    if "test_feature_equals_single_device" in item.nodeid and "n" in params:
        return f"features on {params['n']}"
    if "test_op_coverage" in item.nodeid and "chunk" in params:  # its ops' references shared
        return f"ops {params['chunk']}"
    return item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(group(item), len(FIRST)))


def pytest_terminal_summary(terminalreporter):
    """The totals of `make test-ops` (tests/test_op_coverage.py), summed over its models."""
    from op_coverage import NOT_A_TENSOR_MAP, names

    totals, errors = {}, {}
    for report in terminalreporter.stats.get("passed", []):
        for name, value in report.user_properties:
            if name == "op coverage":
                replicas, config, split, whole = value
                found = totals.setdefault((replicas, config), [0, 0])
                found[0], found[1] = found[0] + split, found[1] + whole
            elif name == "op coverage errors":
                errors[value[0]] = value[1]
    if not totals:
        return
    taking = len(names()) - len(NOT_A_TENSOR_MAP)
    terminalreporter.write_sep("-", f"keras.ops: {taking} functions take a tensor")
    for (replicas, config), (split, whole) in sorted(totals.items()):
        error = errors.get(replicas, "?")
        terminalreporter.write_line(
            f"{replicas} replicas, {config}: {split} split over the rows, {whole} run whole, "
            f"{error} fail as on one device"
        )
