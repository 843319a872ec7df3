"""`MirroredModel` and `wrap`: a user's compiled Keras model, replicated on every device.

`wrap` copies the model inside the reducer's scope (`kmirror.copying`: its variables become mirrored
on every replica, nothing is serialised), and compiles the copy with the user's compile settings and
an optimizer that carries the user's optimizer state; a model with its own `train_step` or
`test_step` keeps its own compiled state and its own steps (`kmirror.own_step`). The user's own
model is never changed. `MirroredModel` is a `keras.Model`: `fit`, `evaluate`, `predict` and every
Keras callback work as usual; its steps are kmirror's data-parallel steps (`kmirror.step`).
"""

from __future__ import annotations

import inspect
import random
import types
import warnings
import weakref
from typing import Any

import keras
import tensorflow as tf

from kmirror import (
    cluster,
    copying,
    errors,
    keras_hooks,
    metric_states,
    own_step,
    py_datasets,
    reducers,
    step,
)
from kmirror import data as data_lib
from kmirror.callbacks.backup import BackupAndRestore, Position
from kmirror.reducers.base import Reducer

__all__ = ["MirroredModel", "wrap"]


def wrap(
    model: keras.Model,
    reducer: str | Reducer | tf.distribute.CrossDeviceOps = "auto",
    *,
    devices: list[str] | None = None,
    num_gpus: int | None = None,
    cluster_spec=None,
    task_type: str | None = None,
    task_id: int | None = None,
    sync_batch_norm: bool = True,
    prefetch: bool | None = None,
    **reducer_options: Any,
) -> MirroredModel:
    """Wraps a Keras model for synchronous data-parallel training on every local device.

    The returned `MirroredModel` trains exactly as the original model would on one device with
    the same global batch (`batch_size` in `fit` is the global batch), only split across replicas.
    Weights, compile settings and optimizer state carry over, so training continues where it was.
    The model passed in is left unchanged.

    Example:

    ```python
    import kmirror
    kmirror.devices.simulate(2)                   # without GPUs: 2 logical CPU devices
    import keras, numpy as np
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.rand(100, 8), np.random.rand(100, 1)
    model = kmirror.wrap(model, reducer="hierarchical_copy")
    model.fit(x, y, batch_size=32, epochs=2)      # 32 rows per step in all: 16 per replica
    ```

    Args:
        model: any `keras.Model` that trains on one device: Sequential, functional or
            subclassed, with or without `get_config`, with its own `train_step`, `test_step` or
            `predict_step` or not, built or not, compiled or not (compile the wrapped model
            before `fit` if not).
        reducer: how gradients are summed across replicas: a name from `kmirror.REDUCERS`, a
            `kmirror.reducers.Reducer` object, or a `tf.distribute.CrossDeviceOps`.
        devices: the devices to replicate on (default: every GPU, else every logical CPU).
        num_gpus: use the first `num_gpus` GPUs instead of naming devices (0: the CPUs).
        cluster_spec: the workers of a multi-worker job (a dict, `tf.train.ClusterSpec` or
            `ClusterDef`); default: `TF_CONFIG`'s. Call `kmirror.cluster.connect()` first.
        task_type: this process's job in `cluster_spec` ("worker" or "chief").
        task_id: this process's index in its job.
        sync_batch_norm: BatchNormalization layers use the statistics of the global batch, as on
            one device (default). False: each replica normalises with its own rows' statistics,
            one all-reduce fewer per layer and step, but no longer the single-device result.
        prefetch: with several replicas in one process, each replica's rows of the next batch
            of a `tf.data` dataset or of arrays are copied to its device while the current step
            runs, as `tf.distribute` does (the same rows, the same result). None (default): when
            the replicas are GPUs; on CPU devices the copy is free and the extra input
            pipeline per device only costs time.
        **reducer_options: options of the named reducer, e.g. `num_packs=2` for `"nccl"`.

    Returns:
        A `kmirror.MirroredModel`.
    """
    if isinstance(model, MirroredModel):
        raise ValueError(
            "this model is already a kmirror.MirroredModel; use it as it is, or call "
            "model.unwrap() first to wrap the plain model with other settings."
        )
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"kmirror.wrap expects a keras.Model; got {type(model).__name__}. Build a Keras model "
            "(keras.Sequential, the functional API, or a keras.Model subclass) and pass that."
        )
    workers = cluster.describe(cluster_spec, task_type, task_id)
    if workers is not None:
        if devices is not None:
            raise ValueError(
                "devices cannot be given together with cluster_spec / TF_CONFIG: every worker "
                "replicates on all its local GPUs, else on its CPU devices, as TensorFlow's "
                "MultiWorkerMirroredStrategy does."
            )
        if cluster_spec is not None:
            cluster.connect(cluster_spec, task_type, task_id)
    chosen = reducers.get(
        reducer,
        devices=devices,
        num_gpus=num_gpus,
        multi_worker=workers is not None,
        **reducer_options,
    )
    chosen.bind(devices=devices, num_gpus=num_gpus)
    if prefetch is not None and not isinstance(prefetch, bool):
        raise ValueError(
            f"prefetch must be True, False or None (prefetch on GPUs); got {prefetch!r}."
        )
    return MirroredModel(model, chosen, sync_batch_norm=sync_batch_norm, prefetch=prefetch)


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
        self._batches: py_datasets.Batches | None = None  # the PyDataset the current fit reads
        #: `local_batches` datasets whose batch counts the processes compared.
        self._counted = weakref.WeakSet()
        # The plain model `save` writes (see _plain_copy), held where Keras does not track it as
        # a layer of this model.
        self._for_saving = types.SimpleNamespace(model=None)
        # A model with its own train_step or test_step keeps its compiled state (its optimizers,
        # losses and metrics, copied onto the replicas); kmirror compiles the others anew.
        self._own_steps = own_step.overridden(model)
        self._own_training = bool(self._own_steps & {"train_step", "test_step"})
        self._replica = _replicate(model, reducer, keep_compiled=self._own_training)
        self._samples_seen = tf.Variable(0, dtype=tf.int64, trainable=False, name="samples_seen")
        if hasattr(self._replica, "output_names"):
            self.output_names = list(self._replica.output_names)
        self.built = True
        if model.compiled and self._own_training:
            self._compile_own()
        elif model.compiled:
            compile_args = keras_hooks.compile_arguments(model)
            compile_args["metrics"] = _fresh_metrics(compile_args.get("metrics"))
            compile_args["weighted_metrics"] = _fresh_metrics(compile_args.get("weighted_metrics"))
            self.compile(**compile_args)
            if model.optimizer is not None and model.optimizer.built and self._replica.built:
                _copy_optimizer_state(model.optimizer, self.optimizer)

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
        return self._reducer.is_chief

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
                _build_optimizer(replica)
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
            optimizer = _new_optimizer(optimizer)
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
                _build_optimizer(self._replica)
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
        if self._replica_jit_compile and self._sync_batch_norm and _has_batch_norm(self._replica):
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
        data, place = data_lib.unpack(data)
        if self._own_training:
            rows = step.global_rows(self._reducer, data, place)
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
        outcome = outcome._replace(loss=tf.debugging.check_numerics(outcome.loss, _NON_FINITE))
        self._samples_seen.assign_add(tf.cast(outcome.rows, tf.int64))
        return self._record(data, outcome)

    def test_step(self, data):
        data, place = data_lib.unpack(data)
        if self._own_training:
            return own_step.evaluate(self._replica, self._reducer, data, place=place)
        outcome = step.evaluate(
            self._replica, self._reducer, data, logged=self._logged(), place=place
        )
        return self._record(data, outcome)

    def predict_step(self, data):
        data, place = data_lib.unpack(data)
        if "predict_step" in self._own_steps:
            return own_step.predict(self._replica, self._reducer, data, place=place)
        if place is not None:
            raise ValueError(
                "predict takes the global batches (every process the same inputs, every process "
                "gets every prediction); pass the inputs themselves, not kmirror.data.shard's or "
                "local_batches' dataset."
            )
        return step.predict(self._replica, self._reducer, data)

    def _logged(self) -> step.Logged:
        """Metrics whose states add up are updated from the replicas' summed states; others
        (and per-output losses) from the gathered predictions."""
        metrics = keras_hooks.compiled_metrics(self)
        return step.Logged.of(metrics, compiled_loss=keras_hooks.compiled_loss(self) is not None)

    def _record(self, data, outcome: step.Outcome):
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
            model_built = all(layer.built for layer in _layers(replica))
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
        data_batch, _ = data_lib.unpack(data_batch)
        if replica_built and (compile_loss is None or compile_loss.built):
            self._build_metrics(data_batch)
            return
        with self._reducer.scope():
            if not model_built or not (compile_loss is None or compile_loss.built):
                keras_hooks.symbolic_build(replica, _symbolic(data_batch))
            if replica.compiled:
                _build_optimizer(replica)
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

    def _check_local_batches(self, arguments: dict) -> None:
        """Every process must yield as many batches of its own (`kmirror.data.local_batches`):
        one with more would wait for the others at its extra steps."""
        if arguments.get("steps_per_epoch") or arguments.get("steps"):
            return
        validation = arguments.get("validation_data")
        for name, data in (("x", arguments.get("x")), ("validation_data", validation)):
            count = data_lib.local_batch_count(data)
            # A dataset's count never changes: fit's evaluate of every epoch needs no new check.
            if count is None or data in self._counted:
                continue
            counts = self._reducer.gather_counts(count)
            if len(set(counts)) > 1:
                raise ValueError(
                    f"kmirror.data.local_batches: the processes' datasets ({name}) yield "
                    f"{', '.join(map(str, counts))} batches (in process order); every process "
                    "must yield as many. Batch with drop_remainder=True after sharding evenly, "
                    "or pass steps_per_epoch (steps for evaluate)."
                )
            self._counted.add(data)

    def _build_from_spec(self, x) -> None:
        """Builds from a dataset's element spec, drawing no batch from it: a batch drawn before
        training would advance a seeded shuffle, and the epochs would no longer be one device's."""
        if not isinstance(x, tf.data.Dataset):
            return
        spec, _ = data_lib.unpack(x.element_spec)
        leaves = tf.nest.flatten(spec)
        if all(isinstance(s, tf.TensorSpec) and s.shape.rank is not None for s in leaves):
            self._maybe_symbolic_build(data_batch=spec)

    def fit(self, *args, **kwargs):
        self._synchronized = False
        with self._reducer.failures():
            # Processes of one job must shuffle alike: each takes its rows of the same batch.
            # Seeded once: from then on they draw the same numbers. Seeding TensorFlow clears its
            # kernel caches, so seeding every fit would rebuild the step (seconds) every time.
            if not self._seeded:
                self._reducer.agree_on_seed()
                self._seeded = True
            arguments = self._chief_prints(keras.Model.fit, args, kwargs)
            resume = self._agree_on_resume(arguments)
            skipping = resume is not None and resume.step > 0
            arguments = self._rows_of_process(arguments, fit=True, skipping=skipping)
            # The resumed pass of a PyDataset does not load the batches already trained.
            arguments = self._read_py_datasets(arguments, fit=True, skip=skipping and resume.step)
            self._check_local_batches(arguments)
            self._build_from_spec(arguments.get("x"))
            if resume is None:
                arguments = self._on_devices(arguments)
            elif isinstance(arguments.get("x"), tf.data.Dataset):
                # Not prefetched: the resumed pass is this dataset's own.
                arguments["x"] = data_lib.resumed(arguments["x"], resume.epoch, resume.step)
            position = _Position()
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
                if _NON_FINITE not in str(error):
                    raise
                raise errors.NonFiniteLoss(position.describe_non_finite()) from None
            finally:
                self._batches = None
                if self._draw_in_python:
                    self._draw_in_python = False
                    self.train_function = None  # the next fit traces Keras' loop again

    def evaluate(self, *args, **kwargs):
        with self._reducer.failures():
            arguments = self._rows_of_process(
                self._chief_prints(keras.Model.evaluate, args, kwargs)
            )
            arguments = self._read_py_datasets(arguments)
            self._check_local_batches(arguments)
            self._build_from_spec(arguments.get("x"))
            return super().evaluate(**self._on_devices(arguments))

    def _agree_on_resume(self, arguments: dict):
        """The position every process resumes from: the chief's newest intact backup of the
        `BackupAndRestore` among the callbacks (other processes' folders are not read), or None.
        Inside an epoch only for input whose batches can be skipped (numpy arrays, `tf.data`)."""
        callbacks = arguments.get("callbacks") or []
        backup = next((c for c in callbacks if isinstance(c, BackupAndRestore)), None)
        if backup is None:
            return None
        found, error = None, None
        if self.is_chief:
            try:
                found = backup.latest()
            except ValueError as problem:
                error = problem
        # Other processes offer values below any the chief can, so the largest is the chief's.
        mine = (-3, 0) if error else (found.position if found else (-1, 0))
        epoch = max(self._reducer.gather_counts(mine[0] if self.is_chief else -4))
        step = max(self._reducer.gather_counts(mine[1] if self.is_chief else -1))
        if error is not None:
            raise error
        if epoch == -3:
            raise ValueError(
                "kmirror.callbacks.BackupAndRestore: the chief's backup cannot be resumed; its "
                "error names the fix."
            )
        if epoch < 0:
            backup.resume_from(None, None)
            return None
        if step and not self._skippable(arguments):
            warnings.warn(
                f"kmirror: training resumes at the start of epoch {epoch + 1}, whose first "
                f"{step} batch(es) were trained before the interruption: only numpy arrays, "
                "tf.data datasets and PyDatasets of known length, without steps_per_epoch, "
                "resume inside an epoch.",
                stacklevel=3,
            )
            step = 0
        self._take_chief_python_random(found.python_random if found else None)
        position = Position(epoch, step)
        backup.resume_from(position, found.weights if found else None)
        return position

    def _take_chief_python_random(self, words: list[int] | None) -> None:
        """Every process takes the state of Python's `random` module the chief's backup holds
        (the chief's own state when it holds none): the resumed epoch draws its batch order
        from it, as the uninterrupted run did."""
        if self.is_chief and words is None:
            words = list(random.getstate()[1])
        if self._reducer.num_processes > 1:
            shared = keras.Variable(words or [0] * 625, dtype="int64", trainable=False)
            self._reducer.broadcast([shared])
            words = [int(w) for w in keras.ops.convert_to_numpy(shared)]
        random.setstate((3, tuple(words), None))

    @staticmethod
    def _skippable(arguments: dict) -> bool:
        if arguments.get("steps_per_epoch"):
            return False
        x = arguments.get("x")
        if isinstance(x, tf.data.Dataset) or py_datasets.readable(x, None):
            return True
        return data_lib.is_arrays(x, arguments.get("y"), arguments.get("sample_weight"))

    def take_chief_state(self) -> None:
        """Every process takes the chief's weights and optimizer state (after the chief loaded
        a backup); a no-op within one process."""
        self._synchronized = False
        self._synchronize()

    def _rows_of_process(self, arguments: dict, fit: bool = False, skipping: bool = False) -> dict:
        """`fit`'s or `evaluate`'s arguments, arrays replaced by datasets of this process's rows
        of each global batch when the job has several processes (`kmirror.data.arrays`), or
        datasets of the whole batches when they are to be prefetched to the replicas or resumed
        inside an epoch (`skipping`)."""
        reducer = self._reducer
        prefetched = self._prefetch and reducer.num_replicas > 1
        if reducer.num_processes == 1 and not (prefetched or skipping):
            return arguments
        given = dict(arguments)
        where = {"index": reducer.process_index, "count": reducer.num_processes}
        x, y, weights = (given.get(k) for k in ("x", "y", "sample_weight"))
        batch_size = given.get("batch_size")
        if data_lib.is_arrays(x, y, weights):
            split = given.pop("validation_split", 0.0)
            if split and given.get("validation_data") is None:
                (x, y, weights), given["validation_data"] = keras_hooks.validation_split(
                    (x, y, weights), split
                )
            rows = int(tf.nest.flatten(x)[0].shape[0])
            steps = given.get("steps_per_epoch", given.get("steps"))
            batch_size = batch_size or (-(-rows // steps) if steps else 32)
            given["x"] = data_lib.arrays(
                x,
                y,
                weights,
                batch_size=batch_size,
                shuffle=given.pop("shuffle", fit),  # fit shuffles by default
                class_weight=given.pop("class_weight", None),
                **where,
            )
            given.update(y=None, sample_weight=None, batch_size=None)
            if fit:  # the batches are drawn shuffled; the dataset itself is not shuffled again
                given["shuffle"] = False
        validation = given.get("validation_data")
        if isinstance(validation, tuple) and data_lib.is_arrays(*validation):
            vx, vy, vweights = keras.utils.unpack_x_y_sample_weight(validation)
            given["validation_data"] = data_lib.arrays(
                vx,
                vy,
                vweights,
                batch_size=given.pop("validation_batch_size", None) or batch_size,
                **where,
            )
        return given

    def _read_py_datasets(self, arguments: dict, fit: bool = False, skip: int = 0) -> dict:
        """`fit`'s or `evaluate`'s arguments, each `PyDataset` of known length replaced by its
        batches as Keras draws them (`kmirror.py_datasets`): this process's rows of each for a
        `kmirror.data.RowDataset`; the first pass of `fit`'s skips `skip` batches."""
        given = dict(arguments)
        where = {"index": self._reducer.process_index, "count": self._reducer.num_processes}
        if py_datasets.readable(given.get("x"), given.get("steps_per_epoch" if fit else "steps")):
            batches = py_datasets.Batches(
                given["x"],
                shuffle=given.pop("shuffle", True) if fit else False,
                class_weight=given.pop("class_weight", None),
                **where,
            )
            batches.resume(skip)
            given["x"] = self._read(batches)
            if fit:
                self._batches = batches
        validation = given.get("validation_data")
        if fit and py_datasets.readable(validation, given.get("validation_steps")):
            given["validation_data"] = self._read(py_datasets.Batches(validation, **where))
        return given

    def _read(self, batches: py_datasets.Batches):
        """What `fit` takes for `batches` (its count of steps is Keras' input), the model built
        from its element spec."""
        dataset = batches.dataset()
        self._build_from_spec(dataset)
        return keras_hooks.distributed_input(dataset, batches.num_batches)

    def batch_order_drawn_from(self) -> tuple | None:
        """Python's random state the current `fit` drew the order of its epoch's batches from:
        that of a `PyDataset`'s pass (see `kmirror.py_datasets`); None for other input."""
        return None if self._batches is None else self._batches.drawn_from

    def _on_devices(self, arguments: dict) -> dict:
        """`fit`'s or `evaluate`'s arguments, datasets replaced by their batches prefetched to the
        replicas' devices (`kmirror.data.on_devices`) once the model is built from their spec."""
        if not (self._prefetch and self._replica.built):
            return arguments
        given = dict(arguments)
        for name in ("x", "validation_data"):
            if isinstance(given.get(name), tf.data.Dataset):
                given[name] = data_lib.on_devices(given[name], self._reducer)
        return given

    def _chief_prints(self, method, args, kwargs) -> dict:
        """The arguments by name; one progress bar per job: other processes are quiet unless
        `verbose` was given."""
        signature = inspect.signature(method)
        given = {}
        for name, value in signature.bind(self, *args, **kwargs).arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                given.update(value)
            elif name != "self":
                given[name] = value
        if not self.is_chief and "verbose" not in given:
            given["verbose"] = 0
        return given

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
            self._reducer.broadcast(self._replica.variables + states)
            self._synchronized = True

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        if not self._replica.built:
            self._maybe_symbolic_build(data_batch=keras_hooks.first_batch(x, batch_size))
        if not self.is_chief and verbose == "auto":
            verbose = 0
        with self._reducer.failures():
            return super().predict(
                x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks
            )

    # -- leaving kmirror ------------------------------------------------------------------------
    def unwrap(self) -> keras.Model:
        """Returns a plain single-device Keras model with the current weights and compile state.

        The optimizer state (iterations, moments) comes along, so `fit` on the result continues
        where this model stopped.
        """
        if self._own_training:  # its optimizers, with their state, come along in the copy
            return copying.copy_model(self._replica, skip=keras_hooks.step_functions(self._replica))
        plain = _copy(self._replica)
        if self.compiled and self._user_compile is not None:
            args = dict(self._user_compile)
            plain.compile(
                optimizer=_new_optimizer(self.optimizer),
                **{
                    **args,
                    "metrics": _fresh_metrics(args["metrics"]),
                    "weighted_metrics": _fresh_metrics(args["weighted_metrics"]),
                },
            )
            if plain.built:
                _build_optimizer(plain)
                _copy_optimizer_state(self.optimizer, plain.optimizer)
        return plain

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
            _copy_variables(self._replica, plain)
            pairs = zip(own_step.optimizers(self._replica), own_step.optimizers(plain))
            for replica_optimizer, plain_optimizer in pairs:
                if plain_optimizer.built:
                    _copy_optimizer_state(replica_optimizer, plain_optimizer)
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
#: The marker of the training step's check that the global loss is finite.
_NON_FINITE = "kmirror: the global loss is not finite"


class _Position(keras.callbacks.Callback):
    """Where training is, for the message of `NonFiniteLoss` (epoch hooks only: Keras still
    dispatches the batch hooks without waiting for the step's logs)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.first_step = epoch, _steps(self.model)

    def describe_non_finite(self) -> str:
        batch = _steps(self.model) - self.first_step  # the failed step's update was applied
        return (
            f"kmirror: the training loss became NaN or infinite at epoch {self.epoch + 1}, batch "
            f"{batch}; every process stopped at this step. Look for NaN or infinite values in the "
            "data (numpy: np.isfinite(x).all()), lower the learning rate, or clip gradients (e.g. "
            "optimizer=keras.optimizers.SGD(..., clipnorm=1.0)), then train again from the last "
            "checkpoint. The model passed to kmirror.wrap is unchanged; this wrapped model's "
            "weights hold the non-finite update."
        )


def _steps(model) -> int:
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


def _symbolic(data_batch):
    """A batch for Keras' symbolic build: tensors as they are, a dataset's specs as KerasTensors."""
    return tf.nest.map_structure(
        lambda t: keras.KerasTensor(t.shape, dtype=t.dtype) if isinstance(t, tf.TensorSpec) else t,
        data_batch,
    )


def _has_batch_norm(model: keras.Model) -> bool:
    return any(isinstance(layer, keras.layers.BatchNormalization) for layer in _layers(model))


def _layers(layer) -> list:
    """Every layer inside `layer`, nested models included."""
    found = []
    for inner in getattr(layer, "layers", []):
        found += [inner, *_layers(inner)]
    return found


def _replicate(model: keras.Model, reducer: Reducer, keep_compiled: bool) -> keras.Model:
    """The model copied inside the reducer's scope: its variables mirrored on every replica."""
    with reducer.scope():
        if keep_compiled:
            return copying.copy_model(model, skip=keras_hooks.step_functions(model))
        return _copy(model)


def _copy(model: keras.Model) -> keras.Model:
    """`model` copied with its weights, without what `compile` made (kmirror compiles the copy)
    nor Keras' traced step functions (they belong to the original)."""
    return copying.copy_model(model, skip=keras_hooks.compiled_state(model))


def _copy_variables(source: keras.Model, target: keras.Model) -> None:
    """Every variable of `source` into `target`: weights, and the state of random layers' seed
    generators (so that dropout draws the masks it would have drawn)."""
    target.set_weights(source.get_weights())
    given, rest = _non_weights(source), _non_weights(target)
    if len(rest) == len(given):
        for src, dst in zip(given, rest):
            if tuple(src.shape) == tuple(dst.shape):
                dst.assign(src.value)


def _non_weights(model: keras.Model) -> list:
    """The variables of `model` that `get_weights` leaves out (seed generator states)."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _new_optimizer(optimizer):
    """A new optimizer with `optimizer`'s config, its variables created in the current scope."""
    if optimizer is None or isinstance(optimizer, str | dict):
        return keras.optimizers.get(optimizer) if optimizer is not None else None
    return type(optimizer).from_config(optimizer.get_config())


def _build_optimizer(model: keras.Model) -> None:
    optimizer = model.optimizer
    if optimizer is None or optimizer.built:
        return
    optimizer.build(model.trainable_variables)


def _copy_optimizer_state(source, target) -> None:
    if len(source.variables) != len(target.variables):
        raise ValueError(
            f"cannot carry the optimizer state over: {len(source.variables)} variables in the "
            f"original optimizer, {len(target.variables)} in the new one."
        )
    for src, dst in zip(source.variables, target.variables):
        dst.assign(src.value)


def _fresh_metrics(metrics):
    """Copies of the user's metric objects (with their names), so that the wrapped model never
    shares their state."""
    if metrics is None:
        return None

    def copy(metric):
        if isinstance(metric, keras.metrics.Metric):
            return type(metric).from_config(metric.get_config())
        return metric

    return tf.nest.map_structure(copy, metrics)
