"""ChiefTensorBoard: Keras' TensorBoard callback, written by the chief alone, with more scalars."""

from __future__ import annotations

import functools
import time

import keras

from kmirror._core import cluster, keras_hooks
from kmirror.errors import steps_taken

__all__ = ["ChiefTensorBoard"]


def _chief_only(hook):
    @functools.wraps(hook)
    def guarded(self, *args, **kwargs):
        if self._chief:
            return hook(self, *args, **kwargs)

    return guarded


class ChiefTensorBoard(keras_hooks.TensorBoardOverrides):
    """Writes TensorBoard event files from the chief process only.

    Keras' `TensorBoard`, with the same arguments in the same order.

    Everything Keras' `TensorBoard` writes (epoch and batch scalars, which are global values
    under kmirror, histograms, the graph), and kmirror's own per epoch: `epoch_samples_per_second`,
    `epoch_step_time` (seconds per step) and `epoch_replicas`, plus the reducer's name as text
    (`reducer`). Other processes write nothing.

    Example:

    ```python
    board = kmirror.callbacks.ChiefTensorBoard("logs/run1")
    model.fit(x, y, epochs=5, callbacks=[board])
    # tensorboard --logdir logs
    ```

    Args:
        log_dir: the folder for the event files.
        histogram_freq: epochs between weight histograms (0: none).
        write_graph: write the model's graph.
        write_images: write the weights as images.
        write_steps_per_second: log Keras' steps per second.
        update_freq: "epoch", "batch", or a number of batches between batch-level logs.
        profile_batch: the batch (or `(first, last)` batches) to profile (0: none).
        embeddings_freq: epochs between embedding visualisations (0: none).
        embeddings_metadata: embedding layer names mapped to their metadata files.
    """

    def __init__(
        self,
        log_dir="logs",
        histogram_freq=0,
        write_graph=True,
        write_images=False,
        write_steps_per_second=False,
        update_freq="epoch",
        profile_batch=0,
        embeddings_freq=0,
        embeddings_metadata=None,
    ) -> None:
        super().__init__(
            log_dir=log_dir,
            histogram_freq=histogram_freq,
            write_graph=write_graph,
            write_images=write_images,
            write_steps_per_second=write_steps_per_second,
            update_freq=update_freq,
            profile_batch=profile_batch,
            embeddings_freq=embeddings_freq,
            embeddings_metadata=embeddings_metadata,
        )
        self._chief = True

    def set_model(self, model):
        self._chief = cluster.is_chief(model)
        if self._chief:
            super().set_model(model)
        else:
            keras.callbacks.Callback.set_model(self, model)

    on_train_begin = _chief_only(keras.callbacks.TensorBoard.on_train_begin)
    on_train_end = _chief_only(keras.callbacks.TensorBoard.on_train_end)
    on_test_begin = _chief_only(keras.callbacks.TensorBoard.on_test_begin)
    on_test_end = _chief_only(keras.callbacks.TensorBoard.on_test_end)
    on_train_batch_begin = _chief_only(keras.callbacks.TensorBoard.on_train_batch_begin)
    on_train_batch_end = _chief_only(keras.callbacks.TensorBoard.on_train_batch_end)
    on_test_batch_begin = _chief_only(keras.callbacks.TensorBoard.on_test_batch_begin)
    on_epoch_end = _chief_only(keras.callbacks.TensorBoard.on_epoch_end)

    @_chief_only
    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._kmirror_start = (time.perf_counter(), steps_taken(self.model), _samples(self.model))
        if epoch == self._kmirror_first_epoch():
            reducer = getattr(self.model, "reducer", "none (not a kmirror model)")
            with keras_hooks.train_writer(self).as_default():
                self.summary.text("reducer", str(reducer), step=epoch)

    def _kmirror_first_epoch(self) -> int:
        return keras_hooks.resumed_epoch(self.model)

    def _after_epoch_metrics(self, epoch, logs):
        start_time, start_steps, start_samples = self._kmirror_start
        seconds = time.perf_counter() - start_time
        steps = steps_taken(self.model) - start_steps
        scalars = {"replicas": getattr(self.model, "num_replicas", 1)}
        if steps > 0:
            scalars["step_time"] = seconds / steps
        samples = _samples(self.model)
        if samples is not None and seconds > 0:
            scalars["samples_per_second"] = (samples - start_samples) / seconds
        with keras_hooks.train_writer(self).as_default():
            for name, value in scalars.items():
                self.summary.scalar(f"epoch_{name}", value, step=epoch)


def _samples(model):
    return getattr(model, "samples_seen", None)
