"""Models with their own steps and models Keras cannot recreate from a config are wrapped as they
are (their training is in the exactness matrix, tests/features.py); here: their own test_step and
predict_step, and leaving kmirror with them."""

import logging

import global_steps
import keras
import numpy as np
import per_row_steps
import pytest
import tensorflow as tf
from conftest import cpus
from features import FEATURES, fit
from keras import ops
from models import assert_same_history, dense_data
from own_steps import GAN, gan, guide_step, images, own_evaluation
from real_models import precision

import kmirror
from kmirror._core import draws, keras_hooks


@pytest.mark.parametrize("n", [2, 3])
def test_own_test_step_and_predict_step_equal_single_device(n):
    x, y = dense_data()
    reference = own_evaluation()
    model = kmirror.wrap(own_evaluation(), reducer="hierarchical_copy", devices=cpus(n))

    expected = reference.evaluate(x, y, batch_size=33, verbose=0)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=33, verbose=0), expected, rtol=1e-6)
    expected = reference.predict(x, batch_size=33, verbose=0)
    actual = model.predict(x, batch_size=33, verbose=0)
    assert actual.shape == (101, 3)
    np.testing.assert_allclose(actual, expected, atol=1e-6)
    np.testing.assert_allclose(actual.sum(axis=1), 1.0, rtol=1e-5)  # its own step: softmax


class Largest(keras.metrics.Metric):
    """A metric whose state is a maximum: it needs every row's prediction."""

    def __init__(self):
        super().__init__(name="largest")
        self.largest = self.add_variable(shape=(), initializer="zeros", name="largest")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.largest.assign(ops.maximum(self.largest, ops.max(y_pred)))

    def result(self):
        return self.largest


@pytest.mark.parametrize("metric", ["accuracy", Largest])
def test_own_steps_update_metrics_with_the_whole_batchs_values(metric):
    """A metric whose state adds up over rows, and one whose state is a maximum over every row's
    prediction, hold one device's states: the step updates them with the whole batch's values."""

    def build():
        model = guide_step()
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[metric() if callable(metric) else metric],
        )
        return model

    x, y = dense_data()
    args = dict(batch_size=33, epochs=2, shuffle=False, verbose=0)
    expected = build().fit(x, y, **args).history
    model = kmirror.wrap(build(), reducer="hierarchical_copy", devices=cpus(3))
    history = model.fit(x, y, **args).history
    assert_same_history(expected, history, rtol=1e-5)
    assert expected[list(expected)[-1]][-1] != 0


def test_a_gan_trains_its_own_optimizers_and_unwraps_to_itself():
    user = gan()
    d_optimizer, g_optimizer = user.d_optimizer, user.g_optimizer
    model = kmirror.wrap(user, reducer="hierarchical_copy", devices=cpus(2))
    fit(model, FEATURES["gan"])
    assert int(d_optimizer.iterations.numpy()) == 12  # 3 epochs of 4 batches, the user's object

    plain = model.unwrap()
    assert plain is user and user.d_optimizer is d_optimizer and user.g_optimizer is g_optimizer
    reference = gan()
    fit(reference, FEATURES["gan"])
    for a, b in zip(reference.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=FEATURES["gan"].tolerance)
    for name in ("d_optimizer", "g_optimizer"):
        ours, theirs = getattr(plain, name), getattr(reference, name)
        for a, b in zip(ours.variables, theirs.variables, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), atol=FEATURES["gan"].tolerance)
    assert "apply" not in vars(d_optimizer) and "update_state" not in vars(user.metrics[0])

    # The unwrapped GAN trains on one device as the original class does.
    x, _, _ = images()
    history = plain.fit(x, batch_size=33, epochs=1, verbose=0).history
    assert set(history) == {"d_loss", "g_loss"}


def test_a_custom_layer_without_config_unwraps_to_a_plain_model():
    feature = FEATURES["custom_layer_without_config"]
    model = kmirror.wrap(feature.build(), reducer="hierarchical_copy", devices=cpus(2))
    fit(model, feature)
    x, y, _ = feature.data()
    expected = model.predict(x, batch_size=33, verbose=0)
    plain = model.unwrap()
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected, atol=1e-6)
    assert isinstance(plain, keras.Sequential)


def test_a_gradient_taken_inside_a_condition_is_refused_with_the_fix():
    """The sum over the replicas runs where the step takes a gradient of its weights: not inside
    a tf.cond (applying it there is exact: tests/features.py, own_step_accumulated_cond_*)."""

    class Conditional(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))

            def update():
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
                return tf.constant(0)

            tf.cond(loss > 0, update, lambda: tf.constant(0))
            return {"loss": loss}

    model = Conditional([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    wrapped = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(2))
    x, y = dense_data()
    where = "inside the function graph 'cond_true.*recorded layer calls.*top level of the step"
    with pytest.raises(ValueError, match=where):
        wrapped.fit(x, y, batch_size=33, epochs=1, verbose=0)


def test_a_map_over_the_rows_runs_on_each_replicas_rows_and_a_loop_runs_whole():
    """`tf.vectorized_map` over the batch's rows runs on each replica's rows (its results
    joined, tests/per_row_steps.py proves them one device's); a layer called inside a function
    of the step's own (the mapped function, a `tf.map_fn`'s body) runs as one device calls it."""
    x, y, _ = global_steps.labelled()
    with precision("float64"):
        mapped = kmirror.wrap(per_row_steps.vectorized(), devices=cpus(3))
        report = mapped.explain(x, y, batch_size=33)
        assert report.split == ["row (tf.vectorized_map)"]
        assert [why for _, why in report.whole] == [
            "it is called inside a function mapped over rows (`tf.vectorized_map`, a Jacobian), "
            "where no sum over the replicas runs"
        ]
        looped = kmirror.wrap(per_row_steps.mapped(), devices=cpus(3))
        report = looped.explain(x, y, batch_size=33)
        assert report.split == []
        assert "inside the function graph 'map_while_body" in report.whole[0][1]


def test_a_map_writing_state_with_its_rows_values_runs_whole_and_every_copy_is_one_devices():
    """A mapped function updating a metric with a value of its row: TensorFlow writes it once,
    with the first row's value; every replica's copy of the metric holds one device's."""
    x, y, _ = global_steps.labelled()
    with precision("float64"):
        expected = per_row_steps.tracked()
        expected.fit(x, y, batch_size=33, epochs=2, shuffle=False, verbose=0)
        model = kmirror.wrap(per_row_steps.tracked(), devices=cpus(3))
        report = model.explain(x, y, batch_size=33)
        assert report.split == []
        assert report.whole[0][0] == "row (tf.vectorized_map)"
        assert "writes state held outside it (AssignVariableOp)" in report.whole[0][1]
        model.fit(x, y, batch_size=33, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    for variable, want in zip(model.row_norm.variables, expected.row_norm.variables):
        for copy in model._reducer.local_values(keras_hooks.storage(variable)):
            np.testing.assert_allclose(copy.numpy(), want.numpy(), rtol=0, atol=1e-10)


class WalrusRows(per_row_steps.Vectorized):
    """DP-SGD whose mapped function is written with an assignment expression (`:=`), which
    autograph cannot convert."""

    def _row(self, pair, weights):
        if (count := len(weights)) == 0:
            raise ValueError(count)
        return super()._row(pair, weights)


class Messages(logging.Handler):
    """The messages of the records a logger hands it, in order."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_autograph_converts_neither_the_steps_functions_nor_kmirrors():
    """Keras runs a step with autograph off, and autograph never converts Keras' functions: a
    function the step maps over its rows runs as written, and so it does wrapped (kmirror traced
    it converted, and one written with `:=` drew TensorFlow's "could not transform" warning).
    kmirror's functions standing in for Keras' inside a nested `tf.function` of the step (which
    autograph converts, as on one device) are left as written, as Keras' are (converted, one
    drew the same warning)."""
    x, y, _ = global_steps.labelled()
    messages = Messages()
    tf.get_logger().addHandler(messages)
    try:
        with precision("float64"):
            expected = per_row_steps.private_model(WalrusRows)
            expected.fit(x, y, batch_size=33, epochs=1, shuffle=False, verbose=0)
            model = kmirror.wrap(per_row_steps.private_model(WalrusRows), devices=cpus(2))
            model.fit(x, y, batch_size=33, epochs=1, shuffle=False, verbose=0)
            nested = kmirror.wrap(per_row_steps.compiled(), devices=cpus(2))
            nested.fit(x, y, batch_size=33, epochs=1, shuffle=False, verbose=0)
    finally:
        tf.get_logger().removeHandler(messages)
    assert not [m for m in messages.messages if "AutoGraph could not transform" in m]
    for got, want in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)


def test_a_jacobian_with_respect_to_a_tensor_through_split_calls_is_refused_with_the_fix():
    """A Jacobian of weights is summed over the replicas (tests/per_row_steps.py); one with
    respect to a tensor the replicas' calls computed on their rows is refused, naming the fix."""

    class InputJacobian(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(x)
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
                rows = self(x, training=True) ** 2
            per_row = tape.batch_jacobian(rows, x)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss, "slope": ops.mean(per_row)}

    model = InputJacobian([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    wrapped = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(2))
    x, y = dense_data()
    with pytest.raises(
        ValueError, match="batch_jacobian. with respect to a tensor.*vectorized_map"
    ):
        wrapped.fit(x, y, batch_size=33, epochs=1, verbose=0)


def test_save_does_what_keras_does_with_the_original_model(tmp_path):
    """A model Keras cannot save (or reload) behaves the same wrapped: kmirror adds no failure."""

    def outcome(model, path):
        try:
            model.save(path)
        except Exception as error:  # whatever Keras raises, the wrapped model raises the same
            return type(error)
        try:
            keras.models.load_model(path)
        except Exception as error:
            return ("saved", type(error))
        return "saved and loaded"

    for build in (FEATURES["custom_layer_without_config"].build, gan):
        original = outcome(build(), tmp_path / "original.keras")
        wrapped = kmirror.wrap(build(), reducer="hierarchical_copy", devices=cpus(2))
        assert outcome(wrapped, tmp_path / "wrapped.keras") == original


class TensorFlowLabelNoise(GAN):
    """keras.io's DCGAN: its label noise drawn with `tf.random.uniform`, which no replica can
    draw as one device."""

    def label_noise(self, shape):
        return tf.random.uniform(shape)


class NoisyLayer(keras.layers.Layer):
    """Noise drawn with `tf.random.normal` in a layer's call."""

    def call(self, x, training=False):
        return x + 0.01 * tf.random.normal(tf.shape(x)) if training else x


def noisy_dense():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), NoisyLayer(), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model


@pytest.mark.parametrize("where", ["own train_step", "layer"])
def test_a_tf_random_draw_in_the_step_is_named_in_a_warning(where, monkeypatch):
    monkeypatch.setattr(draws, "_warned", False)
    if where == "layer":
        model, (x, y) = noisy_dense(), dense_data()
    else:
        model, (x, y, _) = gan(TensorFlowLabelNoise), images()
    wrapped = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(2))
    with pytest.warns(UserWarning, match="RandomUniform|RandomStandardNormal"):
        wrapped.fit(x, y, batch_size=33, epochs=1, verbose=0)


class Unjoinable(keras.layers.Layer):
    """A layer returning what its replicas cannot join: the count of its call's rows, or its rows
    in the second axis."""

    def __init__(self, returned, **kwargs):
        super().__init__(**kwargs)
        self.returned = returned

    def call(self, x):
        if self.returned == "count":
            return ops.shape(x)[0]
        return ops.transpose(x[:, :, None], (1, 0, 2))


@pytest.mark.parametrize("returned", ["count", "rows in axis 1"])
def test_a_layer_returning_what_its_replicas_cannot_join_is_refused_with_the_fix(returned):
    """A statistic of the rows is one device's value (the program of `own_step_attribute` in
    tests/features.py); the replica's count of its rows, or its rows elsewhere than in the first
    axis, are refused, naming the layer."""

    class Unjoined(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                value = ops.cast(Unjoinable(returned, name="unjoinable")(y_pred), y_pred.dtype)
                loss = ops.mean(ops.square(y_pred)) + ops.mean(value)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    model = Unjoined([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd")
    wrapped = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(2))
    before = model.get_weights()
    x, y = dense_data()
    what = "the count of the replica's rows" if returned == "count" else r"a tensor.*axes \[1\]"
    with pytest.raises(ValueError, match=f"layer 'unjoinable' .*returned {what}.*first axis"):
        wrapped.fit(x, y, batch_size=33, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


class KeepsItsCount(keras.layers.Layer):
    """A layer that keeps on itself the count of its call's rows: as an attribute, in a list it
    holds, or in a dict it sets in the call."""

    def __init__(self, kept, **kwargs):
        super().__init__(**kwargs)
        self.kept, self.counts = kept, []

    def call(self, x):
        if self.kept == "attribute":
            self.count = ops.shape(x)[0]
        elif self.kept == "list":
            self.counts.append(ops.shape(x)[0])
        else:
            self.found = {"count": ops.shape(x)[0]}
        return x

    def read(self):
        return {"attribute": lambda: self.count, "list": lambda: self.counts[-1]}.get(
            self.kept, lambda: self.found["count"]
        )()


@pytest.mark.parametrize("kept", ["attribute", "list", "dict"])
def test_a_layer_keeping_its_replicas_count_of_rows_is_refused_when_the_step_reads_it(kept):
    """Statistics of the rows kept on a layer are one device's values (`own_step_attribute` in
    tests/features.py); the count of the replica's rows is not."""

    class ReadsTheCount(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                count = ops.cast(self.layers[-1].read(), y_pred.dtype)
                loss = ops.sum(ops.square(y_pred - y)) / count
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    model = ReadsTheCount([keras.Input((8,)), keras.layers.Dense(3), KeepsItsCount(kept)])
    model.compile(optimizer="sgd")
    wrapped = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(2))
    before = model.get_weights()
    x, y = dense_data()
    y = np.eye(3)[y]
    message = {
        "attribute": "reads `count` of layer 'keeps_its_count'.*count on this replica",
        "list": "reads from a list or dict of a layer.*count on this replica",
    }
    with pytest.raises(ValueError, match=message.get(kept, message["list"])):
        wrapped.fit(x, y, batch_size=33, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


class OwnMetrics(keras.Sequential):
    """A model whose own `compute_metrics` logs one more value: the mean of its predictions."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        return {**logs, "mean_prediction": ops.mean(y_pred)}


def own_metrics():
    keras.utils.set_random_seed(1)
    model = OwnMetrics([keras.Input((8,)), keras.layers.Dense(4, "relu"), keras.layers.Dense(3)])
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@pytest.mark.parametrize("n", [2, 3])
def test_a_models_own_compute_metrics_runs_as_on_one_device(n):
    """Keras' step calls the model's `compute_metrics`: its override logs the whole batch's value,
    in `fit` and `evaluate`, as on one device."""
    x, y = dense_data()
    reference = own_metrics()
    expected = reference.fit(x, y, batch_size=33, epochs=2, verbose=0).history
    model = kmirror.wrap(own_metrics(), reducer="hierarchical_copy", devices=cpus(n))
    history = model.fit(x, y, batch_size=33, epochs=2, verbose=0).history
    assert "mean_prediction" in history
    assert_same_history(expected, history, rtol=1e-5)
    evaluated = model.evaluate(x, y, batch_size=33, verbose=0, return_dict=True)
    expected = reference.evaluate(x, y, batch_size=33, verbose=0, return_dict=True)
    assert sorted(evaluated) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(evaluated[key], expected[key], rtol=1e-5, err_msg=key)
