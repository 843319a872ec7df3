"""The wrapped model answers as the user's model: `AnswersAsModel`, `MirroredModel`'s first base.

A `MirroredModel` (`_core.model`) is a `keras.Model` of its own in front of the user's model.
What a user asks of a model it answers from the user's: its layers, inputs and outputs, its
summary, whether it is trainable (set through to the user's model too), and every name of the
user's model's own (a GAN's `generator`, a helper method or property) that neither Keras nor
kmirror gives the wrapped model, read and set through. The class expects `_model` (the user's
model) in its instance, and `_answers_as_model` set once it is made.
"""

from __future__ import annotations

import keras

from kmirror._core import keras_hooks

__all__ = ["AnswersAsModel"]


class AnswersAsModel:
    """The names of a wrapped model that answer as its user's model (`_model`)."""

    def __getattr__(self, name):
        # Called for names this model has not: the user's model's own (its sub-models, methods,
        # properties); kmirror's names and Keras' are this model's.
        if self._users_own(name):
            return getattr(vars(self)["_model"], name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        if self._users_own(name) and name not in vars(self):
            setattr(vars(self)["_model"], name, value)
        else:
            super().__setattr__(name, value)

    def _users_own(self, name: str) -> bool:
        """Whether `name` is the user's model's own: the user's model has it, and neither Keras
        nor kmirror gives this model a name like it."""
        state = vars(self)
        return (
            state.get("_answers_as_model", False)
            and not hasattr(type(self), name)
            and not keras_hooks.keras_model_name(name)
            and hasattr(state["_model"], name)
        )

    @property
    def layers(self):
        return self._model.layers

    @property
    def trainable(self):
        model = vars(self).get("_model")
        return keras.Model.trainable.fget(self) if model is None else model.trainable

    @trainable.setter
    def trainable(self, value):
        model = vars(self).get("_model")
        if model is None:  # keras.Model's constructor sets it before there is a model
            keras.Model.trainable.fset(self, value)
        else:
            model.trainable = value

    inputs = property(lambda self: self._model.inputs)
    outputs = property(lambda self: self._model.outputs)
    input = property(lambda self: self._model.input)
    output = property(lambda self: self._model.output)
    input_shape = property(lambda self: self._model.input_shape)
    output_shape = property(lambda self: self._model.output_shape)
    input_spec = property(lambda self: self._model.input_spec)

    def summary(self, *args, **kwargs):
        return self._model.summary(*args, **kwargs)

    def get_config(self):
        raise NotImplementedError(
            "a MirroredModel is not serialised itself; model.save(path) writes the user's model, "
            "and kmirror.wrap(keras.models.load_model(path)) wraps it again."
        )
