"""Experiment trackers' autologging in a job of several processes: on the chief only.

`mlflow.tensorflow.autolog()` (and `mlflow.autolog()`) patch Keras' `Model.fit` so that each call
opens a run, adds MLflow's callback and logs the model: every process of a job would log a run of
its own. While a wrapped model's `fit`, `evaluate` or `predict` runs in any process but the chief,
MLflow's autologging is held off, with MLflow's own switch
(`mlflow.utils.autologging_utils.disable_autologging`, checked on MLflow 3.17). MLflow is
never imported here: only a process that imported it can have turned autologging on.

Example:

```python
with autologging_on_chief_only(job.is_chief):
    keras.Model.fit(model, x, y)
```
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["autologging_on_chief_only"]


@contextlib.contextmanager
def autologging_on_chief_only(is_chief: bool) -> Iterator[None]:
    """Within: MLflow's autologging held off unless this process is the chief."""
    if is_chief or "mlflow" not in sys.modules:
        yield
        return
    from mlflow.utils.autologging_utils import disable_autologging

    with disable_autologging():
        yield
