"""The wrapped model is the user's model: it answers as the user's model does, and a change made
through the user's references takes effect where Keras takes it."""

import keras
import numpy as np
import pytest
from conftest import cpus
from models import (
    BATCH,
    MULTI_IO_COMPILE,
    assert_same_history,
    dense_data,
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


def test_a_compile_through_the_users_reference_is_taken_at_the_next_fit():
    """`model.compile(...)` on the user's model after `wrap` (as Keras' own tests do): the
    wrapped model trains and logs with the new settings, as the plain model does."""
    x, y = dense_data()
    histories, models = [], []
    for wrapped in (False, True):
        user = dense_model("sgd")
        model = kmirror.wrap(user, devices=cpus(2)) if wrapped else user
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        user.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
        )
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        histories.append(history.history)
        models.append(model)
    assert "acc" in histories[1] and "accuracy" not in histories[1]
    assert_same_history(*histories)
    assert max_weight_difference(*models) < 1e-5


class Counted(keras.layers.Layer):
    """Keras' own test layer pattern: a variable the user made, counting the layer's calls."""

    def build(self, shape):
        self.counter = self.add_weight(
            shape=(), initializer="zeros", dtype="int32", trainable=False, name="counter"
        )

    def call(self, x):
        self.counter.assign_add(1)
        return x


def counted_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), Counted(), keras.layers.Dense(3), keras.layers.Dense(3)]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def every_variable(model):
    """The model's weights, its optimizer's and its metrics' variables."""
    metrics = [v for m in model.metrics for v in m.variables]
    return model.variables + model.optimizer.variables + metrics


def test_the_users_variables_read_and_assign_as_on_one_device():
    """`value`, `int()`, `float()`, `numpy()`, `np.asarray` and `assign`, outside a step, on every
    variable of the wrapped model, answer as plain Keras answers; an assigned value is every
    replica's (the next epoch trains from it)."""
    x, y = dense_data()
    models = [counted_model(), counted_model()]
    models[1] = kmirror.wrap(models[1], reducer="hierarchical_copy", devices=cpus(3))
    for model in models:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    plain, wrapped = every_variable(models[0]), every_variable(models[1])
    assert len(plain) == len(wrapped) > 10
    scalars = 0
    for expected, actual in zip(plain, wrapped, strict=True):
        for read in (np.asarray, lambda v: v.numpy(), lambda v: np.asarray(v.value)):
            np.testing.assert_allclose(read(actual), read(expected), rtol=1e-5, err_msg=actual.path)
        if expected.shape == ():
            scalars += 1
            for read in (int, float, lambda v: int(v.value), lambda v: float(v.value)):
                assert read(actual) == pytest.approx(read(expected), rel=1e-5), actual.path
    assert scalars >= 4  # the counter, the optimizer's iterations and learning rate, the metrics'
    counter = models[1].layers[0].counter
    assert int(counter.value) == int(models[0].layers[0].counter.value) == 4  # 4 batches

    for model in models:
        model.layers[0].counter.assign(100)
        model.optimizer.learning_rate.assign(0.5)
        model.layers[1].kernel.assign(model.layers[1].kernel.numpy() * 2)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(counter) == 104
    assert max_weight_difference(*models) < 1e-5


class Adversarial(keras.Model):
    """keras.io's conditional GAN shape: sub-models, a helper method, a property with a setter,
    a plain attribute, and a name (`devices`) that kmirror's model also has."""

    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8)])
        self.discriminator = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        self.latent_dim, self.label = 2, "first"
        self.devices = "the user's"
        self._temperature = 0.5

    @property
    def temperature(self):
        return self._temperature

    @temperature.setter
    def temperature(self, value):
        self._temperature = value

    def generate(self, rows):
        return self.generator(np.ones((rows, self.latent_dim)))

    def call(self, x):
        return self.discriminator(self.generator(x))


def test_the_users_own_attributes_and_methods_answer_on_the_wrapped_model():
    model = Adversarial()
    model.compile(optimizer="sgd", loss="mse")
    wrapped = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(2))

    assert wrapped.generator is model.generator and wrapped.discriminator is model.discriminator
    assert wrapped.latent_dim == 2 and wrapped.temperature == 0.5
    np.testing.assert_allclose(wrapped.generate(3), model.generate(3))
    wrapped.temperature, wrapped.label = 2.0, "second"  # set on the user's model
    assert model.temperature == 2.0 and model.label == "second"
    # kmirror's and Keras' own names stay the wrapped model's.
    assert wrapped.devices == cpus(2) and model.devices == "the user's"
    history = wrapped.fit(np.ones((6, 2)), np.ones((6, 1)), batch_size=3, verbose=0)
    assert wrapped.history is history and wrapped.optimizer is model.optimizer
    with pytest.raises(AttributeError, match="'MirroredModel' object has no attribute 'absent'"):
        wrapped.absent  # noqa: B018


def test_raw_tf_variables_are_mirrored_while_wrapped_and_given_back_trained():
    """A raw tf.Variable the model holds (an attribute, a list item) has a copy on every replica
    while wrapped, each written as on one device; unwrap puts the user's objects back, trained."""
    import gradient_steps
    import tensorflow as tf
    from global_steps import labelled
    from real_models import precision

    x, y, _ = labelled()
    reference = gradient_steps.accumulated_by_hand(conditional=True, raw=True)
    model = gradient_steps.accumulated_by_hand(conditional=True, raw=True)
    counter, pending = model.counter, list(model.accumulators)
    wrapped = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(3))
    assert model.counter is not counter and model.accumulators[0] is not pending[0]
    assert isinstance(model.counter, tf.distribute.DistributedValues)
    with precision("float64"):
        for trained in (reference, wrapped):  # 4 steps (33, 33, 33, 2 rows): 1 update, 1 pending
            trained.fit(x, y, batch_size=33, epochs=1, shuffle=False, verbose=0)
    wrapped.unwrap()

    assert model.counter is counter and model.accumulators[0] is pending[0]
    assert not isinstance(counter, tf.distribute.DistributedValues)
    assert float(counter.numpy()) == float(reference.counter.numpy()) == 4.0
    for mine, theirs in zip(pending, reference.accumulators):
        assert np.abs(theirs.numpy()).max() > 1e-3  # the last step's gradient, pending
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=0, atol=1e-12)
    assert max_weight_difference(reference, model) < 1e-10


def test_a_raw_tf_variable_in_a_tuple_is_refused_naming_it():
    import tensorflow as tf

    model = dense_model()
    model.frozen = (tf.Variable(0.0, name="steps_taken"),)
    weights = model.get_weights()
    with pytest.raises(ValueError, match="steps_taken.*in a tuple.*keras.Variable"):
        kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(2))
    assert model.frozen[0].numpy() == 0.0 and not kmirror._core.mirroring.is_wrapped(model)
    np.testing.assert_equal(model.get_weights(), weights)
