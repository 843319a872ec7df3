"""Models users train, for the tests: `keras.applications` models, two keras.io examples' models
and the keras.io transfer-learning guide's flow. Each builder seeds its weights, so that a wrapped
model and a single-device one start alike; the references (one device) are shared by the
in-process tests and the multi-process jobs' tests.

Models with BatchNormalization trained with Adam amplify rounding: Adam divides a gradient that
BatchNormalization makes nearly 0 (the sum of terms that cancel) by its own size, so the rounding
of that sum moves the weight. One device against itself with each batch's rows in another order
then differs by 2e-3 in float32 (the timeseries model below, after 6 steps; 1.5e-12 in float64).
So these models are trained and compared in float64:

- keras.io's "image classification from scratch" and "timeseries classification from scratch"
  models agree with one device within 1e-10 (measured: 3e-13 to 3e-12).
- The deep `keras.applications` models (up to 121 layers) amplify float64 rounding too: one device
  against itself with each batch's rows permuted differs by 1.2e-10 to 6.5e-10 after 4 steps
  (MobileNetV2, ResNet50, DenseNet121; batches of 7 and 5 rows). kmirror lands in that noise
  (measured 1.2e-10 to 1.0e-9); they are asserted within 2e-9, three times the largest noise
  measured. The suite trains the largest of them 2 steps (a batch of 7 rows per epoch), where
  the noise is smaller still.

With a batch of 5 rows or fewer at ResNet50's last stage (1 x 1 pixels at 32 x 32) even float64
is chaotic; it trains at 64 x 64. ConvNeXtTiny has no batch statistics (LayerNormalization): in
float32 kmirror and one device agree to 2e-6 after its 4 steps, within the suite's 1e-5; in
float64 its depthwise convolutions take 6 s a step on CPUs.
"""

import contextlib
import dataclasses

import keras
import numpy as np
from shared_cache import shared

#: The smallest member of each `keras.applications` family, at the smallest input it accepts.
FAMILIES = {
    "convnext": ("ConvNeXtTiny", 32),
    "densenet": ("DenseNet121", 32),
    "efficientnet": ("EfficientNetB0", 32),
    "efficientnet_v2": ("EfficientNetV2B0", 32),
    "inception_resnet_v2": ("InceptionResNetV2", 75),
    "inception_v3": ("InceptionV3", 75),
    "mobilenet": ("MobileNet", 32),
    "mobilenet_v2": ("MobileNetV2", 32),
    "mobilenet_v3": ("MobileNetV3Small", 32),
    "nasnet": ("NASNetMobile", 32),
    "resnet": ("ResNet50", 32),
    "resnet_v2": ("ResNet50V2", 32),
    "vgg16": ("VGG16", 32),
    "vgg19": ("VGG19", 32),
    "xception": ("Xception", 71),
}


def application(name: str, size: int, classes: int = 10, seed: int = 1) -> keras.Model:
    """`keras.applications.<name>` without downloaded weights, compiled with Adam."""
    keras.utils.set_random_seed(seed)
    model = getattr(keras.applications, name)(
        weights=None, input_shape=(size, size, 3), classes=classes
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=["accuracy"],
    )
    return model


@dataclasses.dataclass(frozen=True)
class Deep:
    """A `keras.applications` model trained 2 epochs: `rows` rows in batches of `batch` (7: not
    divisible by 2 or 3, split 3/4 and 2/2/3), images of `size` pixels. One batch per epoch by
    default: each side traces the step once."""

    name: str
    size: int = 32
    rows: int = 7
    batch: int = 7
    epochs: int = 2
    floatx: str = "float64"
    tolerance: float = 2e-9  # float64's own noise in these models: see the module's docstring
    #: The in-process (replicas, reducer) it trains on (tests/test_real_models.py): the keras.io
    #: models 2 and 3; the keras.applications models one count, their shares uneven.
    replicas: tuple = ((2, "hierarchical_copy"), (3, "one_device"))
    #: Whether the one-device reference trains eagerly (`deep_reference` says why).
    eager_reference: bool = True

    def build(self, seed: int = 1) -> keras.Model:
        return application(self.name, self.size, seed=seed)

    def data(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(self.rows, self.size, self.size, 3))
        return x, rng.integers(0, 10, self.rows)

    def fit(self, model) -> dict:
        x, y = self.data()
        kwargs = dict(batch_size=self.batch, epochs=self.epochs, shuffle=False, verbose=0)
        return model.fit(x, y, **kwargs).history


def image_classifier(size: int) -> keras.Model:
    """keras.io's "Image classification from scratch" model (a small Xception), as compiled
    there."""
    inputs = keras.Input((size, size, 3))
    x = keras.layers.Rescaling(1.0 / 255)(inputs)
    x = keras.layers.Conv2D(128, 3, strides=2, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    previous = x
    for width in (256, 512, 728):
        x = keras.layers.Activation("relu")(x)
        x = keras.layers.SeparableConv2D(width, 3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Activation("relu")(x)
        x = keras.layers.SeparableConv2D(width, 3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = keras.layers.Conv2D(width, 1, strides=2, padding="same")(previous)
        x = previous = keras.layers.add([x, residual])
    x = keras.layers.SeparableConv2D(1024, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.25)(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(
        optimizer=keras.optimizers.Adam(3e-4),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy(name="acc")],
    )
    return model


def timeseries_classifier(size: int) -> keras.Model:
    """keras.io's "Timeseries classification from scratch" model (3 Conv1D + BatchNormalization
    + ReLU blocks), as compiled there."""
    inputs = keras.Input((size, 1))
    x = inputs
    for _ in range(3):
        x = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(x))
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )
    return model


KERAS_IO = {"image_classification": image_classifier, "timeseries": timeseries_classifier}


@dataclasses.dataclass(frozen=True)
class KerasIo(Deep):
    """A keras.io example's model trained 2 epochs on 80 rows in batches of 35 (not divisible by
    2 or 3; a final batch of 10): images of `size` pixels, or series of `size` steps."""

    rows: int = 80
    batch: int = 35
    tolerance: float = 1e-10

    def build(self, seed: int = 1) -> keras.Model:
        keras.utils.set_random_seed(seed)
        return KERAS_IO[self.name](self.size)

    def data(self):
        rng = np.random.default_rng(0)
        if self.name == "timeseries":
            return rng.normal(size=(self.rows, self.size, 1)), rng.integers(0, 2, self.rows)
        x = rng.uniform(0, 255, size=(self.rows, self.size, self.size, 3))
        return x, rng.integers(0, 2, self.rows).astype(float)


#: The largest models on 2 replicas (shares of 3 and 4 rows): their trace costs per replica, and
#: MobileNetV2 and the feature matrix take 3 (a replica without rows among them).
TWO = ((2, "one_device"),)
DEEP = {
    deep.name: deep
    for deep in (
        # 15 rows: batches of 7, 7 and a final batch of 1 row, which leaves replicas without rows
        # (its depthwise convolutions' gradient of an empty batch: tests/test_empty_rows.py).
        # On hierarchical_copy, where the larger ones train on one_device.
        Deep("MobileNetV2", rows=15, replicas=((3, "hierarchical_copy"),)),
        Deep("EfficientNetB0", replicas=TWO),
        Deep("ResNet50", size=64, replicas=TWO),
        Deep("DenseNet121", replicas=TWO),
        Deep("ConvNeXtTiny", floatx="float32", tolerance=1e-5, replicas=TWO, eager_reference=False),
        KerasIo("image_classification", size=32),
        KerasIo("timeseries", size=128),
    )
}


@contextlib.contextmanager
def precision(floatx: str):
    """Keras makes `floatx` variables and computes in `floatx` inside this block."""
    before, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(floatx)  # the policy Keras made of floatx is kept otherwise
    try:
        yield
    finally:
        keras.config.set_floatx(before)
        keras.config.set_dtype_policy(policy)


def deep_reference(name: str):
    """`DEEP[name]` trained on one device: (weights, history), trained once per run.

    The float64 models' reference trains eagerly: the same kernels, one op at a time, with no
    graph to trace and optimise, which is most of a compiled fit of 2 steps (DenseNet121: 15 s
    against 48 s). It differs from Keras' compiled fit by what the graph's optimiser rewrites:
    measured 1.9e-12 to 6.1e-11 after the 2 epochs (the keras.applications models) and 3e-13
    (the keras.io models), far inside their tolerances. ConvNeXtTiny, in float32, differs by
    3.3e-6 (a third of its tolerance): its reference is compiled."""

    def train():
        deep = DEEP[name]
        with precision(deep.floatx):
            model = deep.build()
            model.optimizer.build(model.trainable_variables)  # built before fit, as kmirror does
            model.run_eagerly = deep.eager_reference
            history = deep.fit(model)
        return model.get_weights(), history

    return shared(f"deep-{name}", train)


# -- the keras.io transfer-learning guide -------------------------------------------------------
#: 40 rows in batches of 13: the final batch of 1 row leaves replicas without rows.
TRANSFER_SIZE, TRANSFER_ROWS, TRANSFER_BATCH = 16, 40, 13
#: The flow runs in float64, and Adam amplifies its rounding (the head's gradient sums near 0):
#: one device against itself with each batch's rows reversed (augmentation and dropout left
#: out) differs by 3.7e-11; kmirror, whose replicas sum the rows in another order, by 1.6e-10
#: to 2.1e-10 (2 and 3 replicas). Asserted within 1e-9.
TRANSFER_TOLERANCE = 1e-9


def transfer_model(seed: int = 1):
    """The guide's model on a small MobileNet-like base (a convolution, a depthwise convolution, a
    pointwise one, each with BatchNormalization), in float64: augmentation, rescaling, the base
    in inference mode (its BatchNormalization too), pooling, dropout and a logit; the base
    frozen. Returns (model, base)."""
    keras.utils.set_random_seed(seed)
    with precision("float64"):
        base_input = keras.Input((TRANSFER_SIZE, TRANSFER_SIZE, 3))
        hidden = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(base_input)
        hidden = keras.layers.BatchNormalization()(hidden)
        hidden = keras.layers.ReLU()(hidden)
        hidden = keras.layers.DepthwiseConv2D(3, strides=2, use_bias=False)(hidden)
        hidden = keras.layers.BatchNormalization()(hidden)
        hidden = keras.layers.ReLU()(hidden)
        hidden = keras.layers.Conv2D(8, 1, use_bias=False)(hidden)
        hidden = keras.layers.BatchNormalization()(hidden)
        base = keras.Model(base_input, keras.layers.ReLU()(hidden), name="base")
        base.trainable = False

        inputs = keras.Input((TRANSFER_SIZE, TRANSFER_SIZE, 3))
        # The guide rotates; Keras' RandomRotation fails in float64 (3.15.1: a float32 constant
        # in its affine matrix), so the flow translates, by the same per-row affine draw.
        x = keras.layers.RandomFlip("horizontal")(inputs)
        x = keras.layers.RandomTranslation(0.1, 0.1)(x)
        x = keras.layers.Rescaling(scale=1 / 127.5, offset=-1)(x)
        x = base(x, training=False)
        x = keras.layers.GlobalAveragePooling2D()(x)
        x = keras.layers.Dropout(0.2)(x)
        model = keras.Model(inputs, keras.layers.Dense(1)(x))
        _compile_transfer(model, keras.optimizers.Adam())
    return model, base


def _compile_transfer(model, optimizer):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy()],
    )


def transfer_data():
    rng = np.random.default_rng(4)
    x = rng.uniform(0, 255, size=(TRANSFER_ROWS, TRANSFER_SIZE, TRANSFER_SIZE, 3))
    return x, rng.integers(0, 2, TRANSFER_ROWS).astype("float64")


def transfer_flow(model, base) -> dict:
    """The guide's flow on `model` (wrapped or not) and the user's `base`, in float64: train the
    head 2 epochs; unfreeze the base through the user's reference, compile again with a small
    learning rate, fine-tune 2 epochs. Returns both fits' histories, keyed "head ..." and
    "fine ..."."""
    x, y = transfer_data()
    kwargs = dict(batch_size=TRANSFER_BATCH, epochs=2, shuffle=False, verbose=0)
    with precision("float64"):
        head = model.fit(x, y, **kwargs).history
        base.trainable = True
        _compile_transfer(model, keras.optimizers.Adam(1e-4))
        fine = model.fit(x, y, **kwargs).history
    return {
        **{f"head {key}": value for key, value in head.items()},
        **{f"fine {key}": value for key, value in fine.items()},
    }


def transfer_reference():
    """The flow on one device: (weights, histories, the base's weights), trained once per run."""

    def train():
        model, base = transfer_model()
        history = transfer_flow(model, base)
        return model.get_weights(), history, base.get_weights()

    return shared("transfer", train)
