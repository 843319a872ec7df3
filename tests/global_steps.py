"""Own steps that compute from the whole batch, as generative and self-supervised programs do: each
builder returns a compiled model in float64, seeded, whose step uses what one device computes
from the global batch (tests/features.py lists them in the exactness matrix).

- `raw_logs`: a critic and a generator (WGAN style) whose step returns raw tensors as its logs;
- `batch_norm_step`: BatchNormalization in a model called from an own step, on uneven rows;
- `per_row_loss`: the gradient of a vector of per-row losses (the gradient of their sum);
- `info_nce`: a contrastive loss over two noisy views: every row's softmax over every row;
- `global_draw`: noise drawn for the global batch's size, fixed when the model is made;
- `uneven_metric`: a metric updated with arguments of different row counts (real and generated);
- `two_domains_model`: a CycleGAN's persistent tape and list of optimizers, BYOL's moving average;
- `prototypes_model`: a layer called with inputs that are not rows (prototypes, a broadcast row).
"""

import functools

import keras
import numpy as np
import tensorflow as tf
from keras import layers as L
from keras import ops
from keras.src.backend.common import global_state
from real_models import precision

FLOATX = "float64"
ROWS, WIDTH, LATENT = 101, 6, 3


def _seeded(build):
    """A builder of this module: `build` makes and compiles its model with Keras seeded and in
    float64."""

    @functools.wraps(build)
    def built(*args, **kwargs):
        keras.utils.set_random_seed(1)
        with precision(FLOATX):
            return build(*args, **kwargs)

    return built


def unlabelled(seed: int = 8, rows: int = ROWS):
    x = np.random.default_rng(seed).normal(size=(rows, WIDTH))
    return x, None, None


def labelled():
    x, _, _ = unlabelled()
    y = x @ np.linspace(-1, 1, WIDTH * 2).reshape(WIDTH, 2)
    return x, y, None


class RawLogs(keras.Model):
    """A critic and a generator trained in turn; the step returns its raw tensors as logs."""

    def __init__(self):
        super().__init__()
        self.critic = keras.Sequential([keras.Input((WIDTH,)), L.Dense(8, "tanh"), L.Dense(1)])
        self.generator = keras.Sequential(
            [keras.Input((LATENT,)), L.Dense(8, "tanh"), L.Dense(WIDTH)]
        )
        self.seed_generator = keras.random.SeedGenerator(3)

    def compile(self):
        super().compile()
        self.c_optimizer = keras.optimizers.Adam(0.01)
        self.g_optimizer = keras.optimizers.SGD(0.05)

    def train_step(self, data):
        real = data[0] if isinstance(data, tuple) else data
        rows = ops.shape(real)[0]
        noise = keras.random.normal((rows, LATENT), seed=self.seed_generator, dtype=FLOATX)
        with tf.GradientTape() as tape:
            critic_real = self.critic(real)
            c_loss = ops.mean(self.critic(self.generator(noise))) - ops.mean(critic_real)
        grads = tape.gradient(c_loss, self.critic.trainable_weights)
        self.c_optimizer.apply_gradients(zip(grads, self.critic.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = -ops.mean(self.critic(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"c_loss": c_loss, "g_loss": g_loss, "critic_real": ops.mean(critic_real, axis=0)[0]}


@_seeded
def raw_logs():
    model = RawLogs()
    model.compile()
    return model


class MeanSquareStep(keras.Sequential):
    """An own train_step whose loss is a mean it computes itself."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = ops.mean(ops.square(y_pred - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


@_seeded
def batch_norm_step():
    model = MeanSquareStep(
        [
            keras.Input((WIDTH,)),
            L.Dense(8),
            L.BatchNormalization(),
            L.Activation("tanh"),
            L.Dense(2),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


class PerRowLoss(keras.Sequential):
    """A step whose loss is one value per row: its gradient is the gradient of their sum."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            losses = keras.losses.mean_squared_error(y, self(x, training=True))
        grads = tape.gradient(losses, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": ops.mean(losses)}


@_seeded
def per_row_loss():
    model = PerRowLoss([keras.Input((WIDTH,)), L.Dense(8, "tanh"), L.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.001))
    return model


class InfoNCE(keras.Model):
    """Two noisy views of each row; each row's view must pick its other view among every view."""

    def __init__(self):
        super().__init__()
        self.augment = keras.Sequential([keras.Input((WIDTH,)), L.GaussianNoise(0.3, seed=5)])
        self.encoder = keras.Sequential([keras.Input((WIDTH,)), L.Dense(8, "relu"), L.Dense(4)])

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        with tf.GradientTape() as tape:
            views = [self.augment(x, training=True) for _ in range(2)]
            z = ops.normalize(self.encoder(ops.concatenate(views, axis=0)), axis=1)
            rows = ops.shape(x)[0]
            similarity = ops.matmul(z, ops.transpose(z)) / 0.2 - 1e9 * ops.eye(
                2 * rows, dtype=z.dtype
            )
            labels = ops.concatenate([ops.arange(rows, 2 * rows), ops.arange(0, rows)], axis=0)
            loss = ops.mean(
                keras.losses.sparse_categorical_crossentropy(labels, similarity, from_logits=True)
            )
        grads = tape.gradient(loss, self.encoder.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.encoder.trainable_weights))
        return {"loss": loss}


@_seeded
def info_nce():
    model = InfoNCE()
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


class GlobalDraw(RawLogs):
    """The generator's noise drawn for a batch size fixed when the model is made (keras.io's
    DDIM draws `(self.batch_size, ...)`)."""

    batch_size = 33

    def train_step(self, data):
        noise = keras.random.normal(
            (self.batch_size, LATENT), seed=self.seed_generator, dtype=FLOATX
        )
        with tf.GradientTape() as tape:
            g_loss = ops.mean(ops.square(self.generator(noise) - ops.mean(data, axis=0)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"g_loss": g_loss}


@_seeded
def global_draw():
    model = GlobalDraw()
    model.compile()
    return model


def divisible():
    return unlabelled(rows=99)  # batches of 33: the draw's size is every batch's


class MeanDistance(keras.metrics.Metric):
    """The distance between the means of two sets of rows of any sizes (KID's shape)."""

    def __init__(self):
        super().__init__(name="mean_distance", dtype=FLOATX)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, real, generated):
        gap = ops.mean(real, axis=0) - ops.mean(generated, axis=0)
        self.total.assign_add(ops.sqrt(ops.sum(ops.square(gap))))
        self.count.assign_add(ops.cast(1, self.dtype))

    def result(self):
        return self.total / self.count


class UnevenMetric(RawLogs):
    """A generator step whose metric compares the batch's rows with twice as many generated."""

    def compile(self):
        super().compile()
        self.distance = MeanDistance()

    @property
    def metrics(self):
        return [self.distance]

    def train_step(self, data):
        rows = ops.shape(data)[0]
        noise = keras.random.normal((2 * rows, LATENT), seed=self.seed_generator, dtype=FLOATX)
        with tf.GradientTape() as tape:
            generated = self.generator(noise)
            g_loss = ops.mean(ops.square(ops.mean(generated, axis=0) - ops.mean(data, axis=0)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.distance.update_state(data, generated)
        return {"g_loss": g_loss, "distance": self.distance.result()}


@_seeded
def uneven_metric():
    model = UnevenMetric()
    model.compile()
    return model


class ComputeLoss(keras.Sequential):
    """The guide's step with the compiled loss (`compute_loss`: the loss and the weights'
    regularisation, which reads the weights outside any layer call)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


@_seeded
def regularised():
    dense = L.Dense(8, "tanh", kernel_regularizer=keras.regularizers.L2(0.05))
    model = ComputeLoss([keras.Input((WIDTH,)), dense, L.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


class GradientPenalty(RawLogs):
    """keras.io's WGAN-GP: the critic's loss holds the norm of its gradient at points between
    real and generated rows (a gradient of a gradient)."""

    def train_step(self, data):
        rows = ops.shape(data)[0]
        noise = keras.random.normal((rows, LATENT), seed=self.seed_generator, dtype=FLOATX)
        mixing = keras.random.uniform((rows, 1), seed=self.seed_generator, dtype=FLOATX)
        with tf.GradientTape() as tape:
            generated = self.generator(noise)
            between = mixing * data + (1 - mixing) * generated
            with tf.GradientTape() as inner:
                inner.watch(between)
                critic = self.critic(between)
            slopes = ops.sqrt(ops.sum(ops.square(inner.gradient(critic, between)), axis=1))
            penalty = ops.mean(ops.square(slopes - 1))
            c_loss = ops.mean(self.critic(generated)) - ops.mean(self.critic(data)) + penalty
        variables = self.critic.trainable_weights
        self.c_optimizer.apply_gradients(zip(tape.gradient(c_loss, variables), variables))
        return {"c_loss": c_loss, "penalty": penalty}


@_seeded
def gradient_penalty():
    model = GradientPenalty()
    model.compile()
    return model


class TwoDomains(keras.Model):
    """keras.io's CycleGAN pattern: two generators and two discriminators trained from one
    persistent tape, their four optimizers held in a list; and BYOL's: a moving average of a
    generator's weights that the step writes itself (a target network)."""

    def __init__(self):
        super().__init__()
        self.to_y, self.to_x = (_mlp(WIDTH, WIDTH) for _ in range(2))
        self.judge_x, self.judge_y = (_mlp(WIDTH, 1) for _ in range(2))
        self.average = _mlp(WIDTH, WIDTH)

    def compile(self):
        super().compile()
        self.optimizers = [keras.optimizers.Adam(0.01) for _ in range(3)]
        self.optimizers.append(keras.optimizers.SGD(0.05, momentum=0.5))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            fake_y, fake_x = self.to_y(x), self.to_x(y)
            cycled_x, cycled_y = self.to_x(fake_y), self.to_y(fake_x)
            same_x = self.to_x(x)
            y_loss = _mse(self.judge_y(fake_y), 1.0) + 10 * _mse(x, cycled_x)
            x_loss = _mse(self.judge_x(fake_x), 1.0) + 10 * _mse(y, cycled_y) + _mse(x, same_x)
            judge_x = _mse(self.judge_x(x), 1.0) + _mse(self.judge_x(fake_x), 0.0)
            judge_y = _mse(self.judge_y(y), 1.0) + _mse(self.judge_y(fake_y), 0.0)
        models = (self.to_y, self.to_x, self.judge_x, self.judge_y)
        for loss, model, optimizer in zip(
            (y_loss, x_loss, judge_x, judge_y), models, self.optimizers, strict=True
        ):
            variables = model.trainable_weights
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        for average, weight in zip(self.average.weights, self.to_y.weights, strict=True):
            average.assign(0.9 * average + 0.1 * weight)
        return {"y_loss": y_loss, "x_loss": x_loss, "judges": judge_x + judge_y}


def _mlp(inputs: int, outputs: int) -> keras.Model:
    return keras.Sequential([keras.Input((inputs,)), L.Dense(8, "tanh"), L.Dense(outputs)])


def _mse(a, b):
    return ops.mean(ops.square(a - b))


@_seeded
def two_domains_model():
    model = TwoDomains()
    model.compile()
    return model


def two_domains():
    x, _, _ = unlabelled()
    return x, np.tanh(x[:, ::-1] + 0.5), None


class Distances(L.Layer):
    """Each row's negative squared distance to each prototype, shifted by one row for all."""

    def call(self, rows, prototypes, shift):
        rows = rows + shift
        return -ops.sum(ops.square(ops.expand_dims(rows, 1) - ops.expand_dims(prototypes, 0)), -1)


class Prototypes(keras.Model):
    """A layer called with inputs that are not rows of the batch: class prototypes (3 rows, made
    from a weight by the encoder) and one row added to every row (a weight of shape (1, 5))."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.Sequential([keras.Input((WIDTH,)), L.Dense(5, "tanh")])
        self.centres = self.add_weight(shape=(3, WIDTH), initializer="random_normal")
        self.shift = self.add_weight(shape=(1, 5), initializer="random_normal")
        self.distances = Distances()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            prototypes = self.encoder(self.centres)
            logits = self.distances(self.encoder(x), prototypes, 2.0 * self.shift)
            loss = ops.mean(ops.sparse_categorical_crossentropy(y, logits, from_logits=True))
        variables = self.trainable_weights
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return {"loss": loss}


@_seeded
def prototypes_model():
    model = Prototypes()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def three_classes():
    x, _, _ = unlabelled()
    return x, np.argmax(x[:, :3], axis=1), None


class SelfSupervised(keras.Model):
    """keras.io's SimCLR pattern: sub-models without an `Input`, which Keras builds in the first
    step; no `call()`; a compiled loss and metrics its steps never use; batches that zip unlabelled
    rows with fewer labelled ones; a contrastive loss on the first, a linear probe on the second."""

    def __init__(self):
        super().__init__()
        self.augmenter = keras.Sequential([L.GaussianNoise(0.3, seed=5)])
        self.encoder = keras.Sequential([L.Dense(8, "relu"), L.Dense(4)])
        self.probe = keras.Sequential([L.Dense(2)])

    def compile(self, **kwargs):
        super().compile(**kwargs)  # no optimizer: Keras makes its default, which no step uses
        self.c_optimizer = keras.optimizers.Adam(0.01)
        self.p_optimizer = keras.optimizers.SGD(0.1)
        self.c_loss = keras.metrics.Mean(name="c_loss")
        self.p_loss = keras.metrics.Mean(name="p_loss")

    @property
    def metrics(self):
        return [self.c_loss, self.p_loss]

    def train_step(self, data):
        unlabelled, (labelled, labels) = data
        with tf.GradientTape() as tape:
            views = [self.augmenter(unlabelled, training=True) for _ in range(2)]
            z = ops.normalize(self.encoder(ops.concatenate(views, axis=0)), axis=1)
            rows = ops.shape(unlabelled)[0]
            similarity = ops.matmul(z, ops.transpose(z)) / 0.2 - 1e9 * ops.eye(
                2 * rows, dtype=z.dtype
            )
            pairs = ops.concatenate([ops.arange(rows, 2 * rows), ops.arange(0, rows)], axis=0)
            c_loss = ops.mean(
                keras.losses.sparse_categorical_crossentropy(pairs, similarity, from_logits=True)
            )
        variables = self.encoder.trainable_weights
        self.c_optimizer.apply_gradients(zip(tape.gradient(c_loss, variables), variables))
        features = ops.stop_gradient(self.encoder(labelled))
        with tf.GradientTape() as tape:
            p_loss = ops.mean(ops.square(self.probe(features) - labels))
        variables = self.probe.trainable_weights
        self.p_optimizer.apply_gradients(zip(tape.gradient(p_loss, variables), variables))
        self.c_loss.update_state(c_loss)
        self.p_loss.update_state(p_loss)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        labelled, labels = data
        self.p_loss.update_state(ops.mean(ops.square(self.probe(self.encoder(labelled)) - labels)))
        return {"p_loss": self.p_loss.result()}


@_seeded
def self_supervised():
    model = SelfSupervised()
    model.compile(loss="mse", metrics=["mae"])
    return model


def zipped():
    """Batches of 35 unlabelled rows zipped with batches of 7 labelled ones (3 of each)."""
    x, y, _ = labelled()
    unlabelled = tf.data.Dataset.from_tensor_slices(x).batch(35)
    pairs = tf.data.Dataset.from_tensor_slices((x[:21], y[:21])).batch(7)
    return tf.data.Dataset.zip((unlabelled, pairs)), None, None


def validation():
    x, y, _ = labelled()
    return x[-20:], y[-20:]


class Unseeded(RawLogs):
    """The generator's noise drawn with `keras.random` and no seed: Keras' global seed generator,
    which Keras makes at the first such draw."""

    def train_step(self, data):
        noise = keras.random.normal((ops.shape(data)[0], LATENT), dtype=FLOATX)
        with tf.GradientTape() as tape:
            g_loss = ops.mean(ops.square(self.generator(noise) - data))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"g_loss": g_loss}


@_seeded
def unseeded():
    # Keras 3.15's set_random_seed also resets Keras' global seed generator, so a seeded program
    # draws alike run after run; Keras 3.12's keeps it: reset it here as 3.15 does.
    global_state.set_global_attribute("global_seed_generator", None)
    model = Unseeded()
    model.compile()
    return model


class SupervisedContrastive(keras.losses.Loss):
    """keras.io's supervised contrastive loss: every row's softmax over its similarity to every
    row of the batch, the rows of its class the targets (it overrides `__call__`, as there)."""

    def __init__(self, temperature=0.5, name=None):
        super().__init__(name=name)
        self.temperature = temperature

    def __call__(self, labels, features, sample_weight=None):
        z = ops.normalize(features, axis=1)
        logits = ops.matmul(z, ops.transpose(z)) / self.temperature
        labels = ops.reshape(labels, (-1, 1))
        same = ops.cast(ops.equal(labels, ops.transpose(labels)), logits.dtype)
        targets = same / ops.sum(same, axis=1, keepdims=True)
        return ops.mean(keras.losses.categorical_crossentropy(targets, logits, from_logits=True))


@_seeded
def compiled_contrastive():
    model = keras.Sequential([keras.Input((WIDTH,)), L.Dense(8, "relu"), L.Dense(4)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=SupervisedContrastive())
    return model


def classes():
    x, _, _ = unlabelled()
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0), None


@_seeded
def coupled_losses(coupled: bool = True):
    """Keras' own losses and metrics that couple a batch's rows: Dice and Tversky as metrics of a
    sigmoid output, and (`coupled`) Dice as its loss and Circle as the loss of an embedding of the
    same rows; else losses of one row each (the compiled step, whose metrics must still see the
    whole batch)."""
    inputs = keras.Input((WIDTH,))
    hidden = L.Dense(8, "tanh")(inputs)
    mask = L.Dense(4, "sigmoid", name="mask")(hidden)
    embedding = L.Dense(3, name="embedding")(hidden)
    model = keras.Model(inputs, {"mask": mask, "embedding": embedding})
    losses = (
        {"mask": keras.losses.Dice(), "embedding": keras.losses.Circle()}
        if coupled
        else {
            "mask": "binary_crossentropy",
            "embedding": keras.losses.SparseCategoricalCrossentropy(True),
        }
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=losses,
        metrics={
            "mask": [
                keras.metrics.MeanMetricWrapper(keras.losses.dice, name="dice"),
                keras.metrics.MeanMetricWrapper(keras.losses.tversky, name="tversky"),
            ]
        },
    )
    return model


def masks_and_classes():
    """Per row, a mask of 4 cells and a class (of 3)."""
    x, classes_, _ = classes()
    mask = (x[:, :4] > 0).astype(FLOATX)
    return x, {"mask": mask, "embedding": classes_}, None


@_seeded
def random_crop():
    """Keras' RandomCrop in training mode: one crop offset per batch (a draw of shape `()`)."""
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            L.RandomCrop(4, 4, seed=2),
            L.Conv2D(3, 3),
            L.GlobalAveragePooling2D(),
            L.Dense(2),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def pictures():
    x = np.random.default_rng(4).normal(size=(ROWS, 6, 6, 2))
    return x, x[:, :2, :2, 0].reshape(ROWS, 4)[:, :2], None


class Reshuffled(keras.utils.PyDataset):
    """keras.io's pattern: a PyDataset that reshuffles its rows in `on_epoch_end` with its own
    generator (Keras calls it once before the first pass of fit, and before each validation)."""

    def __init__(self, x, y, seed, batch_size=33):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        order = self.rng.permutation(len(self.x))
        self.x, self.y = self.x[order], self.y[order]


@_seeded
def reshuffled_model():
    model = keras.Sequential([keras.Input((WIDTH,)), L.Dense(8, "tanh"), L.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def reshuffled():
    x, y, _ = labelled()
    return Reshuffled(x, y, seed=1), None, None


def reshuffled_validation():
    x, y, _ = labelled()
    return Reshuffled(x[:40], y[:40], seed=2)
