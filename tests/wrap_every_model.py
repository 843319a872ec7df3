"""A pytest plugin that runs Keras' own test files with every model wrapped: the first `fit` of a
Keras model wraps it with kmirror (2 simulated devices, "hierarchical_copy") and fits the wrapped
model; later fits of that model fit the same wrapped model (tests/test_backup.py runs it)."""

import functools
import weakref

import kmirror

kmirror.devices.simulate(2)

from keras.src.backend.tensorflow.trainer import TensorFlowTrainer  # noqa: E402

_fit = TensorFlowTrainer.fit
_wrapped = weakref.WeakKeyDictionary()


@functools.wraps(_fit)
def _wrapped_fit(self, *args, **kwargs):
    if isinstance(self, kmirror.MirroredModel):
        return _fit(self, *args, **kwargs)
    if self not in _wrapped:
        _wrapped[self] = kmirror.wrap(self, "hierarchical_copy", devices=["/cpu:0", "/cpu:1"])
    return _wrapped[self].fit(*args, **kwargs)


TensorFlowTrainer.fit = _wrapped_fit
