"""`MirroredModel`: a user's Keras model replicated on every device, trained data-parallel.

`MirroredModel` is a `keras.Model`: `fit`, `evaluate`, `predict` and every Keras callback work as
usual, and Keras calls the methods it overrides here. This module is longer than kmirror's others
for that reason only: the overrides belong to one class. Each hands its work to the module whose
job it is, and keeps the order in which they run:

- the replicas, and leaving kmirror (`unwrap`, `save`): `kmirror.replication` (copies of the
  model, its compile settings and optimizer state; the user's model is never changed);
- the steps: `kmirror.step` (kmirror's data-parallel step, the loss and metrics logged once per
  global batch) or `kmirror.own_step` (a model's own `train_step`, `test_step`, `predict_step`);
- what `fit` and `evaluate` read in this job: `kmirror.inputs`; where a relaunch resumes:
  `kmirror.resume`;
- how processes behave together (the seed they agree on, a lost peer, a non-finite loss): the
  reducer's job (`Job.agree_on_seed`, `Job.failures`) and `kmirror.errors`.

`kmirror.wrap` (`kmirror.wrapping`) makes one.
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import keras
import tensorflow as tf

from kmirror import (
    copying,
    errors,
    keras_hooks,
    metric_states,
    own_step,
    placement,
    replication,
    step,
)
from kmirror import inputs as inputs_lib
from kmirror import logged as logged_lib
from kmirror import resume as resume_lib
from kmirror import rows as rows_lib
from kmirror.reducers.base import Reducer

__all__ = ["MirroredModel"]


class MirroredModel(keras.Model):
    """A Keras model whose weights are mirrored on every replica and whose steps are data-parallel.

    Create it with `kmirror.wrap(model, reducer=...)`. Each global batch is split across the
    replicas, each replica computes gradients of its share of the global loss, the reducer sums
    them, and one identical update is applied everywhere. Logged loss and metrics are those of the
    global batch, as on one device.

    Example:

    ```python
    import kmirror, keras, numpy as np
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.rand(100, 8), np.random.rand(100, 1)
    model = kmirror.wrap(model, reducer="one_device")   # a kmirror.MirroredModel
    model.fit(x, y, batch_size=32, epochs=2)
    print(model.reducer, model.num_replicas, model.devices, model.is_chief)
    plain = model.unwrap()          # a single-device keras.Model with the trained weights
    model.save("trained.keras")     # a plain .keras file; kmirror is not needed to load it
    ```
    """

    def __init__(
        self,
        model: keras.Model,
        reducer: Reducer,
        sync_batch_norm: bool = True,
        prefetch: bool | None = None,
    ) -> None:
        super().__init__(name=f"mirrored_{model.name}")
        self._reducer = reducer
        self._sync_batch_norm = bool(sync_batch_norm)
        if prefetch is None:
            prefetch = any(
                tf.DeviceSpec.from_string(d).device_type == "GPU" for d in reducer.devices
            )
        self._prefetch = prefetch
        self._replica_jit_compile = False
        self._user_compile: dict[str, Any] | None = None
        self._synchronized = False  # every process has the chief's weights for this fit
        self._seeded = False  # every process draws the same random numbers
        self._draw_in_python = False  # batches drawn in Python, a step per call (see fit)
        self._reading = inputs_lib.Inputs(
            reducer, prefetch, build=self._build_from_spec, built=lambda: self._replica.built
        )
        # The plain model `save` writes (see _plain_copy), held where Keras does not track it as
        # a layer of this model.
        self._for_saving = types.SimpleNamespace(model=None)
        # A model with its own train_step or test_step keeps its compiled state (its optimizers,
        # losses and metrics, copied onto the replicas); kmirror compiles the others anew.
        self._own_steps = own_step.overridden(model)
        self._own_training = bool(self._own_steps & {"train_step", "test_step"})
        self._replica = replication.replicate(model, reducer, keep_compiled=self._own_training)
        self._samples_seen = tf.Variable(0, dtype=tf.int64, trainable=False, name="samples_seen")
        if hasattr(self._replica, "output_names"):
            self.output_names = list(self._replica.output_names)
        self.built = True
        if model.compiled and self._own_training:
            self._compile_own()
        elif model.compiled:
            compile_args = keras_hooks.compile_arguments(model)
            for name in ("metrics", "weighted_metrics"):
                compile_args[name] = replication.fresh_metrics(compile_args.get(name))
            self.compile(**compile_args)
            if model.optimizer is not None and model.optimizer.built and self._replica.built:
                replication.copy_optimizer_state(model.optimizer, self.optimizer)

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

    # -- compiling ------------------------------------------------------------------------------
    def compile(self, *args, **kwargs):
        """Configures training, as the wrapped model's `compile` (Keras' `Model.compile`, or the
        model's own `compile` when it overrides `train_step` or `test_step`).

        The optimizer is created on the replicas. kmirror compiles each replica's forward and
        backward pass with XLA when `jit_compile` is True (or "auto" and a GPU is visible); the
        gradient reduction and the update always run outside XLA, so the reducer you chose is the
        reducer that runs.
        """
        if getattr(self, "_own_training", False):
            with self._reducer.scope():
                # Optimizers, losses and metrics given are copied onto the replicas.
                args, kwargs = copying.copy_model((args, kwargs))
                self._replica.compile(*args, **kwargs)
            return self._compile_own()
        return self._compile_standard(*args, **kwargs)

    def _compile_own(self) -> None:
        """The replica keeps its own compiled state; this model takes its optimizer (for
        callbacks) and its metrics (for the logs)."""
        replica = self._replica
        own_step.prepare(replica)
        if replica.built:
            with self._reducer.scope():
                replication.build_optimizer(replica)
        self._user_compile = None
        if hasattr(self, "_for_saving"):
            self._for_saving.model = None
        super().compile(
            optimizer=replica.optimizer,
            run_eagerly=replica.run_eagerly,
            steps_per_execution=replica.steps_per_execution,
            jit_compile=False,
        )

    def _compile_standard(
        self,
        optimizer="rmsprop",
        loss=None,
        loss_weights=None,
        metrics=None,
        weighted_metrics=None,
        run_eagerly=False,
        steps_per_execution=1,
        jit_compile="auto",
        auto_scale_loss=True,
    ):
        with self._reducer.scope():
            optimizer = replication.new_optimizer(optimizer)
            if optimizer is not None:
                keras_hooks.local_optimizer(optimizer)
            self._replica.compile(
                optimizer=optimizer,
                loss=loss,
                loss_weights=loss_weights,
                jit_compile=False,
                auto_scale_loss=auto_scale_loss,
            )
            if self._replica.built:
                replication.build_optimizer(self._replica)
        self._user_compile = dict(
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            run_eagerly=run_eagerly,
            steps_per_execution=steps_per_execution,
            jit_compile=jit_compile,
            auto_scale_loss=auto_scale_loss,
        )
        if hasattr(self, "_for_saving"):
            self._for_saving.model = None  # saved with the new compile settings from now on
        if jit_compile == "auto":
            jit_compile = not run_eagerly and keras_hooks.resolve_auto_jit_compile(self._replica)
        self._replica_jit_compile = bool(jit_compile) and not run_eagerly
        batch_norm = replication.has_batch_norm(self._replica)
        if self._replica_jit_compile and self._sync_batch_norm and batch_norm:
            warnings.warn(
                "kmirror: the replicas' forward and backward passes are not compiled with XLA: "
                "BatchNormalization sums its statistics over the replicas inside that pass, which "
                "XLA cannot compile here. Pass sync_batch_norm=False to kmirror.wrap to compile "
                "them (each replica then normalises with its own rows' statistics).",
                stacklevel=2,
            )
            self._replica_jit_compile = False
        # The outer step is never XLA-compiled; the replicas' optimizer already scales the loss.
        super().compile(
            **{**self._user_compile, "jit_compile": False, "auto_scale_loss": False},
            optimizer=self._replica.optimizer,
        )

    @property
    def replica_jit_compile(self) -> bool:
        """Whether each replica's forward and backward pass is compiled with XLA."""
        return self._replica_jit_compile

    def _assert_compile_called(self, method_name=None):
        if not self.compiled:
            raise ValueError(
                f"the model must be compiled before `{method_name or 'training'}()`: call "
                "model.compile(optimizer=..., loss=...) on the original model before "
                "kmirror.wrap, or on the wrapped model."
            )

    # -- the steps ------------------------------------------------------------------------------
    def call(self, inputs, training=None):
        return self._replica(inputs, training=training)

    @property
    def metrics(self):
        # A model's own step updates the replica's metrics: they are this model's.
        if getattr(self, "_own_training", False):
            return self._replica.metrics
        return super().metrics

    def train_step(self, data):
        data, place = rows_lib.unpack(data)
        if self._own_training:
            rows = placement.global_rows(self._reducer, data, place)
            self._samples_seen.assign_add(tf.cast(rows, tf.int64))
            return own_step.train(
                self._replica, self._reducer, data, self._sync_batch_norm, place=place
            )
        outcome = step.train(
            self._replica,
            self._reducer,
            data,
            jit_compile=self._replica_jit_compile,
            global_statistics=self._sync_batch_norm,
            logged=self._logged(),
            place=place,
        )
        # The global loss is the same in every process: all stop at the same step.
        outcome = outcome._replace(
            loss=tf.debugging.check_numerics(outcome.loss, errors.NON_FINITE)
        )
        self._samples_seen.assign_add(tf.cast(outcome.rows, tf.int64))
        return self._record(data, outcome)

    def test_step(self, data):
        data, place = rows_lib.unpack(data)
        if self._own_training:
            return own_step.evaluate(self._replica, self._reducer, data, place=place)
        outcome = step.evaluate(
            self._replica, self._reducer, data, logged=self._logged(), place=place
        )
        return self._record(data, outcome)

    def predict_step(self, data):
        data, place = rows_lib.unpack(data)
        if "predict_step" in self._own_steps:
            return own_step.predict(self._replica, self._reducer, data, place=place)
        if place is not None:
            raise ValueError(
                "predict takes the global batches (every process the same inputs, every process "
                "gets every prediction); pass the inputs themselves, not kmirror.data.shard's or "
                "local_batches' dataset."
            )
        return step.predict(self._replica, self._reducer, data)

    def _logged(self) -> logged_lib.Logged:
        """Metrics whose states add up are updated from the replicas' summed states; others
        (and per-output losses) from the gathered predictions."""
        metrics = keras_hooks.compiled_metrics(self)
        return logged_lib.Logged.of(
            metrics, compiled_loss=keras_hooks.compiled_loss(self) is not None
        )

    def _record(self, data, outcome: logged_lib.Outcome):
        """Updates the Keras metrics once per global batch, as single-device Keras does."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if outcome.targets is not None:  # this process held its rows only
            y, sample_weight = outcome.targets
        self._loss_tracker.update_state(outcome.loss, sample_weight=outcome.rows)
        compiled_loss = keras_hooks.compiled_loss(self)
        y_pred = outcome.y_pred
        if compiled_loss is not None and y_pred is not None and tf.nest.is_nested(y_pred):
            # Per-output losses are logged by the loss object itself, on the global batch.
            compiled_loss(y, y_pred, sample_weight)
        if outcome.metric_sum is not None:
            metric_states.add(keras_hooks.compiled_metrics(self), outcome.metric_sum)
        elif y_pred is not None:
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return self.get_metrics_result()

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras builds models inside the strategy scope from one batch; kmirror does the same
        # for the replicas, from a global batch, so uneven batches never reach the build.
        replica = self._replica
        compile_loss = keras_hooks.compiled_loss(replica)
        optimizers_built = all(o.built for o in own_step.optimizers(replica))
        if self._own_training:
            # A GAN or VAE holding built sub-models has no call() of its own to build from.
            model_built = all(layer.built for layer in replication.layers(replica))
        else:
            model_built = replica.built
        metrics = keras_hooks.compiled_metrics(self)
        metrics_built = self._own_training or metrics is None or metrics.built
        replica_built = model_built and optimizers_built
        if replica_built and (compile_loss is None or compile_loss.built) and metrics_built:
            return
        if data_batch is None:
            for _, _, batches in iterator:
                data_batch = next(batches)
                break
        data_batch, _ = rows_lib.unpack(data_batch)
        if replica_built and (compile_loss is None or compile_loss.built):
            self._build_metrics(data_batch)
            return
        with self._reducer.scope():
            if not model_built or not (compile_loss is None or compile_loss.built):
                keras_hooks.symbolic_build(replica, _symbolic(data_batch))
            if replica.compiled:
                replication.build_optimizer(replica)
        if self._own_training:
            own_step.build_optimizers(replica, self._reducer, data_batch)
        else:
            self._build_metrics(data_batch)

    def _build_metrics(self, data_batch) -> None:
        """Builds this model's compiled metrics (and per-output loss trackers) from one batch,
        outside any strategy: the step updates them from the replicas' summed states."""
        metrics = keras_hooks.compiled_metrics(self)
        if not self._own_training and metrics is not None and not metrics.built:
            keras_hooks.symbolic_build(self, _symbolic(data_batch))

    def _build_from_spec(self, x) -> None:
        """Builds from a dataset's element spec, drawing no batch from it: a batch drawn before
        training would advance a seeded shuffle, and the epochs would no longer be one device's."""
        if not isinstance(x, tf.data.Dataset):
            return
        spec, _ = rows_lib.unpack(x.element_spec)
        leaves = tf.nest.flatten(spec)
        if all(isinstance(s, tf.TensorSpec) and s.shape.rank is not None for s in leaves):
            self._maybe_symbolic_build(data_batch=spec)

    def fit(self, *args, **kwargs):
        self._synchronized = False
        with self._reducer.job.failures():
            # Processes of one job must shuffle alike: each takes its rows of the same batch.
            # Seeded once: from then on they draw the same numbers. Seeding TensorFlow clears its
            # kernel caches, so seeding every fit would rebuild the step (seconds) every time.
            if not self._seeded:
                self._reducer.job.agree_on_seed()
                self._seeded = True
            arguments = inputs_lib.arguments_of(keras.Model.fit, self, args, kwargs, self.is_chief)
            resume = resume_lib.agree(self._reducer, arguments)
            skipping = resume is not None and resume.step > 0
            arguments = self._reading.for_fit(arguments, resume)
            position = errors.NonFiniteWatch()
            arguments["callbacks"] = [*(arguments.get("callbacks") or []), position]
            # The resumed epoch is shorter than the others. Keras' step function would find its
            # end inside the graph, after advancing the optimizer's step counter; drawn in Python,
            # each batch is there before its step starts (the step itself is the same).
            self._draw_in_python = skipping
            if skipping:
                self.train_function = None
            try:
                with warnings.catch_warnings():
                    if skipping:
                        warnings.filterwarnings("ignore", message="Your input ran out of data")
                    return super().fit(**arguments)
            except tf.errors.InvalidArgumentError as error:
                if errors.NON_FINITE not in str(error):
                    raise
                raise errors.NonFiniteLoss(position.describe_non_finite()) from None
            finally:
                self._reading.batches = None
                if self._draw_in_python:
                    self._draw_in_python = False
                    self.train_function = None  # the next fit traces Keras' loop again

    def evaluate(self, *args, **kwargs):
        with self._reducer.job.failures():
            method, chief = keras.Model.evaluate, self.is_chief
            arguments = inputs_lib.arguments_of(method, self, args, kwargs, chief)
            return super().evaluate(**self._reading.for_evaluate(arguments))

    def batch_order_drawn_from(self) -> tuple | None:
        """Python's random state the current `fit` drew the order of its epoch's batches from:
        that of a `PyDataset`'s pass (see `kmirror.py_datasets`); None for other input."""
        batches = self._reading.batches
        return None if batches is None else batches.drawn_from

    def take_chief_state(self) -> None:
        """Every process takes the chief's weights and optimizer state (after the chief loaded
        a backup); a no-op within one process."""
        self._synchronized = False
        self._synchronize()

    # Keras makes the step functions after building the model, before the first batch: the
    # moment every process takes the chief's weights and optimizer state (once per fit, and
    # before an evaluate or predict that comes first), so that all start identical.
    def make_train_function(self, force=False):
        if force or self.train_function is None:
            super().make_train_function(force=True)
            if self._one_call_per_step(training=True):
                self.train_function = step.one_call_per_step(
                    self.train_step, self.steps_per_execution, self.run_eagerly
                )
        self._synchronize()
        return self.train_function

    def make_test_function(self, force=False):
        if force or self.test_function is None:
            super().make_test_function(force=True)
            if self._one_call_per_step():
                self.test_function = step.one_call_per_step(
                    self.test_step, self.steps_per_execution, self.run_eagerly
                )
        self._synchronize()
        return self.test_function

    def _one_call_per_step(self, training: bool = False) -> bool:
        if training and self._draw_in_python:
            return True
        return not self._reducer.steps_in_one_call and self.steps_per_execution > 1

    def make_predict_function(self, force=False):
        function = super().make_predict_function(force)
        self._synchronize()
        return function

    def _synchronize(self) -> None:
        if not self._synchronized:
            # Every optimizer's state: a model with its own step may hold several.
            states = [v for o in own_step.optimizers(self._replica) for v in o.variables]
            self._reducer.job.broadcast(self._replica.variables + states)
            self._synchronized = True

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        if not self._replica.built:
            self._maybe_symbolic_build(data_batch=keras_hooks.first_batch(x, batch_size))
        if not self.is_chief and verbose == "auto":
            verbose = 0
        with self._reducer.job.failures():
            return super().predict(
                x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks
            )

    # -- leaving kmirror ------------------------------------------------------------------------
    def unwrap(self) -> keras.Model:
        """Returns a plain single-device Keras model with the current weights and compile state.

        The optimizer state (iterations, moments) comes along, so `fit` on the result continues
        where this model stopped.
        """
        compiled = self._user_compile if self.compiled else None
        return replication.plain_model(
            self._replica, compiled, self.optimizer, own_steps=self._own_training
        )

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Saves the model as a plain Keras file (`.keras`), loadable without kmirror."""
        keras_hooks.keep_saving_cache()
        return self._plain_copy().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def _plain_copy(self) -> keras.Model:
        """`unwrap()`'s model, made once and brought up to date at each call: a checkpoint
        every epoch must not build a new model every epoch (each leaves memory behind)."""
        plain = self._for_saving.model
        if plain is None or plain.built != self._replica.built:
            self._for_saving.model = self.unwrap()
            return self._for_saving.model
        if plain.built:
            replication.bring_up_to_date(self._replica, plain)
        return plain

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Saves the weights as the original model would, so the file fits it as well."""
        keras_hooks.keep_saving_cache()
        return self._replica.save_weights(filepath, overwrite=overwrite, **kwargs)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads weights saved by this model, by the original model, or by `unwrap()`'s model."""
        self._synchronized = False  # in a job, every process takes the chief's file
        return self._replica.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)

    def summary(self, *args, **kwargs):
        print(f"kmirror: {self._reducer.describe()} on {', '.join(self.devices)}")
        return self._replica.summary(*args, **kwargs)

    def get_config(self):
        raise NotImplementedError(
            "a MirroredModel is not serialised itself; model.save(path) writes the plain model, "
            "and kmirror.wrap(keras.models.load_model(path)) wraps it again."
        )


# -- helpers ------------------------------------------------------------------------------------
def _symbolic(data_batch):
    """A batch for Keras' symbolic build: tensors as they are, a dataset's specs as KerasTensors."""
    return tf.nest.map_structure(
        lambda t: keras.KerasTensor(t.shape, dtype=t.dtype) if isinstance(t, tf.TensorSpec) else t,
        data_batch,
    )
