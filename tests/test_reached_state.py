"""State a step reaches that no walk of the model finds (tests/state_steps.py): trained on 3
replicas, given back by `unwrap` single-device and holding one device's values, so that training
goes on where it stopped; and a variable that cannot be mirrored where it is held is refused,
naming it and the fix, before anything runs."""

import json

import keras
import numpy as np
import pytest
import state_steps
import tensorflow as tf
from conftest import cpus
from features import FEATURES, fit
from global_steps import FLOATX, labelled
from real_models import precision
from state_steps import everything, fit_backed_up

import kmirror

PROGRAMS = ["lookahead", "lookahead_own_step", "raw_buffers", "noisy_gradients"]


def assert_single_device(model: keras.Model) -> None:
    for variable in trained_variables(model):
        assert not isinstance(variable, tf.distribute.DistributedValues), variable.name


def trained_variables(model: keras.Model) -> list:
    optimizers, pending = [], [model.optimizer]
    while pending:
        optimizer = pending.pop(0)
        if isinstance(optimizer, keras.optimizers.Optimizer) and optimizer not in optimizers:
            optimizers.append(optimizer)
            pending += list(vars(optimizer).values())
    found = [v if isinstance(v, tf.Variable) else v.value for o in optimizers for v in o.variables]
    return found + [v.value for v in model.weights]


@pytest.mark.parametrize("name", PROGRAMS)
def test_unwrap_gives_back_one_devices_state_and_training_goes_on_from_it(name):
    feature = FEATURES[f"state_{name}"]
    expected = getattr(state_steps, name)()
    fit(expected, feature, epochs=1)
    fit(expected, feature, epochs=1)

    wrapped = kmirror.wrap(getattr(state_steps, name)(), devices=cpus(3))
    fit(wrapped, feature, epochs=1)
    model = wrapped.unwrap()
    assert_single_device(model)
    fit(model, feature, epochs=1)

    want, got = everything(expected), everything(model)
    assert len(got) == len(want)
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-10)


class TupleBuffers(keras.optimizers.SGD):
    """SGD keeping a raw `tf.Variable` per weight in a tuple, which no copy can be put into."""

    def build(self, variables):
        super().build(variables)
        self.average = tuple(tf.Variable(tf.zeros(v.shape, v.dtype)) for v in variables)

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)
        average = self.average[self._get_variable_index(variable)]
        average.assign(0.9 * average + 0.1 * variable)


def test_a_written_variable_held_in_a_tuple_is_refused_naming_it_and_the_fix():
    model = state_steps._model(keras.Sequential, TupleBuffers(0.1))
    before = model.get_weights()
    x, y, _ = labelled()
    wrapped = kmirror.wrap(model, devices=cpus(2))
    with precision(FLOATX), pytest.raises(ValueError) as raised:
        wrapped.fit(x, y, batch_size=33, epochs=1, verbose=0)
    message = str(raised.value)
    assert "tf.Variable" in message and "tuple" in message
    assert "keras.Variable" in message and "a list, a dict or an attribute" in message
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def weights_file(path) -> dict:
    """Every array of a Keras weights file, by its path in the file."""
    import h5py

    arrays = {}

    def take(key, item):
        if isinstance(item, h5py.Dataset):
            arrays[key] = item[()]

    with h5py.File(path) as opened:
        opened.visititems(take)
    return arrays


@pytest.mark.parametrize("name", ["lookahead", "noisy_gradients"])
def test_saved_and_backed_up_state_is_one_devices(name, tmp_path):
    """On 3 replicas: training with kmirror's backups every 2 batches is one device's, and so is
    the weights file (the wrapper's inner Adam and slow weights too). A crash inside the second
    epoch resumes there to the uninterrupted run, each step its own call: the Lookahead's inner
    Adam's state restored, and the gradient noise's seed generator, held by an object no
    weights file holds (the backup writes it beside the weights)."""
    feature, build = FEATURES[f"state_{name}"], getattr(state_steps, name)
    expected = fit_backed_up(build(), feature, tmp_path / "one")
    wrapped = fit_backed_up(kmirror.wrap(build(), devices=cpus(3)), feature, tmp_path / "whole")
    assert_same_state(everything(expected), everything(wrapped))

    expected.save_weights(tmp_path / "one.weights.h5")
    wrapped.save_weights(tmp_path / "wrapped.weights.h5")
    want, got = (
        weights_file(tmp_path / "one.weights.h5"),
        weights_file(tmp_path / "wrapped.weights.h5"),
    )
    assert sorted(got) == sorted(want)
    if name == "lookahead":  # Keras saves the inner optimizer as the wrapper's child
        assert any(key.startswith("optimizer/inner/vars/") for key in want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-10)

    folder = tmp_path / "crashed"
    fit_backed_up(kmirror.wrap(build(), devices=cpus(3)), feature, folder, crash=(1, 1))
    if name == "noisy_gradients":  # the generator's state, beside the weights
        assert len(list(folder.glob("*.reached.npz"))) == 1
    resumed = fit_backed_up(kmirror.wrap(build(), devices=cpus(3)), feature, folder)
    assert_same_state(everything(expected), everything(resumed))


def test_a_backup_of_reached_state_another_program_wrote_is_refused_naming_the_fix(tmp_path):
    """A backup whose reached state (the seed generator's, beside the weights) does not match the
    program's (its file written by another program, named with its checksum): refused at the
    first step, naming the fix; the backup's files are left as they were."""
    from kmirror._core.files import digest

    feature, folder = FEATURES["state_noisy_gradients"], tmp_path / "backup"
    build = state_steps.noisy_gradients
    fit_backed_up(kmirror.wrap(build(), devices=cpus(2)), feature, folder, crash=(1, 1))
    index = json.loads((folder / "backup.json").read_text())
    reached = folder / index["reached"]
    with reached.open("wb") as f:
        np.savez(f, state0=np.zeros(3, np.int32))
    index["reached_sha256"] = digest(reached)
    (folder / "backup.json").write_text(json.dumps(index))
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ValueError, match="written by another program. Delete the backup folder"):
        fit_backed_up(kmirror.wrap(build(), devices=cpus(2)), feature, folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files


def assert_same_state(expected: list, actual: list) -> None:
    for a, b in zip(expected, actual, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["raw_buffers", "noisy_gradients"])
def test_eager_steps_write_reached_state_once_as_one_device(name):
    """With `run_eagerly=True` on 3 replicas, the raw buffers an optimizer tracks and the seed
    generator an object that is not a layer holds are written as one device writes them: found by
    tracing the eager step once before it first runs (every replica wrote and drew its own,
    otherwise: weights 0.25 and 0.10 off)."""
    feature, build = FEATURES[f"state_{name}"], getattr(state_steps, name)
    expected, model = build(), build()
    expected.run_eagerly = model.run_eagerly = True
    want = fit(expected, feature, epochs=1)
    got = fit(kmirror.wrap(model, devices=cpus(3)), feature, epochs=1)
    assert_same_state(everything(expected), everything(model))
    assert list(got) == list(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-10)
