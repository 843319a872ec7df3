"""The Keras features of the exactness matrix: each builds a compiled model and its data, seeded, so
that a wrapped copy and a single-device copy can train side by side.

Used in one process (tests/test_features.py) and by the multi-process job (features_job.py).
"""

import dataclasses
import functools
from collections.abc import Callable

import batch_steps
import call_steps
import default_steps
import global_steps
import gradient_steps
import keras
import numpy as np
import per_row_steps
import state_steps
import tensorflow as tf
from keras import layers as L
from keras import ops
from models import (
    BATCH,
    N_SAMPLES,
    assert_same_history,
    dense_data,
    multi_io_data,
    multi_io_model,
    optimizer,
)
from own_steps import (
    GuideStep,
    custom_layer,
    gan,
    guide_step,
    images,
    subclassed_without_config,
    vae,
)
from real_models import precision
from shared_cache import shared

EPOCHS = 3


@dataclasses.dataclass
class Feature:
    """A model, its data and how it is fit."""

    build: Callable[[], keras.Model]
    data: Callable[[], tuple]  # (x, y, sample_weight or None)
    batch_size: int = BATCH
    tolerance: float = 1e-5
    #: Also evaluate after fit (its logs join the history as "evaluate_<name>").
    evaluate: bool = False
    #: Keras' float type while the model trains (its compiled loss is cast to it).
    floatx: str = "float32"
    #: The in-process replica counts it trains on (tests/test_features.py).
    replicas: tuple[int, ...] = (2, 3)
    #: The validation data fit is given, if any.
    validation: Callable[[], tuple] | None = None
    #: Trained in two phases: this is done to the model between two fits (compiled again).
    between_fits: Callable[[keras.Model], None] | None = None


def dense(
    opt="sgd",
    hidden=(),
    loss=None,
    metrics=("accuracy",),
    optimizer_options=None,
    **compile_args,
):
    keras.utils.set_random_seed(1)
    chosen = optimizer(opt)
    if optimizer_options:
        chosen = type(chosen).from_config({**chosen.get_config(), **optimizer_options})
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            *[make() for make in hidden],
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer=chosen,
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
        **compile_args,
    )
    return model


def _weighted_data():
    x, y = dense_data()
    weights = np.random.default_rng(3).uniform(0.2, 2.0, size=len(x)).astype("float32")
    return x, y, weights


def _plain_data():
    x, y = dense_data()
    return x, y, None


class OwnLoss(keras.Model):
    """A model with its own compute_loss, as the Keras docstring writes one: a mean of its own and
    the compiled loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 0.1 * ops.mean(ops.square(y_pred))


def _own_loss():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = OwnLoss(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer=optimizer("sgd"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


VOCABULARY, LENGTH = 20, 6


def _token_data():
    """Sequences padded with 0 to different lengths; a label per token."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, LENGTH + 1, size=N_SAMPLES)
    tokens = rng.integers(1, VOCABULARY, size=(N_SAMPLES, LENGTH))
    tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    labels = rng.integers(0, 3, size=(N_SAMPLES, LENGTH))
    return tokens.astype("int32"), labels, None


def _masked():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((LENGTH,), dtype="int32"),
            keras.layers.Embedding(VOCABULARY, 8, mask_zero=True),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer=optimizer("sgd"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras.io's text classification with a transformer: a token embedding looked up per row,
    and a position embedding looked up once per batch (`arange(maxlen)`, shared by the rows)."""

    def __init__(self, maxlen, vocabulary, width, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocabulary, width)
        self.positions = keras.layers.Embedding(maxlen, width)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        return self.tokens(x) + self.positions(ops.arange(start=0, stop=maxlen, step=1))


def _transformer(model_class=keras.Model, optimizer_options=None, **compile_args):
    """keras.io's transformer text classifier, small: embeddings, a transformer block
    (MultiHeadAttention, Dropout, LayerNormalization), pooling; Adam."""
    keras.utils.set_random_seed(1)
    width = 8
    inputs = keras.Input((LENGTH,), dtype="int32")
    x = TokenAndPositionEmbedding(LENGTH, VOCABULARY, width)(inputs)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=width)(x, x)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x + keras.layers.Dropout(0.1)(attended))
    feed = keras.layers.Dense(width)(keras.layers.Dense(16, activation="relu")(x))
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x + keras.layers.Dropout(0.1)(feed))
    x = keras.layers.Dropout(0.1)(keras.layers.GlobalAveragePooling1D()(x))
    model = model_class(inputs, keras.layers.Dense(3)(x))
    chosen = optimizer("adam")
    if optimizer_options:
        chosen = type(chosen).from_config({**chosen.get_config(), **optimizer_options})
    model.compile(
        optimizer=chosen,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_args,
    )
    return model


def _sequence_data():
    """Token sequences and a label per sequence."""
    tokens, labels, _ = _token_data()
    return tokens, labels[:, 0], None


def _binary_data():
    x, y = dense_data()
    return x, (y == 1).astype("float32")[:, None], None


def _auc():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(
        optimizer=optimizer("adam"),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[
            keras.metrics.AUC(from_logits=True, name="auc"),
            keras.metrics.Precision(thresholds=0.0, name="precision"),
        ],
    )
    return model


#: The row whose gradient overflows float16; with batches of 33 it is neither replica's first row
#: (2 replicas: replica 1's rows 17-32; 3 replicas: replica 1's rows 11-21).
OVERFLOW_ROW = 20


def _overflow_data():
    """One row weighed so heavily that its float16 gradient overflows, in every epoch's first
    batch."""
    x, y = dense_data()
    weights = np.ones(len(x), "float32")
    weights[OVERFLOW_ROW] = 1e4
    return x, y, weights


def _mixed_precision():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", dtype="mixed_float16"),
            keras.layers.Dense(3, dtype="float32"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(optimizer("sgd")),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _multi_io():
    return multi_io_model("adam")


class RunningSum(keras.layers.Layer):
    """State its call writes, one weight per declared aggregation: a running sum of its inputs
    ("sum"), a count of its calls ("only_first_replica"), the calls counted with Keras' default
    aggregation, which every replica writes alike ("none"), a decay every replica sets alike
    ("mean")."""

    def build(self, shape):
        def state(name, aggregation, **kwargs):
            return self.add_weight(
                name=name, shape=(), trainable=False, aggregation=aggregation, **kwargs
            )

        self.total = state("total", "sum", initializer="zeros")
        self.calls = state("calls", "only_first_replica", initializer="zeros", dtype="int64")
        self.counted = state("counted", "none", initializer="zeros")
        self.decay = state("decay", "mean", initializer="ones")

    def call(self, x):
        self.total.assign_add(ops.sum(x))
        self.calls.assign_add(1)
        self.counted.assign_add(1.0)
        self.decay.assign(self.decay * 0.9)
        return x


class RowsSeen(keras.layers.Layer):
    """Writes how many rows its call saw: the batch's, as on one device (its call runs whole);
    the replica's with `sync_batch_norm=False`."""

    def __init__(self, aggregation, **kwargs):
        super().__init__(**kwargs)
        self.aggregation = aggregation

    def build(self, shape):
        self.seen = self.add_weight(
            name="seen",
            shape=(),
            initializer="zeros",
            trainable=False,
            aggregation=self.aggregation,
        )

    def call(self, x):
        self.seen.assign(ops.cast(ops.shape(x)[0], "float32"))
        return x


def rows_seen(aggregation):
    """A model whose layer writes the rows its call saw, with `aggregation`."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), RowsSeen(aggregation), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model


class LogisticEndpoint(keras.layers.Layer):
    """keras.io's endpoint layer: it adds its loss and updates its metric in `call`."""

    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.accuracy_fn = keras.metrics.BinaryAccuracy()

    def call(self, logits, targets=None, sample_weight=None):
        if targets is not None:
            self.add_loss(self.loss_fn(targets, logits, sample_weight))
            self.accuracy_fn.update_state(targets, logits, sample_weight)
        return ops.sigmoid(logits)


def _layer_state():
    """keras.io's endpoint-layer pattern (its targets and sample weights are inputs), after a
    layer keeping a running sum and counters."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,), name="inputs")
    targets = keras.Input((1,), name="targets")
    sample_weight = keras.Input((1,), name="sample_weight")
    hidden = keras.layers.Dense(16, activation="relu")(RunningSum()(inputs))
    logits = keras.layers.Dense(1)(hidden)
    predictions = LogisticEndpoint()(logits, targets, sample_weight)
    model = keras.Model([inputs, targets, sample_weight], predictions)
    model.compile(optimizer=optimizer("adam"))
    return model


def _endpoint_data():
    x, y, weights = _weighted_data()
    targets = (y == 1).astype("float32")[:, None]
    return {"inputs": x, "targets": targets, "sample_weight": weights[:, None]}, None, None


#: 100 rows in batches of 33: the final batch of 1 row leaves 1 of 2 and 2 of 3 replicas, and
#: every process but the first, without rows.
ONE_ROW_LEFT = 100


def every_layer_family(opt: str, floatx: str = "float64") -> keras.Model:
    """A model of every layer family `keras.applications` and the keras.io guides use, in
    `floatx`: images through Conv2D, DepthwiseConv2D, SeparableConv2D, BatchNormalization,
    Conv2DTranspose, pooling and GroupNormalization; tokens through Embedding, Conv1D,
    DepthwiseConv1D, SeparableConv1D, LSTM, GRU, MultiHeadAttention and LayerNormalization;
    volumes through Conv3D; joined by Dense layers with Dropout."""
    keras.utils.set_random_seed(1)
    with precision(floatx):
        image = keras.Input((8, 8, 4), name="image")
        x = L.Conv2D(4, 3, padding="same")(image)
        x = L.DepthwiseConv2D(3, padding="same")(x)
        x = L.SeparableConv2D(4, 3, padding="same")(x)
        x = L.BatchNormalization()(x)
        x = L.Conv2DTranspose(4, 3, strides=2, padding="same")(x)
        x = L.MaxPooling2D()(x)
        x = L.GroupNormalization(2)(x)
        x = L.GlobalAveragePooling2D()(L.AveragePooling2D(2)(x))
        tokens = keras.Input((6,), dtype="int32", name="tokens")
        s = L.Conv1D(4, 3, padding="same")(L.Embedding(20, 4)(tokens))
        s = L.SeparableConv1D(4, 3, padding="same")(L.DepthwiseConv1D(3, padding="same")(s))
        s = L.GRU(4, return_sequences=True)(L.LSTM(4, return_sequences=True)(s))
        s = L.LayerNormalization()(s + L.MultiHeadAttention(2, 2)(s, s))
        s = L.GlobalMaxPooling1D()(s)
        volume = keras.Input((4, 4, 4, 1), name="volume")
        v = L.GlobalAveragePooling3D()(L.Conv3D(2, 2)(volume))
        hidden = L.Dense(8, activation="relu")(L.Concatenate()([x, s, v]))
        model = keras.Model([image, tokens, volume], L.Dense(3)(L.Dropout(0.2)(hidden)))
        model.compile(
            optimizer=optimizer(opt),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def _family_data():
    rng = np.random.default_rng(6)
    x = {
        "image": rng.normal(size=(ONE_ROW_LEFT, 8, 8, 4)),
        "tokens": rng.integers(0, 20, (ONE_ROW_LEFT, 6)).astype("int32"),
        "volume": rng.normal(size=(ONE_ROW_LEFT, 4, 4, 4, 1)),
    }
    return x, rng.integers(0, 3, ONE_ROW_LEFT), None


def _every_family(opt: str, floatx: str = "float64") -> Feature:
    """`every_layer_family` with a final batch of 1 row: a replica without rows contributes
    nothing (measured: 1.5e-15 with SGD, 4.8e-12 with Adam, on 3 replicas, in float64). In
    float32 the CPU's oneDNN convolution kernels run too, which mistake a batch of no rows."""
    build = functools.partial(every_layer_family, opt, floatx)
    tolerance = 1e-10 if floatx == "float64" else 1e-5
    return Feature(build, _family_data, tolerance=tolerance, floatx=floatx, replicas=(3,))


FEATURES = {
    "sgd_momentum": Feature(lambda: dense("sgd"), _plain_data),
    "adam": Feature(lambda: dense("adam"), _plain_data, tolerance=1e-4),
    "sample_weights": Feature(lambda: dense("sgd"), _weighted_data),
    "multi_io_adam": Feature(_multi_io, multi_io_data, tolerance=1e-4),
    "clipnorm": Feature(lambda: dense(optimizer_options={"clipnorm": 0.05}), _plain_data),
    "global_clipnorm": Feature(
        lambda: dense(optimizer_options={"global_clipnorm": 0.05}), _plain_data
    ),
    "clipvalue": Feature(lambda: dense(optimizer_options={"clipvalue": 0.01}), _plain_data),
    "sum_reduction": Feature(
        lambda: dense(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"),
            optimizer_options={"learning_rate": 0.003},
        ),
        _weighted_data,
    ),
    "mean_with_sample_weight": Feature(
        lambda: dense(
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            )
        ),
        _weighted_data,
    ),
    "own_compute_loss": Feature(_own_loss, _weighted_data),
    "masked_loss": Feature(_masked, _token_data),
    "transformer": Feature(_transformer, _sequence_data, tolerance=1e-4),
    "accumulation": Feature(
        lambda: dense("adam", optimizer_options={"gradient_accumulation_steps": 2}),
        _plain_data,
        tolerance=1e-4,
    ),
    "ema": Feature(
        lambda: dense(optimizer_options={"use_ema": True, "ema_overwrite_frequency": 3}),
        _plain_data,
    ),
    "batch_norm": Feature(lambda: dense(hidden=[keras.layers.BatchNormalization]), _weighted_data),
    "dropout": Feature(lambda: dense(hidden=[lambda: keras.layers.Dropout(0.3)]), _plain_data),
    "auc_metric_names": Feature(_auc, _binary_data, tolerance=1e-4),
    "mixed_precision_overflow": Feature(_mixed_precision, _overflow_data, tolerance=1e-4),
    "custom_layer_without_config": Feature(custom_layer, _plain_data),
    "subclassed_without_config": Feature(subclassed_without_config, _plain_data),
    "own_train_step": Feature(guide_step, _plain_data, tolerance=1e-4),
    "gan": Feature(gan, images, tolerance=1e-4),
    "vae": Feature(vae, images, tolerance=1e-4),
    "steps_per_execution": Feature(
        lambda: dense(steps_per_execution=3), _plain_data, evaluate=True
    ),
    "batch_smaller_than_replicas": Feature(lambda: dense("sgd"), _plain_data, batch_size=1),
    "layer_state": Feature(_layer_state, _endpoint_data, tolerance=1e-4, evaluate=True),
    "every_layer_family_sgd": _every_family("sgd"),
    "every_layer_family_adam": _every_family("adam"),
    "every_layer_family_float32": _every_family("sgd", "float32"),
    **{
        name: Feature(build, data, tolerance=1e-10, floatx="float64", validation=validation)
        for name, build, data, validation in [
            ("own_step_raw_logs", global_steps.raw_logs, global_steps.unlabelled, None),
            ("own_step_batch_norm", global_steps.batch_norm_step, global_steps.labelled, None),
            ("own_step_per_row_loss", global_steps.per_row_loss, global_steps.labelled, None),
            ("own_step_info_nce", global_steps.info_nce, global_steps.unlabelled, None),
            ("own_step_global_draw", global_steps.global_draw, global_steps.divisible, None),
            ("own_step_uneven_metric", global_steps.uneven_metric, global_steps.unlabelled, None),
            ("own_step_regularised", global_steps.regularised, global_steps.labelled, None),
            (
                "own_step_two_domains",
                global_steps.two_domains_model,
                global_steps.two_domains,
                None,
            ),
            (
                "own_step_prototypes",
                global_steps.prototypes_model,
                global_steps.three_classes,
                None,
            ),
            (
                "own_step_gradient_penalty",
                global_steps.gradient_penalty,
                global_steps.unlabelled,
                None,
            ),
            ("compiled_contrastive", global_steps.compiled_contrastive, global_steps.classes, None),
            ("own_step_unseeded", global_steps.unseeded, global_steps.unlabelled, None),
            (
                "compiled_coupled_losses",
                global_steps.coupled_losses,
                global_steps.masks_and_classes,
                None,
            ),
            (
                "compiled_coupled_metrics",
                lambda: global_steps.coupled_losses(coupled=False),
                global_steps.masks_and_classes,
                None,
            ),
            ("random_crop", global_steps.random_crop, global_steps.pictures, None),
            (
                "reshuffled_py_dataset",
                global_steps.reshuffled_model,
                global_steps.reshuffled,
                global_steps.reshuffled_validation,
            ),
            (
                "own_step_self_supervised",
                global_steps.self_supervised,
                global_steps.zipped,
                global_steps.validation,
            ),
            (
                "own_step_sharpness_aware",
                gradient_steps.sharpness_aware,
                global_steps.labelled,
                None,
            ),
            (
                "own_step_clipped_by_hand",
                gradient_steps.clipped_by_hand,
                gradient_steps.sequences,
                None,
            ),
            ("compiled_centralized", gradient_steps.centralized, global_steps.labelled, None),
            ("own_step_add_loss", call_steps.vector_quantized, global_steps.unlabelled, None),
            ("own_step_attribute", call_steps.gated, global_steps.labelled, None),
            ("own_step_held_graph", call_steps.node_classifier, call_steps.node_batches, None),
            ("own_step_held_table", call_steps.prototypes, call_steps.nearest_prototype, None),
            (
                "compiled_batch_statistics",
                batch_steps.compiled_batch_statistics,
                global_steps.labelled,
                global_steps.validation,
            ),
            (
                "own_step_batch_statistics",
                batch_steps.own_step_batch_statistics,
                global_steps.labelled,
                None,
            ),
        ]
    },
    **{
        f"own_step_accumulated_{form}_{kind}": Feature(
            functools.partial(gradient_steps.accumulated_by_hand, form == "cond", kind == "raw"),
            global_steps.labelled,
            tolerance=1e-10,
            floatx="float64",
        )
        for form in ("cond", "flag")
        for kind in ("raw", "keras")
    },
    "compiled_stateful_rnn": Feature(
        call_steps.stateful_rnn,
        call_steps.streams,
        batch_size=call_steps.STREAMS,
        tolerance=1e-10,
        floatx="float64",
    ),
    "own_step_quantized": Feature(
        default_steps.quantized, default_steps.pictures, tolerance=1e-10, floatx="float64"
    ),
    "own_test_step_static_rows": Feature(
        default_steps.kernel_distance,
        global_steps.labelled,
        tolerance=1e-10,
        floatx="float64",
        validation=default_steps.whole_batches,
    ),
    "own_test_and_predict_steps": Feature(
        default_steps.centred_evaluation,
        global_steps.labelled,
        tolerance=1e-10,
        floatx="float64",
        validation=global_steps.validation,
        evaluate=True,
    ),
    "eager_own_step": Feature(
        default_steps.eager_minibatch_spread,
        global_steps.unlabelled,
        tolerance=1e-10,
        floatx="float64",
    ),
    **{
        f"own_step_per_row_{name}": Feature(
            getattr(per_row_steps, name), global_steps.labelled, tolerance=1e-10, floatx="float64"
        )
        for name in ("vectorized", "compiled", "mapped", "jacobian")
    },
    "own_step_per_row_microbatched": Feature(
        per_row_steps.microbatched,
        per_row_steps.grouped,
        batch_size=per_row_steps.GROUPED_BATCH,
        tolerance=1e-10,
        floatx="float64",
    ),
    "own_step_carried_loop": Feature(
        per_row_steps.carried, global_steps.labelled, tolerance=1e-10, floatx="float64"
    ),
    **{
        f"state_{name}": Feature(
            getattr(state_steps, name), global_steps.labelled, tolerance=1e-10, floatx="float64"
        )
        for name in (
            "lookahead",
            "lookahead_own_step",
            "raw_buffers",
            "noisy_gradients",
            "added_loss",
            "python_draws",
            "python_draws_own_step",
        )
    },
    "state_aug_mix": Feature(state_steps.aug_mix, state_steps.pictures, batch_size=13),
    "own_step_two_optimizers": Feature(
        gradient_steps.two_optimizers,
        global_steps.unlabelled,
        tolerance=1e-10,
        floatx="float64",
        between_fits=gradient_steps.recompile,
    ),
}


#: The features that also run prefetched to the replicas' devices (tests/test_features.py): the
#: ways a batch reaches the step (dicts of inputs and outputs with sample weights, a replica
#: without rows, Keras' loop of steps, a model's own steps) and the uses of a replica's place in
#: the batch (its rows of the random draws, the global batch's statistics and normalisers).
PREFETCHED = [
    "multi_io_adam",
    "batch_norm",
    "dropout",
    "gan",
    "steps_per_execution",
    "batch_smaller_than_replicas",
]

#: The features the multi-process jobs run (Horovod ranks, ring workers): all of them.
MULTI_PROCESS = sorted(FEATURES)

#: The transformer's gradients summed where else kmirror sums them: in the guide's own
#: train_step (at its apply_gradients), with each replica's pass compiled with XLA, and with
#: gradient accumulation (summed dense, as Keras' optimizer accumulates them).
TRANSFORMER_VARIANTS = {
    "own_train_step": Feature(lambda: _transformer(GuideStep), _sequence_data, tolerance=1e-4),
    "xla": Feature(lambda: _transformer(jit_compile=True), _sequence_data, tolerance=1e-4),
    "accumulation": Feature(
        lambda: _transformer(optimizer_options={"gradient_accumulation_steps": 2}),
        _sequence_data,
        tolerance=1e-4,
    ),
}


def one_device(name: str) -> tuple[list, dict]:
    """FEATURES[name] trained on one device: its `trained_state` and history, trained once per
    run."""

    def train():
        model = FEATURES[name].build()
        history = fit(model, FEATURES[name])
        return trained_state(model), history

    return shared(f"feature-{name}", train)


def trained_state(model: keras.Model) -> list:
    """What the matrix compares: the model's weights, then the variables of its optimizer and of
    every optimizer that one holds (a Lookahead's inner Adam), as arrays."""
    optimizers, pending = [], [getattr(model, "optimizer", None)]
    while pending:
        optimizer = pending.pop(0)
        if isinstance(optimizer, keras.optimizers.Optimizer) and optimizer not in optimizers:
            optimizers.append(optimizer)
            pending += list(vars(optimizer).values())
    variables = [v for optimizer in optimizers for v in optimizer.variables]
    return model.get_weights() + [np.asarray(v.numpy()) for v in variables]


def assert_same_logs(feature: Feature, expected: dict, actual: dict) -> None:
    """Every logged value as one device logs it: to the weights' tolerance in float64; to 1e-4
    relative in float32 (a logged mean of float32 values summed in another order)."""
    assert list(actual) == list(expected), "metric names as on one device"
    if feature.floatx == "float64":
        assert_same_history(expected, actual, rtol=feature.tolerance, atol=feature.tolerance)
    else:
        assert_same_history(expected, actual, rtol=1e-4)


def fit(model: keras.Model, feature: Feature, epochs: int = EPOCHS) -> dict:
    with precision(feature.floatx):
        history = _fit(model, feature, epochs)
        if feature.between_fits is None:
            return history
        feature.between_fits(model)
        more = _fit(model, feature, epochs)
    return {key: history[key] + more[key] for key in history}


def _fit(model: keras.Model, feature: Feature, epochs: int) -> dict:
    x, y, sample_weight = feature.data()
    batched = isinstance(x, (tf.data.Dataset, keras.utils.PyDataset))
    history = model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=None if batched else feature.batch_size,
        validation_data=feature.validation() if feature.validation else None,
        epochs=1 if feature.batch_size == 1 else epochs,
        shuffle=False,
        verbose=0,
    )
    if not feature.evaluate:
        return history.history
    logs = model.evaluate(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=feature.batch_size,
        verbose=0,
        return_dict=True,
    )
    return {**history.history, **{f"evaluate_{k}": [v] for k, v in logs.items()}}
