"""kmirror's own errors (bad input raises ValueError or TypeError, as Keras does).

Example:

```python
import kmirror, keras, numpy as np
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model = kmirror.wrap(model)
try:
    model.fit(np.random.rand(32, 8), np.random.rand(32, 1), epochs=1)
except kmirror.errors.PeerLost as lost:     # another process of the job stopped
    print(lost)                             # it says how to relaunch
```
"""

from __future__ import annotations

__all__ = ["PeerLost", "NonFiniteLoss", "reason"]


class PeerLost(RuntimeError):
    """Another process of a multi-process job stopped, so this one cannot go on.

    Relaunch every process; with `kmirror.callbacks.BackupAndRestore` training resumes from the
    chief's last backup.
    """


class NonFiniteLoss(FloatingPointError):
    """The training loss of a global batch became NaN or infinite; every process stopped there.

    Every process sees the same global loss, so all stop at the same step. The model given to
    `kmirror.wrap` is unchanged; the wrapped model's weights hold the non-finite update.
    """


_TELLING = ("connection", "collective", "timed out", "unavailable", "reset", "closed", "shut down")


def reason(error: BaseException) -> str:
    """The line of a low-level (TensorFlow, gRPC, Gloo) error message that says what happened."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = [line for line in lines if any(word in line.lower() for word in _TELLING)]
    return (telling or lines or [type(error).__name__])[0][:300]
