"""Ray Train's Keras callbacks in a job of several processes: the chief's checkpoint alone.

Ray Train's `ReportCheckpointCallback` (`ray.train.tensorflow.keras`, and the older
`ray.air.integrations.keras`) runs on every worker, and each reports a checkpoint of its model at
each `checkpoint_on` event: every worker saves the model, and Ray stores each copy over the
others. Ray's `report` is a barrier, so every worker must still report at the same events. For the
length of a `fit`, a worker other than the chief reports the same (global) metrics at the same
events, without a checkpoint; the chief reports with the checkpoint, which is written once.

The callback's fields this reads and sets, `_checkpoint_on` and `_report_metrics_on` (the events of
each), are Ray's private names, checked on Ray 2.60. Ray is never imported here.

Example:

```python
with chief_checkpoints(callbacks, is_chief=False):
    keras.Model.fit(model, x, y, callbacks=callbacks)  # reports metrics only
```
"""

from __future__ import annotations

import contextlib

__all__ = ["chief_checkpoints"]


def _reports_to_ray(callback) -> bool:
    """Whether `callback` is one of Ray Train's Keras callbacks that report checkpoints."""
    made_by_ray = any(c.__module__.split(".")[0] == "ray" for c in type(callback).__mro__)
    return (
        made_by_ray
        and hasattr(callback, "_checkpoint_on")
        and hasattr(callback, "_report_metrics_on")
    )


@contextlib.contextmanager
def chief_checkpoints(callbacks, is_chief: bool):
    """Meanwhile, Ray Train's callbacks in `callbacks` report checkpoints from the chief only
    (a worker other than the chief reports its metrics at the same events)."""
    reporting = [] if is_chief else [c for c in callbacks if _reports_to_ray(c)]
    kept = [(c._checkpoint_on, c._report_metrics_on) for c in reporting]
    for callback in reporting:
        events = list(callback._checkpoint_on) + list(callback._report_metrics_on)
        callback._report_metrics_on = list(dict.fromkeys(events))
        callback._checkpoint_on = []
    try:
        yield
    finally:
        for callback, (checkpoint_on, report_metrics_on) in zip(reporting, kept, strict=True):
            callback._checkpoint_on = checkpoint_on
            callback._report_metrics_on = report_metrics_on
