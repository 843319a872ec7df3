"""`MirroredModel`: the user's own Keras model, its variables mirrored on every replica, trained
data-parallel.

`kmirror.wrap` mirrors the user's model's variables where they are (`_core.mirroring`): the
layers, optimizers and metrics that train are the user's own objects. `MirroredModel` is a thin
`keras.Model` in front of that model: it answers as the user's model does (`layers`, `get_layer`,
`summary`, `inputs`, `save`, ...), and Keras calls the steps it overrides here. Each hands its
work to the module whose job it is:

- the steps: `_core.step` (kmirror's data-parallel step, the loss and metrics logged once per
  global batch) or `_core.own_step` (a model's own `train_step`, `test_step`, `predict_step`);
- what one `fit` settles (the job's seed, where a relaunch resumes, the input this process reads,
  the watch for a non-finite loss): `_core.fitting`; what `evaluate` reads: `_core.feed.inputs`;
- what it compiles with, taken from the user's model: `_core.compiling`; building the user's
  model and the logs' metrics before the first step: `_core.building`; the logs updated once
  per global batch: `_core.logged`;
- every process starting from the chief's state: `_core.chief_state`;
- the variables mirrored, and single-device again at `unwrap()`: `_core.mirroring`.

This module is longer than kmirror's others for one reason: the overrides Keras calls belong to
one class. The names it answers as the user's model are `_core.answering`'s.
"""

from __future__ import annotations

import concurrent.futures
import warnings

import keras
import tensorflow as tf

from kmirror import errors
from kmirror._core import (
    building,
    compiling,
    fitting,
    keras_hooks,
    logged,
    mirroring,
    own_step,
    python_draws,
    reached_state,
    step,
    tracing,
)
from kmirror._core import explain as explain_lib
from kmirror._core.answering import AnswersAsModel
from kmirror._core.callbacks import keras_own
from kmirror._core.chief_state import ChiefState
from kmirror._core.feed import inputs as inputs_lib
from kmirror._core.feed import placement
from kmirror._core.feed import rows as rows_lib
from kmirror.reducers.base import Reducer

__all__ = ["MirroredModel"]


class MirroredModel(AnswersAsModel, keras_hooks.ModelOverrides):
    """The user's Keras model, its weights mirrored on every replica, its steps data-parallel.

    Create it with `kmirror.wrap(model, reducer=...)`. Each global batch is split across the
    replicas, each replica computes gradients of its share of the global loss, the reducer sums
    them, and one identical update is applied everywhere. Logged loss and metrics are those of the
    global batch, as on one device. The layers, optimizer and metrics that train are the user's
    own objects: a change made through the user's references (freezing a layer, a learning rate)
    takes effect where Keras takes it (at the next `compile` for `trainable`). The user's model's
    own attributes, methods and properties (a GAN's `generator`, a helper method) are read and set
    through the wrapped model as well; where a name is also Keras' or kmirror's (`devices`,
    `reducer`), the wrapped model answers its own. Every variable (layers', optimizers',
    metrics') reads and assigns outside a step as on one device: `int(v)`, `float(v)`,
    `v.numpy()`, `np.asarray(v)`, `v.value`, `v.assign(...)` (to every replica's copy).

    Example:

    ```python
    import kmirror, keras, numpy as np
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, name="out")])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.rand(100, 8), np.random.rand(100, 1)
    wrapped = kmirror.wrap(model, reducer="one_device")   # a kmirror.MirroredModel
    wrapped.fit(x, y, batch_size=32, epochs=2)
    print(wrapped.reducer, wrapped.num_replicas, wrapped.devices, wrapped.is_chief)
    assert wrapped.get_layer("out") is model.layers[0]    # the user's own layer trained
    wrapped.save("trained.keras")   # what the plain model writes; kmirror is not needed to load it
    plain = wrapped.unwrap()        # the user's model, single-device again
    ```
    """

    def __init__(
        self,
        model: keras.Model,
        reducer: Reducer,
        sync_batch_norm: bool = True,
        prefetch: bool | None = None,
    ) -> None:
        keras_hooks.keras_model_name("")  # learns Keras' names now, outside any step
        super().__init__(name=f"mirrored_{model.name}")
        self._model = model  # tracked by Keras as this model's one layer
        self._reducer = reducer
        self._mirror = mirroring.Mirror(reducer)
        self._reached = reached_state.Kept()  # state the steps reached that no walk found
        reached_state.install()
        python_draws.install()
        self._sync_batch_norm = bool(sync_batch_norm)
        if prefetch is None:
            prefetch = any(
                tf.DeviceSpec.from_string(d).device_type == "GPU" for d in reducer.devices
            )
        self._own_steps = own_step.overridden(model)
        self._replica_jit_compile = False
        self._chief = ChiefState(reducer.job, self._shared_variables)
        self._builder = building.Builder(
            self,
            model,
            reducer,
            self._mirror,
            lambda: self._own_training,
            built=self._chief.changed,
            fitting=lambda: self._fit is not None,
        )
        self._reading = inputs_lib.Inputs(
            reducer, prefetch, build=self._builder.from_spec, built=lambda: model.built
        )
        self._fit: fitting.Fit | None = None  # the fit running, if any
        self._unwrapped = False
        self._samples_seen = tf.Variable(0, dtype=tf.int64, trainable=False, name="samples_seen")
        self._adopted = None  # the user's model's compile call this model took
        if hasattr(model, "output_names"):
            self.output_names = list(model.output_names)
        self.built = True
        self._mirror.adopt(model)
        if model.compiled:
            try:
                self._adopt_compile()
            except BaseException:
                self._mirror.unmirror(model)
                raise
        self._answers_as_model = True  # from here on, the user's own names are the model's

    # -- what users ask of it -------------------------------------------------------------------
    @property
    def reducer(self) -> str:
        """The name of the reducer in use (after `"auto"` was resolved)."""
        return self._reducer.name

    @property
    def num_replicas(self) -> int:
        """How many replicas train together (over all processes)."""
        return self._reducer.num_replicas

    @property
    def devices(self) -> list[str]:
        """The local devices holding a replica."""
        return list(self._reducer.devices)

    @property
    def is_chief(self) -> bool:
        """True in the one process that writes checkpoints and summaries."""
        return self._reducer.job.is_chief

    @property
    def samples_seen(self) -> int:
        """Training samples processed so far by the whole job (all replicas)."""
        return int(self._samples_seen.numpy())

    @property
    def replica_jit_compile(self) -> bool:
        """Whether each replica's forward and backward pass is compiled with XLA."""
        return self._replica_jit_compile

    # -- compiling ------------------------------------------------------------------------------
    def compile(self, *args, **kwargs):
        """Configures training: compiles the user's model with these arguments (its own
        `compile`, whatever it takes), and this model to log what it logs.

        A new optimizer is built on the replicas. kmirror compiles each replica's forward and
        backward pass with XLA when `jit_compile` is True (or "auto" and a GPU is visible); the
        gradient reduction and the update always run outside XLA, so the reducer you chose is the
        reducer that runs.
        """
        self._check_wrapped()
        self._model.compile(*args, **kwargs)
        self._adopt_compile()

    def _adopt_compile(self) -> None:
        """This model takes the user's model's compile settings (`_core.compiling`)."""
        self._adopted = keras_hooks.compile_call(self._model)
        self._mirror.mirror(self._model)
        arguments, self._replica_jit_compile = compiling.outer(
            self._model, self._own_training, self._sync_batch_norm
        )
        with compiling.in_floatx_of(self._model):
            super().compile(**arguments)

    def _check_compiled(self, method_name=None):
        if not self.compiled:
            raise ValueError(
                f"the model must be compiled before `{method_name or 'training'}()`: call "
                "model.compile(optimizer=..., loss=...) on the original model before "
                "kmirror.wrap, or on the wrapped model."
            )

    # -- the steps ------------------------------------------------------------------------------
    def call(self, inputs, training=None):
        return self._model(inputs, training=training)

    @property
    def _own_training(self) -> bool:
        """Whether the user's model's steps run whole on every replica (`_core.own_step`): its
        own `train_step` or `test_step`, or Keras' for a loss that may couple the batch's rows
        (a loss of the user's own, a `compute_loss` of its own, Keras' Dice, Tversky, Circle) or
        a model with its own `compute_metrics`."""
        own = getattr(self, "_own_steps", set()) & {"train_step", "test_step"}
        model = getattr(self, "_model", None)
        if own or model is None or not model.compiled:
            return bool(own)
        return not keras_hooks.rowwise_step(model)

    @property
    def metrics(self):
        # A model's own step updates the user's model's metrics: they are this model's.
        if self._own_training:
            return self._model.metrics
        return super().metrics

    @tracing.traced
    def train_step(self, data):
        data, place = rows_lib.unpack(data)
        if self._own_training:
            rows = placement.global_rows(self._reducer, data, place)
            self._samples_seen.assign_add(tf.cast(rows, tf.int64))
            return own_step.train(
                self._model, self._reducer, data, self._sync_batch_norm, place=place
            )
        outcome = step.train(
            self._model,
            self._reducer,
            data,
            jit_compile=self._replica_jit_compile,
            global_statistics=self._sync_batch_norm,
            logged=logged.Logged.of(self),
            place=place,
        )
        self._samples_seen.assign_add(tf.cast(outcome.rows, tf.int64))
        return logged.record(self, data, outcome)

    @tracing.traced
    def test_step(self, data):
        data, place = rows_lib.unpack(data)
        if self._own_training:
            return own_step.evaluate(self._model, self._reducer, data, place=place)
        outcome = step.evaluate(
            self._model, self._reducer, data, logged=logged.Logged.of(self), place=place
        )
        return logged.record(self, data, outcome)

    @tracing.traced
    def predict_step(self, data):
        data, place = rows_lib.unpack(data)
        if "predict_step" in self._own_steps:
            return own_step.predict(self._model, self._reducer, data, place=place)
        if place is not None:
            raise ValueError(
                "predict takes the global batches (every process the same inputs, every process "
                "gets every prediction); pass the inputs themselves, not kmirror.data.shard's or "
                "local_batches' dataset."
            )
        return step.predict(self._model, self._reducer, data)

    # -- building -------------------------------------------------------------------------------
    def _build_before_first_step(self, iterator=None, data_batch=None):
        # Keras builds a model here before its first step (`_core.building`).
        self._builder.build(iterator, data_batch)
        if self._fit is not None:
            self._fit.check_validation(self._builder.check_takes)

    # -- fit, evaluate, predict -----------------------------------------------------------------
    def _adopt_a_new_compile(self) -> None:
        """The user's model compiled again since (`model.compile(...)` on it, not on this model):
        this model takes its new settings before it trains or evaluates."""
        if self._model.compiled and keras_hooks.compile_call(self._model) is not self._adopted:
            self._adopt_compile()

    def fit(self, *args, **kwargs):
        self._check_wrapped()
        self._adopt_a_new_compile()
        with self._reducer.job.failures():
            self._mirror.mirror(self._model)  # variables the user made since
            self._chief.changed()  # every fit starts from the chief's state
            self._fit = call = fitting.Fit(self, self._reducer, self._reading, args, kwargs)
            if call.draws_in_python:
                self.train_function = None
            try:
                with call.running():
                    return super().fit(**call.arguments)
            finally:
                self._fit = None
                if call.draws_in_python:
                    self.train_function = None  # the next fit traces Keras' loop again

    def evaluate(self, *args, **kwargs):
        self._check_wrapped()
        self._adopt_a_new_compile()
        with self._reducer.job.failures():
            method, chief = keras.Model.evaluate, self.is_chief
            arguments = inputs_lib.arguments_of(method, self, args, kwargs, chief)
            callbacks = arguments.get("callbacks")
            with (
                errors.state_checked(),
                keras_own.written_once(callbacks, self._reducer.job) as chosen,
            ):
                arguments["callbacks"] = chosen
                return super().evaluate(**self._reading.for_evaluate(arguments))

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        self._check_wrapped()
        inputs_lib.check_batch_size("batch_size", batch_size)
        if not self._model.built:
            first = keras_hooks.first_batch(x, batch_size)
            self._builder.build(data_batch=first, step="predict_step")
        if not self.is_chief and verbose == "auto":
            verbose = 0
        job = self._reducer.job
        with (
            job.failures(),
            errors.state_checked(),
            keras_own.written_once(callbacks, job) as chosen,
        ):
            return super().predict(
                x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=chosen
            )

    def explain(self, x, y=None, sample_weight=None, batch_size: int = 32, step: str = "train"):
        """What one step does where: which layer calls run on each replica's rows, which run on
        the whole batch on every replica (and why), and how many sums over the replicas the
        layers make per step.

        Read it when a step is slower than expected: a call on the whole batch is computed by
        every replica on every row of the batch, and each sum is one collective. The step is
        traced on the first `batch_size` rows of `x` as Keras traces it; nothing runs, no
        weight changes.

        Example:

        ```python
        print(model.explain(x, y, batch_size=64))
        report = model.explain(x, y)
        report.whole       # [("layer (Class)", "why"), ...]
        report.collectives  # sums over the replicas per step
        ```

        Args:
            x: the inputs, as `fit` takes numpy arrays or tensors (a dict or list of them
                for several inputs).
            y: the targets, if the step takes them.
            sample_weight: the sample weights, if any.
            batch_size: the rows of the batch traced.
            step: `"train"` (the default), `"test"` (`evaluate`) or `"predict"`.

        Returns:
            An explanation with `split` (the calls on each replica's rows), `whole` (each call
            on the whole batch, with why), `sums` (per layer) and `collectives` (their total);
            `str()` of it is a readable report.
        """
        self._check_wrapped()
        if step != "predict":
            self._check_compiled("explain")

        def build(data, name):
            self._builder.build(data_batch=data, step=name)

        with self._reducer.job.failures():
            return explain_lib.explain(self, build, x, y, sample_weight, batch_size, step)

    def batch_order_drawn_from(self) -> tuple | None:
        """Python's random state the current `fit` drew the order of its epoch's batches from:
        that of a `PyDataset`'s pass (see `_core.feed.py_datasets`); None for other input."""
        batches = None if self._fit is None else self._fit.batches
        return None if batches is None else batches.drawn_from

    def take_chief_state(self) -> None:
        """Every process takes the chief's weights and optimizer state now (after the chief
        loaded a backup); a no-op within one process."""
        self._chief.send()

    def reached_state(self) -> list:
        """The values of the state the steps write that the model does not hold (a seed
        generator or a `tf.Variable` on another object), which no weights file holds: in the
        order the steps found it (`_core.reached_state.Kept`). A backup writes them."""
        return self._reached.values()

    def restore_reached_state(self, values: list) -> None:
        """A backup's `reached_state` (the chief's): given to that state now, or as the steps
        find it again; every process takes the chief's then."""
        self._reached.restore(values)

    # Keras makes a step function before the first batch of every fit, evaluate and predict:
    # where every process takes the chief's state, if it may differ.
    def make_train_function(self, force=False):
        if force or self.train_function is None:
            super().make_train_function(force=True)
            if self._one_call_per_step(training=True):
                self.train_function = step.one_call_per_step(
                    self.train_step, self.steps_per_execution, self.run_eagerly, self._retrying
                )
            else:
                self.train_function = self._retrying(self.train_function)
        self._chief.ensure()
        return self.train_function

    def make_test_function(self, force=False):
        if force or self.test_function is None:
            super().make_test_function(force=True)
            if self._one_call_per_step():
                self.test_function = step.one_call_per_step(
                    self.test_step, self.steps_per_execution, self.run_eagerly, self._retrying
                )
            else:
                self.test_function = self._retrying(self.test_function)
        self._chief.ensure()
        return self.test_function

    def make_predict_function(self, force=False):
        if force or self.predict_function is None:
            super().make_predict_function(force=True)
            self.predict_function = self._retrying(self.predict_function)
        self._chief.ensure()
        return self.predict_function

    def look_before_eager(self, step_fn, data) -> None:
        """Before an eager step first runs on several replicas of this process: the state it
        writes that no walk found, mirrored (`_core.reached_state.looked_at`); where the step
        cannot be traced, a warning that such state would be written once per replica."""
        name = step_fn.func.__name__
        looked = self.__dict__.setdefault("_looked_at", set())
        if name in looked or len(self._reducer.strategy.extended.worker_devices) < 2:
            return
        looked.add(name)

        def adopt(handles):
            # Keras' step function runs in its default strategy's replica context, where no
            # other strategy's scope may be entered: mirrored from a thread of its own, as
            # outside any step.
            with concurrent.futures.ThreadPoolExecutor(1) as outside:
                outside.submit(self._adopt_written, handles).result()

        if not reached_state.looked_at(step_fn, data, adopt):
            warnings.warn(
                f"kmirror: this eager {name} cannot be traced, so kmirror cannot look for "
                "variables it writes that the model does not hold (a seed generator or a "
                "tf.Variable on another object): those would be written once per replica. Hold "
                "them on the model (an attribute, a list or a dict of it), or make the step "
                "traceable.",
                stacklevel=2,
            )

    def traces_twice(self, step_name: str) -> bool:
        """Whether one device traces the step `step_name` twice at its first trace from now
        (`_core.building.Builder.traces_twice`; `_core.tracing`)."""
        return self._builder.traces_twice(step_name)

    def _retrying(self, function):
        """`function`, which mirrors the state its trace finds it writes unmirrored and traces
        again (`_core.reached_state`)."""
        return reached_state.retrying(function, self._adopt_written)

    def _adopt_written(self, handles: list) -> None:
        """Mirrors the state a step writes that no walk found; every process then holds the
        chief's values of it (a backup's, after a relaunch)."""
        adopted = self._mirror.adopt_written(handles)
        self._reached.found(adopted)
        self._reducer.job.broadcast(adopted)

    def _one_call_per_step(self, training: bool = False) -> bool:
        if training and self._fit is not None and self._fit.draws_in_python:
            return True
        return not self._reducer.steps_in_one_call and self.steps_per_execution > 1

    def _shared_variables(self) -> list:
        """What every process takes from the chief: the weights, every optimizer's state and the
        state the steps reached."""
        optimizers = mirroring.optimizers(self._model)
        shared = self._model.variables + [v for o in optimizers for v in o.variables]
        return shared + self._reached.variables()

    # -- files, and leaving kmirror -------------------------------------------------------------
    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Saves what the user's model saves (a `.keras` file loadable without kmirror)."""
        self._check_wrapped()
        keras_hooks.keep_saving_cache()
        return self._model.save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Saves the user's model's weights: the file fits it, wrapped or not."""
        self._check_wrapped()
        keras_hooks.keep_saving_cache()
        return self._model.save_weights(filepath, overwrite=overwrite, **kwargs)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads weights saved by this model, by the user's model wrapped or not."""
        self._check_wrapped()
        self._chief.changed()  # in a job, every process takes the chief's file
        return self._model.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)

    def unwrap(self) -> keras.Model:
        """Gives the user's model back, trained, its variables single-device again.

        It is the model given to `kmirror.wrap`, with its optimizer state (iterations, moments)
        and compile settings: `fit` on it continues on one device where this model stopped. This
        wrapped model is done: wrap the model again to train it on the replicas (any further use
        of it, `unwrap()` again included, raises a ValueError that says so).
        """
        self._check_wrapped()
        self._mirror.unmirror(self._model)
        self._unwrapped = True
        return self._model

    def _check_wrapped(self) -> None:
        if self._unwrapped:
            raise ValueError(
                "this kmirror model was unwrapped: its model is a single-device Keras model again. "
                "Use that model, or kmirror.wrap(model) it again to train on the replicas."
            )
