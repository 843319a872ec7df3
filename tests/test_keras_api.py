"""fit / evaluate / predict take every input Keras takes and work with plain Keras callbacks,
giving the single-device results."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from models import (
    BATCH,
    Rows,
    assert_same_history,
    dense_data,
    dense_model,
    max_weight_difference,
)

import kmirror


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


def both(fit_args: dict, n=3, **compile_args):
    """Trains the same model on one device and wrapped on n: (reference, model, histories)."""
    reference = dense_model(**compile_args)
    model = kmirror.wrap(dense_model(**compile_args), reducer="hierarchical_copy", devices=cpus(n))
    histories = []
    for m in (reference, model):
        args = {k: (v() if callable(v) and k == "callbacks" else v) for k, v in fit_args.items()}
        histories.append(m.fit(verbose=0, **args).history)
    return reference, model, histories


def test_tf_data_dataset():
    x, y = dense_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    reference, model, (h0, h1) = both(dict(x=data, epochs=3, shuffle=False))
    assert max_weight_difference(reference, model) < 1e-5
    assert_same_history(h0, h1)


def test_py_dataset():
    x, y = dense_data()
    reference, model, (h0, h1) = both(dict(x=Batches(x, y, BATCH), epochs=3, shuffle=False))
    assert max_weight_difference(reference, model) < 1e-5
    assert_same_history(h0, h1)


@pytest.mark.parametrize(
    "make, workers",
    [(Batches, 1), (Rows, 1), (Rows, 3)],
    ids=["py_dataset", "row_dataset", "row_dataset_3_workers"],
)
def test_shuffled_py_dataset_with_validation_and_class_weight(make, workers):
    """Keras draws a PyDataset's batch order with Python's random module: a wrapped model draws
    the same orders, and reads validation PyDatasets and class weights as Keras does."""
    x, y = dense_data()
    xv, yv = dense_data(n=40, seed=5)
    histories, models = [], []
    for wrapped in (False, True):
        model = dense_model("adam")
        if wrapped:
            model = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(3))
        keras.utils.set_random_seed(7)
        history = model.fit(
            make(x, y, BATCH, workers=workers),
            epochs=3,
            validation_data=make(xv, yv, BATCH),
            class_weight={0: 1.0, 1: 2.0, 2: 0.5},
            verbose=0,
        )
        histories.append(history.history)
        models.append(model)
    assert {"val_loss", "val_accuracy"} <= set(histories[1])
    assert max_weight_difference(*models) < 1e-5
    assert_same_history(*histories)


class Reshuffled(Batches):
    """keras.io's pattern: a PyDataset that reshuffles its rows in `on_epoch_end` (with its own
    generator: Keras calls it once more before the first pass of fit, evaluate and each
    validation); each call logged."""

    def __init__(self, x, y, batch_size, seed, **kwargs):
        super().__init__(x, y, batch_size, **kwargs)
        self.rng, self.calls = np.random.default_rng(seed), []

    def on_epoch_begin(self):
        self.calls.append("begin")

    def on_epoch_end(self):
        self.calls.append("end")
        order = self.rng.permutation(len(self.x))
        self.x, self.y = self.x[order], self.y[order]


def test_py_dataset_reshuffled_in_on_epoch_end_is_read_as_keras_reads_it():
    """Training, validation and evaluate read the rows one device reads, and the dataset's
    `on_epoch_begin` and `on_epoch_end` are called as Keras calls them."""
    x, y = dense_data()
    xv, yv = dense_data(n=40, seed=5)
    models, histories, datasets, evaluated = [], [], [], []
    for wrapped in (False, True):
        model = dense_model("adam")
        if wrapped:
            model = kmirror.wrap(model, reducer="hierarchical_copy", devices=cpus(3))
        train, validation = Reshuffled(x, y, BATCH, 1), Reshuffled(xv, yv, BATCH, 2)
        history = model.fit(train, epochs=3, validation_data=validation, verbose=0)
        tested = Reshuffled(xv, yv, BATCH, 3)
        evaluated.append(model.evaluate(tested, verbose=0, return_dict=True))
        models.append(model)
        histories.append(history.history)
        datasets.append([train.calls, validation.calls, tested.calls])
    assert datasets[1] == datasets[0]
    assert datasets[0][0] == ["end"] + ["begin", "end"] * 3, "Keras' own calls"
    assert max_weight_difference(*models) < 1e-5
    assert_same_history(*histories)
    for key in evaluated[0]:
        np.testing.assert_allclose(evaluated[1][key], evaluated[0][key], rtol=1e-5, err_msg=key)


def test_validation_data_and_class_weight():
    x, y = dense_data()
    xv, yv = dense_data(n=40, seed=5)
    fit_args = dict(
        x=x,
        y=y,
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        validation_data=(xv, yv),
        class_weight={0: 1.0, 1: 2.0, 2: 0.5},
    )
    reference, model, (h0, h1) = both(fit_args)
    assert {"val_loss", "val_accuracy"} <= set(h1)
    assert max_weight_difference(reference, model) < 1e-5
    assert_same_history(h0, h1)


def test_validation_split_and_steps_per_execution():
    x, y = dense_data()
    fit_args = dict(x=x, y=y, batch_size=BATCH, epochs=2, shuffle=False, validation_split=0.2)
    reference, model, (h0, h1) = both(fit_args, steps_per_execution=2)
    assert max_weight_difference(reference, model) < 1e-5
    assert_same_history(h0, h1)


def test_early_stopping_stops_at_the_same_epoch():
    x, y = dense_data()
    xv, yv = dense_data(n=40, seed=5)

    def callbacks():
        return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05)]

    fit_args = dict(x=x, y=y, batch_size=BATCH, epochs=30, shuffle=False, validation_data=(xv, yv))
    fit_args["callbacks"] = callbacks
    reference, model, (h0, h1) = both(fit_args)
    assert 1 < len(h0["loss"]) < 30, "the scenario must stop early"
    assert len(h1["loss"]) == len(h0["loss"])
    assert_same_history(h0, h1)


def test_learning_rate_scheduler_changes_the_replicas_optimizer():
    x, y = dense_data()

    def callbacks():
        return [keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))]

    fit_args = dict(x=x, y=y, batch_size=BATCH, epochs=3, shuffle=False, callbacks=callbacks)
    reference, model, (h0, h1) = both(fit_args)
    assert h1["learning_rate"] == pytest.approx([0.1, 0.05, 0.1 / 3])
    assert max_weight_difference(reference, model) < 1e-5
    assert_same_history(h0, h1)


def test_evaluate_return_dict_and_predict_on_dataset():
    x, y = dense_data()
    reference = dense_model()
    model = kmirror.wrap(dense_model(), devices=cpus(2))
    expected = reference.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
    actual = model.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
    assert actual == pytest.approx(expected, rel=1e-6)
    data = tf.data.Dataset.from_tensor_slices(x).batch(BATCH)
    np.testing.assert_allclose(
        model.predict(data, verbose=0), reference.predict(x, verbose=0), atol=1e-6
    )


def test_train_on_batch_and_uncompiled_then_compiled():
    x, y = dense_data()
    reference = dense_model(compiled=False)
    model = kmirror.wrap(dense_model(compiled=False), devices=cpus(2))
    for m in (reference, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    for start in range(0, 99, BATCH):
        rows = slice(start, start + BATCH)
        expected = reference.train_on_batch(x[rows], y[rows])
        actual = model.train_on_batch(x[rows], y[rows])
        assert actual == pytest.approx(expected, rel=1e-6)
    assert max_weight_difference(reference, model) < 1e-6


def test_a_model_with_a_lambda_layer_is_wrapped_and_trains_like_one_device():
    """The Lambda's function is reused in memory, never deserialised."""

    def model():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((8,))
        doubled = keras.layers.Lambda(lambda t: 2.0 * t + 1.0, name="affine")(inputs)
        m = keras.Model(inputs, keras.layers.Dense(3)(doubled))
        m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
        return m

    x, y = dense_data()
    single = model()
    single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    wrapped = kmirror.wrap(model(), "hierarchical_copy", devices=cpus(3))
    wrapped.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(single, wrapped) < 1e-5


def test_saving_every_epoch_builds_nothing_new(monkeypatch, tmp_path):
    """Each save after the first reuses the plain model and Keras' cache of attributes to skip:
    without that, every checkpoint built reference layers and an optimizer again, and a long run
    grew by tens of KiB per epoch (make soak)."""
    x, y = dense_data()
    wrapped = kmirror.wrap(dense_model(), devices=cpus(2))
    wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    wrapped.save(tmp_path / "first.keras")
    wrapped.save_weights(tmp_path / "first.weights.h5")
    built = []
    layer_init = keras.layers.Layer.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        layer_init(self, *args, **kwargs)

    monkeypatch.setattr(keras.layers.Layer, "__init__", counting)
    for _ in range(3):
        wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        wrapped.save(tmp_path / "model.keras")
        wrapped.save_weights(tmp_path / "model.weights.h5")
    assert built == [], f"saving built {built}"
    reloaded = keras.models.load_model(tmp_path / "model.keras")
    for a, b in zip(reloaded.get_weights(), wrapped.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(reloaded.optimizer.iterations.numpy()) == int(wrapped.optimizer.iterations.numpy())
