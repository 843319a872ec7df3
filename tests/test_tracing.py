"""No retracing: the training step is traced once per batch shape, however many epochs and fits
follow (a trace costs seconds on a deep model; in a multi-process job every process pays it);
what was traced is freed with its model; Python's garbage collector waits while a step traces."""

import gc
import weakref

import keras
import pytest
import tensorflow as tf
from conftest import cpus
from models import BATCH, dense_data, dense_model

import kmirror


@pytest.fixture
def traces(monkeypatch):
    """Counts how often the data-parallel step's Python code runs: once per trace."""
    counted = []
    train = kmirror._core.step.train

    def counting(*args, **kwargs):
        counted.append(1)
        return train(*args, **kwargs)

    monkeypatch.setattr(kmirror._core.step, "train", counting)
    return counted


@pytest.mark.parametrize("reducer", ["one_device", "hierarchical_copy"])
def test_epochs_and_fits_do_not_retrace_the_step(traces, reducer):
    x, y = dense_data()  # 101 samples in batches of 33: a full shape and a final batch of 2
    model = kmirror.wrap(dense_model("sgd"), reducer, devices=cpus(3))
    counts = []
    for _ in range(3):
        model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=True, verbose=0)
        counts.append(len(traces))
    assert 1 <= counts[0] <= 2, counts  # the full batch, then (maybe) a generalised shape
    assert counts == [counts[0]] * 3, f"the step was traced again in later fits: {counts}"


def _graphs_alive() -> int:
    gc.collect()
    return sum(isinstance(o, tf.Graph) for o in gc.get_objects())


def test_the_graphs_of_a_models_steps_are_freed_with_it():
    """TensorFlow keeps each `tf.custom_gradient` traced (kmirror's global statistics, its sums
    over the replicas) in its global gradient registry, and with it the graph it was traced in:
    once a wrapped model is gone, no graph of its steps stays alive (measured without the
    release: 2 graphs, and 10 to 50 thousand Python objects per test, for the process's life)."""

    def trained():
        x, y = dense_data()
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(8)])
        model.add(keras.layers.BatchNormalization())
        model.add(keras.layers.Dense(3))
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model = kmirror.wrap(model, "hierarchical_copy", devices=cpus(3))
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # a final batch of 2 rows
        model.evaluate(x, y, batch_size=BATCH, verbose=0)
        model.predict(x, batch_size=BATCH, verbose=0)
        return weakref.ref(model)

    before = _graphs_alive()
    model = trained()
    assert _graphs_alive() == before
    assert model() is None


class Collecting(keras.layers.Dense):
    """A Dense layer noting, at each pass through it, whether the garbage collector runs; it
    fails the pass where told to."""

    seen: list = []
    fails = False

    def call(self, inputs):
        Collecting.seen.append(gc.isenabled())
        if Collecting.fails:
            raise RuntimeError("a pass that fails")
        return super().call(inputs)


@pytest.mark.parametrize("collecting", [True, False], ids=["collector on", "collector off"])
def test_the_collector_waits_while_a_step_traces_and_is_set_back_after(collecting):
    """A deep model's trace makes enough Python objects to start several of the collector's full
    passes, each over every object of the process (0.86 s of MobileNetV2's first step on 2
    replicas, `make bench`): it waits while each of the three steps traces, and is set back as
    the user had it after, also where a trace fails."""
    x, y = dense_data()

    def wrapped_model():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((x.shape[1],)), Collecting(3)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return kmirror.wrap(model, "hierarchical_copy", devices=cpus(3))

    wrapped, failing = wrapped_model(), wrapped_model()
    was = gc.isenabled()
    (gc.enable if collecting else gc.disable)()
    try:
        Collecting.seen = []
        wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        in_fit = (list(Collecting.seen), gc.isenabled())
        Collecting.seen = []
        wrapped.evaluate(x, y, batch_size=BATCH, verbose=0)
        wrapped.predict(x, batch_size=BATCH, verbose=0)
        in_others = (list(Collecting.seen), gc.isenabled())
        Collecting.fails = True
        with pytest.raises(RuntimeError, match="a pass that fails"):
            failing.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        after_failure = gc.isenabled()
    finally:
        Collecting.fails = False
        (gc.enable if was else gc.disable)()
    assert in_fit[0] and not any(in_fit[0]), in_fit  # each replica's trace of the step
    assert in_others[0] and not any(in_others[0]), in_others
    assert (in_fit[1], in_others[1], after_failure) == (collecting,) * 3


class Counted(keras.layers.Dense):
    """A Dense layer counting the passes through it: each replica's trace is one."""

    passes = 0

    def call(self, inputs):
        Counted.passes += 1
        return super().call(inputs)


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_the_first_fit_passes_through_a_built_model_once_per_replica(kind):
    """Keras builds a model's compiled loss and metrics from its outputs' specs, which it learns
    by a forward pass over the batch's specs; the wrapped model logs with metrics of its own,
    built from the same outputs. A built functional or sequential model knows its outputs: the
    first fit makes no pass but each replica's (Keras' own build, run for the user's model and
    for the wrapped one, makes 2 more)."""
    x, y = dense_data()
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Dense(8, "tanh"), Counted(3)]
    if kind == "sequential":
        model = keras.Sequential([keras.Input((x.shape[1],)), *layers])
    else:
        inputs = keras.Input((x.shape[1],))
        model = keras.Model(inputs, layers[1](layers[0](inputs)))
    model.compile(
        "sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    Counted.passes = 0
    wrapped = kmirror.wrap(model, "hierarchical_copy", devices=cpus(3))
    rows = 3 * BATCH  # every batch alike: one trace
    history = wrapped.fit(x[:rows], y[:rows], batch_size=BATCH, epochs=1, verbose=0).history
    assert Counted.passes == 3
    assert sorted(history) == ["accuracy", "loss"]
