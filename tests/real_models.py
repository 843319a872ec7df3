"""Models users train, for the tests: `keras.applications` models and the keras.io
transfer-learning guide's flow. Each builder seeds its weights, so that a wrapped model and a
single-device one start alike; the references (one device) are shared by the in-process tests and
the multi-process jobs' tests.

Deep models with BatchNormalization amplify float32 rounding chaotically (Adam turns a bias
feeding BatchNormalization, whose true gradient is 0, into steps of the learning rate; one device
against itself with each batch's rows permuted differs by 1e-2), so they are trained and compared
in float64, where kmirror and one device agree to 1e-9 or better. With a batch of 5 rows or fewer
at ResNet50's last stage (1 x 1 pixels at 32 x 32) even float64 is chaotic; it trains at 64 x 64.
ConvNeXtTiny has no batch statistics (LayerNormalization): in float32 kmirror and one device agree
to 2e-6 after its 4 steps, within the suite's 1e-5; in float64 its depthwise convolutions take 6 s
a step on CPUs.
"""

import contextlib
import dataclasses
import functools

import keras
import numpy as np

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
    """A deep model trained 2 epochs: `rows` rows in batches of `batch` (7: not divisible by 2
    or 3; the final batch of 5 is split 2/3 and 1/2/2), images of `size` pixels."""

    name: str
    size: int = 32
    rows: int = 12
    batch: int = 7
    epochs: int = 2
    floatx: str = "float64"
    tolerance: float = 1e-8  # measured: 1e-10 to 1e-9 in float64

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


DEEP = {
    deep.name: deep
    for deep in (
        Deep("MobileNetV2"),
        Deep("EfficientNetB0"),
        Deep("ResNet50", size=64),
        Deep("DenseNet121"),
        Deep("ConvNeXtTiny", floatx="float32", tolerance=1e-5),
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


@functools.cache
def deep_reference(name: str):
    """`DEEP[name]` trained on one device: (weights, history)."""
    deep = DEEP[name]
    with precision(deep.floatx):
        model = deep.build()
        model.optimizer.build(model.trainable_variables)  # built before fit, as kmirror does
        history = deep.fit(model)
    return model.get_weights(), history


# -- the keras.io transfer-learning guide -------------------------------------------------------
TRANSFER_SIZE, TRANSFER_ROWS, TRANSFER_BATCH = 16, 45, 13


def transfer_model(seed: int = 1):
    """The guide's model on a small base: augmentation, rescaling, the base in inference mode
    (its BatchNormalization too), pooling, dropout and a logit; the base frozen. Returns
    (model, base)."""
    keras.utils.set_random_seed(seed)
    base_input = keras.Input((TRANSFER_SIZE, TRANSFER_SIZE, 3))
    hidden = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(base_input)
    hidden = keras.layers.BatchNormalization()(hidden)
    hidden = keras.layers.ReLU()(hidden)
    hidden = keras.layers.Conv2D(8, 3, strides=2, use_bias=False)(hidden)
    hidden = keras.layers.BatchNormalization()(hidden)
    base = keras.Model(base_input, keras.layers.ReLU()(hidden), name="base")
    base.trainable = False

    inputs = keras.Input((TRANSFER_SIZE, TRANSFER_SIZE, 3))
    x = keras.layers.RandomFlip("horizontal")(inputs)
    x = keras.layers.RandomRotation(0.1)(x)
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
    return x.astype("float32"), rng.integers(0, 2, TRANSFER_ROWS).astype("float32")


def transfer_flow(model, base) -> dict:
    """The guide's flow on `model` (wrapped or not) and the user's `base`: train the head 2
    epochs; unfreeze the base through the user's reference, compile again with a small learning
    rate, fine-tune 2 epochs. Returns both fits' histories, keyed "head ..." and "fine ..."."""
    x, y = transfer_data()
    kwargs = dict(batch_size=TRANSFER_BATCH, epochs=2, shuffle=False, verbose=0)
    head = model.fit(x, y, **kwargs).history
    base.trainable = True
    _compile_transfer(model, keras.optimizers.Adam(1e-4))
    fine = model.fit(x, y, **kwargs).history
    return {
        **{f"head {key}": value for key, value in head.items()},
        **{f"fine {key}": value for key, value in fine.items()},
    }


@functools.cache
def transfer_reference():
    """The flow on one device: (weights, histories, the base's weights)."""
    model, base = transfer_model()
    history = transfer_flow(model, base)
    return model.get_weights(), history, base.get_weights()
