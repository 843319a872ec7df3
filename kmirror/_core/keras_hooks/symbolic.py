"""A Keras model built from one batch's specs, as Keras' `fit` builds it under a strategy
(`Trainer._symbolic_build`, checked on Keras 3.12 and 3.15): its layers, its compiled loss and
metrics; and a batch evaluated symbolically, to raise what evaluating it would raise.

Keras learns a model's outputs for the batch by calling the model on the batch's specs, a forward
pass of ops made in a scratch graph (1.7 s for MobileNetV2). A wrapped model builds two models'
compiled losses and metrics from those outputs (the user's model, whose loss the replicas compute,
and the wrapped model, whose metrics it logs): `symbolic_build` computes them once and hands them
to `build_compiled`. A built functional or sequential model whose call is Keras' own knows its
outputs' specs (Keras' `compute_output_spec` takes them from the graph it was made from): they
are taken from it, with no forward pass.

Example:

```python
with strategy.scope():
    outputs = symbolic_build(model, (x, y))  # x, y: KerasTensors
build_compiled(wrapped, (x, y), outputs)
```
"""

from __future__ import annotations

import keras
from keras.src import backend as keras_backend
from keras.src.models.functional import Functional

from kmirror._core.keras_hooks.model_state import compiled_loss, compiled_metrics

__all__ = ["symbolic_build", "build_compiled", "symbolic_evaluation"]


def symbolic_build(model, data_batch):
    """Builds `model`, its compiled loss and metrics from `data_batch` (KerasTensors); returns
    its outputs' specs. (`MirroredModel` overrides Keras' `_maybe_symbolic_build`, where `fit`,
    `evaluate` and `predict` call Keras' own build; its optimizer it builds itself.)"""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data_batch)
    outputs = _outputs(model, x)
    build_compiled(model, data_batch, outputs)
    return outputs


def build_compiled(model, data_batch, outputs=None) -> None:
    """Builds `model`'s compiled metrics and loss, those not built yet, as Keras does from
    `data_batch` and `model`'s outputs' specs (`outputs`; computed here when None)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data_batch)
    metrics, loss = compiled_metrics(model), compiled_loss(model)
    metrics_unbuilt = metrics is not None and not metrics.built
    loss_unbuilt = loss is not None and not loss.built
    if not (metrics_unbuilt or loss_unbuilt):
        return
    if outputs is None:
        outputs = _outputs(model, x)
    if metrics_unbuilt:
        keras_backend.compute_output_spec(
            model.compute_metrics, x, y, outputs, sample_weight=sample_weight
        )
    if loss_unbuilt:
        keras_backend.compute_output_spec(
            model._compute_loss, x, y, outputs, sample_weight=sample_weight, training=False
        )


def symbolic_evaluation(model, data_batch) -> None:
    """Computes `model`'s outputs and compiled loss on `data_batch` (KerasTensors) symbolically,
    as Keras' `_symbolic_build` does: raises what evaluating that batch would raise; runs
    nothing and changes no state."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data_batch)
    y_pred = keras_backend.compute_output_spec(model, x, training=False)
    if y is not None and compiled_loss(model) is not None:
        keras_backend.compute_output_spec(
            model.compute_loss, x, y, y_pred, sample_weight=sample_weight, training=False
        )


def _outputs(model, x):
    """The specs of `model`'s outputs for inputs `x`, building `model` where it is not built."""
    graph = _graph_of(model)
    if graph is not None:
        # Any row count, as the model's inputs take: Keras then reads the outputs the model was
        # made with instead of computing them layer by layer.
        specs = keras.tree.map_structure(
            lambda t: keras.KerasTensor((None, *t.shape[1:]), t.dtype), x
        )
        if [t.shape for t in keras.tree.flatten(specs)] == [t.shape for t in graph.inputs]:
            return graph.compute_output_spec(specs)
    return keras_backend.compute_output_spec(model, x, training=False)


def _graph_of(model) -> Functional | None:
    """The functional graph a built functional or sequential model was made from, where its call
    and outputs are Keras' own; else None."""
    if isinstance(model, keras.Sequential) and type(model).call is keras.Sequential.call:
        graph = model._functional
    elif isinstance(model, Functional) and type(model).call is Functional.call:
        graph = model
    else:
        return None
    if graph is None or type(graph).compute_output_spec is not Functional.compute_output_spec:
        return None
    return graph if all(layer.built for layer in model._flatten_layers()) else None
