"""Small models and data shared by the tests. Every builder seeds its initial weights."""

import keras
import numpy as np

import kmirror

N_SAMPLES = 101  # with batch 33: batches of 33, 33, 33 and a final batch of 2
BATCH = 33


def optimizer(name: str) -> keras.optimizers.Optimizer:
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    return keras.optimizers.Adam(learning_rate=0.01)


def dense_data(n=N_SAMPLES, features=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, size=n)
    return x, y


class Crash(Exception):
    """Raised by `CrashAt`: the process stops training there, as a crash would."""


class CrashAt(keras.callbacks.Callback):
    """Raises `Crash` after batch `batch` of epoch `epoch` (0-based) is trained."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise Crash()


class Rows(kmirror.data.RowDataset):
    """`x` and `y` in batches of `batch_size`, loaded row by row; `loaded` lists the rows loaded."""

    def __init__(self, x, y, batch_size=BATCH, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size
        self.loaded = []

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def batch_rows(self, index):
        return list(range(len(self.x)))[index * self.batch_size :][: self.batch_size]

    def load(self, rows):
        self.loaded += rows
        return self.x[rows], self.y[rows]


def dense_model(opt="sgd", seed=1, compiled=True, **compile_args):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3),
        ]
    )
    if compiled:
        model.compile(
            optimizer=optimizer(opt),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **compile_args,
        )
    return model


def multi_io_data(n=N_SAMPLES, seed=0):
    """Two inputs (token ids and numbers), two outputs (a class and a value), sample weights."""
    rng = np.random.default_rng(seed)
    x = {
        "tokens": rng.integers(1, 50, size=(n, 5)).astype("int32"),
        "numbers": rng.normal(size=(n, 3)).astype("float32"),
    }
    y = {
        "label": rng.integers(0, 3, size=n),
        "value": rng.normal(size=(n, 1)).astype("float32"),
    }
    sample_weight = rng.uniform(0.2, 2.0, size=n).astype("float32")
    return x, y, sample_weight


def multi_io_model(opt="sgd", seed=1):
    """A functional model with an Embedding (sparse gradients), two inputs and two outputs."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    numbers = keras.Input((3,), name="numbers")
    embedded = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 4)(tokens))
    hidden = keras.layers.Dense(
        8, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-3)
    )(keras.layers.Concatenate()([embedded, numbers]))
    label = keras.layers.Dense(3, name="label")(hidden)
    value = keras.layers.Dense(1, name="value")(hidden)
    model = keras.Model({"tokens": tokens, "numbers": numbers}, {"label": label, "value": value})
    model.compile(optimizer=optimizer(opt), **MULTI_IO_COMPILE)
    return model


#: How multi_io_model compiles, but for the optimizer.
MULTI_IO_COMPILE = dict(
    loss={"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "value": "mse"},
    loss_weights={"label": 1.0, "value": 0.5},
    metrics={"label": ["accuracy"], "value": ["mae"]},
)


@keras.saving.register_keras_serializable(package="kmirror_tests")
class TwoLayer(keras.Model):
    """A subclassed model, built only when first called."""

    def __init__(self, hidden=16, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.hidden_units = hidden
        self.classes = classes
        self.hidden = keras.layers.Dense(hidden, activation="relu")
        self.out = keras.layers.Dense(classes)

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "hidden": self.hidden_units, "classes": self.classes}


def subclassed_model(opt="sgd", seed=1):
    keras.utils.set_random_seed(seed)
    model = TwoLayer()
    model.compile(
        optimizer=optimizer(opt),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class Weights:
    """Weights kept apart from their model (a process's, a reference's), as `get_weights` gives."""

    def __init__(self, weights):
        self.weights = weights

    def get_weights(self):
        return self.weights


def max_weight_difference(a, b) -> float:
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


def assert_same_history(reference: dict, actual: dict, rtol=1e-5, atol=1e-6):
    assert sorted(reference) == sorted(actual)
    for key in reference:
        np.testing.assert_allclose(actual[key], reference[key], rtol=rtol, atol=atol, err_msg=key)


#: 64 rows in batches of 16; row 44 is in batch 3, in the second half of it: the second
#: replica's (or rank's) rows. One infinite feature makes that replica's loss NaN (a NaN
#: input would not do: ReLU turns it into 0).
NAN_ROW, NAN_BATCH = 44, 16


def nan_data():
    """Data whose batch 3 (of 16 rows) makes the second replica's loss NaN."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 3, size=64)
    x[NAN_ROW, 3] = np.inf
    return x, y


KERAS_EPOCHS = 12


def keras_callbacks(folder) -> list:
    """Keras' own callbacks writing into `folder` (a checkpoint of the best epoch, a CSV log, event
    files), the learning rate halved on a plateau and training stopped early (before
    `KERAS_EPOCHS`, for `dense_model` on `dense_data` with validation data)."""
    return [
        keras.callbacks.ModelCheckpoint(f"{folder}/best.keras", save_best_only=True),
        keras.callbacks.CSVLogger(f"{folder}/log.csv"),
        keras.callbacks.TensorBoard(f"{folder}/board"),
        keras.callbacks.ReduceLROnPlateau(factor=0.5, patience=1, min_delta=0.01),
        keras.callbacks.EarlyStopping(patience=3, min_delta=0.01),
    ]
