"""kmirror: exact synchronous data-parallel training for any compiled Keras 3 model.

```python
import kmirror
model = kmirror.wrap(model, reducer="auto")
model.fit(x, y, batch_size=256, epochs=10)
```
"""

from kmirror import versions

versions.check()  # before anything that reaches into Keras or TensorFlow

from kmirror import callbacks, cluster, data, devices, errors, reducers  # noqa: E402
from kmirror.model import MirroredModel  # noqa: E402
from kmirror.reducers import REDUCERS  # noqa: E402
from kmirror.wrapping import wrap  # noqa: E402

__version__ = "0.1.0"
"""kmirror's version.

Example:

```python
import kmirror
print(kmirror.__version__)
```
"""


def __getattr__(name):
    # Imported on first use, so that `python -m kmirror.launch` runs a module not yet imported.
    if name == "launch":
        import importlib

        return importlib.import_module("kmirror.launch")
    raise AttributeError(f"module 'kmirror' has no attribute {name!r}")


__all__ = [
    "wrap",
    "MirroredModel",
    "REDUCERS",
    "reducers",
    "devices",
    "launch",
    "callbacks",
    "cluster",
    "data",
    "errors",
    "versions",
    "__version__",
]
