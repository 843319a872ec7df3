"""The package's layout: data flows one way (model -> step -> reducer -> cluster/devices), no
import cycle, and no module longer than LIMIT lines without saying why at its top."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "kmirror"
LIMIT = 250

#: Each module's layer: a module imports kmirror modules of its own layer or lower ones only.
LAYERS = [
    # What kmirror knows of the machine, Keras and TensorFlow.
    ["versions", "errors", "files", "devices", "tf_hooks", "tf_hooks.graphs", "keras_hooks"]
    + ["keras_hooks.replica", "keras_hooks.rows", "keras_hooks.model_state", "keras_hooks.reading"]
    + ["keras_hooks.symbolic"]
    + ["replicas", "python_draws"]
    + ["keras_hooks.optimizers", "keras_hooks.storage", "keras_hooks.writes"]
    + ["keras_hooks.overrides", "global_batch", "keras_hooks.provenance", "keras_hooks.own_thread"]
    + ["keras_hooks.nested", "keras_hooks.elementwise", "keras_hooks.row_axes"]
    + ["keras_hooks.moves", "keras_hooks.batch_sums", "keras_hooks.explaining"]
    + ["keras_hooks.reductions"]
    + ["keras_hooks.by_place", "keras_hooks.mixing", "keras_hooks.other_ops"]
    + ["keras_hooks.whole_calls", "keras_hooks.call_results", "keras_hooks.row_maps"]
    + ["keras_hooks.containers"]
    + ["keras_hooks.call_state", "keras_hooks.calls"]
    + ["launching", "launching.rendezvous", "launching.supervisor", "launching.hosts"]
    + ["install_horovod"],
    # The processes of a job, metric states, compression.
    ["slurm", "_core.cluster", "metric_states", "feed", "feed.rows", "sparse_gradients", "draws"]
    + ["reducers.compression"]
    + ["reducers.packing", "reducers.scoped"]
    + ["reducers.job"],
    # Reducers: how values cross replicas and processes.
    ["reducers", "reducers.base", "reducers.in_process", "reducers.collective", "reducers.horovod"],
    # The model's state on the replicas, the steps and the input they take.
    ["holding", "mirroring", "feed.sharding", "feed.py_datasets", "feed.feeding", "feed.placement"]
    + ["logged"]
    + ["layer_state"]
    + ["accumulation", "own_gradients", "reached_state", "step", "own_step", "tracing"],
    # Around the steps: callbacks, what fit reads, where a relaunch resumes, the chief's state.
    ["_core.callbacks", "_core.callbacks.backup_folder", "_core.callbacks.backup"]
    + ["_core.callbacks.checkpoint"]
    + ["_core.callbacks.tensorboard", "_core.callbacks.trackers", "_core.callbacks.ray_train"]
    + ["_core.callbacks.keras_own"]
    + ["_core.callbacks.preemption"]
    + ["feed.inputs", "feed.resume", "fitting", "chief_state", "building", "compiling", "explain"],
    # The model.
    ["answering", "model"],
    # What users call: the public modules that export what is inside.
    ["wrapping", "launch", "cluster", "data", "callbacks", ""],
]
#: The public modules (and the package itself); every other module lives in `kmirror._core`.
PUBLIC = ("", "versions", "errors", "devices", "cluster", "data", "launch", "reducers", "callbacks")
PUBLIC += ("install_horovod",)


def qualified(module: str) -> str:
    if module.startswith("_core."):
        return f"kmirror.{module}"
    inside = "" if module.split(".")[0] in PUBLIC else "_core."
    return f"kmirror.{inside}{module}".rstrip(".")


LAYER = {qualified(m): depth for depth, layer in enumerate(LAYERS) for m in layer}
LAYER["kmirror._core"] = 0  # imports nothing of kmirror


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The kmirror modules `path` imports (at any depth of its code)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kmirror"):
            for alias in node.names:
                inner = f"{node.module}.{alias.name}"
                found.add(inner if inner in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kmirror.")}
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def test_every_module_has_a_layer():
    assert sorted(set(modules()) - set(LAYER)) == []


def test_imports_go_down_the_layers_only():
    upward = [
        f"{name} imports {other}"
        for name, others in graph().items()
        for other in others
        if other != "kmirror" and LAYER[other] > LAYER[name]
    ]
    assert upward == []


#: The public modules below the step, which the inside may import.
BELOW = ("kmirror.errors", "kmirror.versions", "kmirror.devices", "kmirror.reducers")


def test_the_inside_imports_no_public_module_but_those_below_the_step():
    """Implementation lives in `kmirror._core`; the public modules import it and export it, so a
    change behind a public name cannot break the inside."""
    reaching = [
        f"{name} imports {other}"
        for name, others in graph().items()
        if name.startswith("kmirror._core")
        for other in others
        if other != "kmirror"
        and not other.startswith("kmirror._core")
        and not other.startswith(BELOW)
    ]
    assert reaching == []


def test_there_is_no_import_cycle():
    edges = {name: {o for o in others if o != "kmirror"} for name, others in graph().items()}
    done, path = set(), []

    def visit(name):
        if name in path:
            pytest.fail("import cycle: " + " -> ".join([*path[path.index(name) :], name]))
        if name in done:
            return
        path.append(name)
        for other in sorted(edges[name]):
            visit(other)
        path.pop()
        done.add(name)

    for name in sorted(edges):
        visit(name)


#: The modules allowed over LIMIT lines, each with the reason its docstring gives at its top.
LONGER = {
    "kmirror._core.model": "the overrides Keras calls belong to one class",
}


def test_only_the_modules_listed_as_long_are_long_and_they_say_why():
    lines = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {name: n for name, n in lines.items() if n > LIMIT}.keys() == LONGER.keys(), (
        f"modules over {LIMIT} lines must be split, or listed in LONGER with their reason"
    )
    for name, reason in LONGER.items():
        docstring = ast.get_docstring(ast.parse(modules()[name].read_text())) or ""
        assert reason in " ".join(docstring.split()), f"{name}: say why at its top"


def test_the_architecture_page_names_every_module():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    modules_section = page[
        page.index("## Modules") : page.index("## ", page.index("## Modules") + 3)
    ]
    missing = [
        name
        for name in modules()
        if name != "kmirror"
        and f"`{name.rsplit('.', 1)[-1]}" not in modules_section
        and name.rsplit(".", 1)[-1] not in page[: page.index("## Modules")]
    ]
    assert missing == [], "docs/architecture.md: say what these modules own"


#: The modules that may reach into Keras and TensorFlow internals (and say which versions).
HOOKS = ("kmirror._core.keras_hooks", "kmirror._core.tf_hooks")


def keras_and_tensorflow_private_names() -> set[str]:
    """The private attributes of the Keras and TensorFlow classes kmirror meets: models, layers,
    optimizers, metrics, losses, variables, callbacks, datasets and strategies."""
    import inspect

    import keras
    import tensorflow as tf

    classes = [keras.Model, keras.layers.Layer, keras.optimizers.Optimizer, keras.metrics.Metric]
    classes += [keras.losses.Loss, keras.Variable, keras.utils.PyDataset, tf.Variable]
    classes += [tf.data.Dataset, tf.distribute.Strategy, tf.distribute.DistributedDataset]
    classes += [tf.distribute.ReplicaContext, tf.distribute.CrossDeviceOps]
    classes += [c for c in vars(keras.callbacks).values() if inspect.isclass(c)]
    return {
        name
        for kind in classes
        for base in kind.__mro__
        if base.__module__.startswith(("keras", "tensorflow"))
        for name in vars(base)
        if name.startswith("_") and not name.startswith("__")
    }


def internals_used(tree: ast.AST, private: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute | ast.FunctionDef)
            and (getattr(node, "attr", None) or getattr(node, "name", None)) in private
        ):
            found.append(f"line {node.lineno}: {getattr(node, 'attr', None) or node.name}")
        text = node.value if isinstance(node, ast.Constant) else None
        module = getattr(node, "module", None) if isinstance(node, ast.ImportFrom) else None
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for source in [text, module, *names]:
            if isinstance(source, str) and ("keras.src" in source or "tensorflow.python" in source):
                found.append(f"line {node.lineno}: {source}")
    return found


def test_keras_and_tensorflow_internals_are_reached_only_from_their_two_modules():
    private = keras_and_tensorflow_private_names()
    found = {
        name: internals_used(ast.parse(path.read_text()), private)
        for name, path in modules().items()
        if not name.startswith(HOOKS)
    }
    assert {name: uses for name, uses in found.items() if uses} == {}
    # What the check looks for is there in the hooks, where it belongs.
    overrides = modules()["kmirror._core.keras_hooks.overrides"].read_text()
    hooks = internals_used(ast.parse(overrides), private)
    assert any("_save_model" in use for use in hooks) and any("_log_epoch" in use for use in hooks)
    tf_hooks = internals_used(ast.parse(modules()["kmirror._core.tf_hooks"].read_text()), private)
    assert any("tensorflow.python" in use for use in tf_hooks)


def test_the_suite_runs_in_its_groups(request):
    """`make test` hands each group of tests (tests/conftest.py) to one process: pytest-xdist
    writes the group into each test's id. Where it cannot (pytest 9.2 with pytest-xdist 3.8),
    every process runs each module's job and reference again."""
    if not hasattr(request.config, "workerinput"):
        pytest.skip("run by pytest-xdist only (make test)")
    assert request.node.nodeid.endswith("@tests/test_layout.py")
