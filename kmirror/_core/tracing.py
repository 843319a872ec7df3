"""What kmirror does while TensorFlow traces one of its steps (`traced`): Python's cyclic garbage
collector waits, and the custom gradients the trace left in TensorFlow's registry are released.

Tracing a deep model's step makes hundreds of thousands of Python objects (ops, tensors, their
gradients' closures) that live as long as the step's graph. Each of the collector's full passes
walks every object the process holds, and a trace made them often enough to start several:
MobileNetV2's first step on 2 replicas ran 3 (0.86 s); held off, the step took 0.73 s less (18.2 s
to 17.5 s, medians of 5 alternating runs). The collector is held off while a step traces and set
back as it was (enabled or not) when the last step traced at once returns; a trace's cycles are
collected by the first pass after it.

Where one device would trace the step twice (TensorFlow traces a function again when its first
trace made variables: `Builder.traces_twice`) and the trace drew from Python's or NumPy's
generators, it ends with `python_draws.TracedAgain`: traced again, its graph draws what one
device's second trace draws."""

from __future__ import annotations

import functools
import gc
import threading

import tensorflow as tf

from kmirror._core import python_draws, reached_state
from kmirror._core.tf_hooks import graphs

__all__ = ["traced"]

_steps: list = []  # per step being traced: (custom gradients, collector enabled) as the first began
_lock = threading.Lock()


def traced(step_method):
    """`step_method` (a step Keras traces, or runs eagerly) with the collector held, and its
    custom gradients released once the last step traced at once has returned (each step takes
    its gradients within it)."""

    @functools.wraps(step_method)
    def method(self, data):
        with _lock:
            if not _steps:
                _steps.append((graphs.custom_gradients(), gc.isenabled()))
                gc.disable()
            else:
                _steps.append(_steps[0])
        try:
            if tf.executing_eagerly():  # an eager step: no trace shows the state it writes
                self.look_before_eager(functools.partial(step_method, self), data)
            drawn = python_draws.drawn()
            outputs = step_method(self, data)
            reached_state.check()  # before the step runs: state it writes, not mirrored
            twice = self.traces_twice(step_method.__name__)
            if twice and python_draws.drawn() > drawn and not tf.executing_eagerly():
                raise python_draws.TracedAgain()  # one device runs its second trace's draws
            return outputs
        finally:
            with _lock:
                before, collecting = _steps.pop()
                if not _steps:
                    graphs.release_custom_gradients(before)
                    if collecting:
                        gc.enable()

    return method
