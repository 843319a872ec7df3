"""Imported first by the tests' job scripts, before Keras: Keras imports scikit-learn, pandas and
matplotlib whenever they are installed (for its scikit-learn wrappers, DataFrame inputs and image
galleries; each import guarded by `except ImportError`), and no job uses them. Marked absent,
they cost no job process its import: importing Keras takes 4.5 s of CPU here instead of 6.5
(Keras 3.15.1, TensorFlow 2.21.0). A script that needs one of them (MLflow needs pandas) does
not import this module."""

import sys

if "keras" in sys.modules:
    raise RuntimeError("import lean_start before Keras: Keras has imported what it marks absent")
for _name in ("sklearn", "pandas", "matplotlib"):
    sys.modules.setdefault(_name, None)
