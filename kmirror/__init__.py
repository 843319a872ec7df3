"""kmirror: exact synchronous data-parallel training for any compiled Keras 3 model.

```python
import kmirror
model = kmirror.wrap(model, reducer="auto")
model.fit(x, y, batch_size=256, epochs=10)
```
"""

from kmirror import callbacks, cluster, devices, errors, launch, reducers
from kmirror.model import MirroredModel, wrap
from kmirror.reducers import REDUCERS

__version__ = "0.1.0"

__all__ = [
    "wrap",
    "MirroredModel",
    "REDUCERS",
    "reducers",
    "devices",
    "launch",
    "callbacks",
    "cluster",
    "errors",
    "__version__",
]
