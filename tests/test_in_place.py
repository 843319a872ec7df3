"""The wrapped model is the user's model: it answers as the user's model does, and a change made
through the user's references takes effect where Keras takes it."""

import numpy as np
import pytest
from conftest import cpus
from models import (
    BATCH,
    MULTI_IO_COMPILE,
    assert_same_history,
    dense_model,
    max_weight_difference,
    multi_io_data,
    multi_io_model,
)

import kmirror


def summary_of(model) -> str:
    lines = []
    model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
    return "\n".join(lines)


@pytest.mark.parametrize("build", [multi_io_model, dense_model], ids=["functional", "sequential"])
def test_the_wrapped_model_answers_as_the_users_model(build, tmp_path):
    model = build()
    answers = {
        "summary": summary_of(model),
        "count_params": model.count_params(),
        "input_shape": model.input_shape,
        "output_shape": model.output_shape,
    }
    wrapped = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(2))

    assert len(wrapped.layers) == len(model.layers) > 0
    assert all(a is b for a, b in zip(wrapped.layers, model.layers))
    for layer in model.layers:
        assert wrapped.get_layer(layer.name) is layer
    assert wrapped.get_layer(index=1) is model.layers[1]
    assert wrapped.inputs is model.inputs and wrapped.outputs is model.outputs
    for name in ("input", "output"):  # a Sequential model never called has neither
        try:
            expected = getattr(model, name)
        except AttributeError:
            with pytest.raises(AttributeError):
                getattr(wrapped, name)
            continue
        assert getattr(wrapped, name) is expected
    assert summary_of(wrapped) == answers["summary"]
    assert wrapped.count_params() == answers["count_params"]
    assert wrapped.input_shape == answers["input_shape"]
    assert wrapped.output_shape == answers["output_shape"]
    for name in ("weights", "trainable_weights", "non_trainable_weights", "variables"):
        ours, theirs = getattr(wrapped, name), getattr(model, name)
        assert len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs)), name

    # Trainable flags, set through either model, are the one model's.
    wrapped.trainable = False
    assert model.trainable is False and wrapped.trainable is False
    assert wrapped.trainable_weights == [] and model.trainable_weights == []
    model.trainable = True
    assert wrapped.trainable is True and len(wrapped.trainable_weights) == len(model.weights)

    # Weights files fit the user's model, wrapped or not, both ways.
    twin = build()
    twin.set_weights([w * 0.5 for w in twin.get_weights()])
    twin.save_weights(tmp_path / "twin.weights.h5")
    wrapped.load_weights(tmp_path / "twin.weights.h5")
    assert max_weight_difference(twin, wrapped) == 0 == max_weight_difference(twin, model)
    wrapped.save_weights(tmp_path / "wrapped.weights.h5")
    other = build()
    other.load_weights(tmp_path / "wrapped.weights.h5")
    assert max_weight_difference(other, twin) == 0


def changed_midway(model, user, x, y, fit):
    """Trains 2 epochs, then freezes the "label" output layer and lowers the learning rate
    through the user's references, compiles again (the same arguments) and trains 2 more."""
    first = fit(model, x, y)
    user.get_layer("label").trainable = False
    user.optimizer.learning_rate.assign(0.02)
    model.compile(optimizer=user.optimizer, **MULTI_IO_COMPILE)
    return first, fit(model, x, y)


def test_changes_through_the_users_references_take_effect_as_keras_takes_them():
    x, y, weights = multi_io_data()

    def fit(model, x, y):
        kwargs = dict(sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return model.fit(x, y, **kwargs).history

    reference = multi_io_model()
    expected = changed_midway(reference, reference, x, y, fit)
    user = multi_io_model()
    wrapped = kmirror.wrap(user, reducer="hierarchical_copy", devices=cpus(3))
    label = user.get_layer("label")
    before_freeze = []

    def fit_and_remember(model, x, y):
        history = fit(model, x, y)
        before_freeze.append([w.numpy().copy() for w in label.weights])
        return history

    actual = changed_midway(wrapped, user, x, y, fit_and_remember)
    assert max_weight_difference(reference, wrapped) < 1e-5
    for e, a in zip(expected, actual, strict=True):
        assert_same_history(e, a)
    for first, second in zip(*before_freeze, strict=True):
        np.testing.assert_array_equal(first, second)  # frozen through the user's reference
    assert float(wrapped.optimizer.learning_rate.numpy()) == pytest.approx(0.02)
