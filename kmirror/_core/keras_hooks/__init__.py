"""Where kmirror reaches into Keras: the places that decide what a replica's part of a step is.

A replica computes its rows of the global batch. For its part to add up to the single-device step,
four things Keras decides per call must be decided over the GLOBAL batch instead:

- loss normalisers: a loss' divisor (row count, sum of sample weights, unmasked entries) is the
  global one, and Keras' own division by the replica count is undone;
- BatchNormalization: batch statistics are those of the global batch;
- random draws: a replica takes its rows of the draw one device would make for the whole batch;
- the optimizer: every replica applies the summed gradient to its own copy of the variables
  (Keras' TensorFlow optimizer would sum the gradients again, inside `tf.distribute`).

Keras exposes none of these as public API, so `replica` replaces a few functions of `keras.src`
while a kmirror replica runs (elsewhere they behave exactly as Keras' own), and `optimizers` makes
the optimizers kmirror trains apply as on one device. The package also holds every other use of
Keras internals, so that it is the only place that touches them: `storage` (the `tf.Variable`
behind a Keras variable, which kmirror mirrors in place), `writes` (which variables a replica's
step assigns, a model's seed generators and moving statistics), `model_state` (a model's compile
arguments, compiled loss and metrics, saving cache, the epoch a restored `fit` starts at),
`symbolic` (a model and its compiled loss and metrics built from a batch's specs), `overrides` (the
private methods Keras calls on a model and on its checkpoint and TensorBoard callbacks, routed to
kmirror's methods) and `reading` (the order in which Keras' array adapter draws rows, its class
weights and validation split, what its PyDataset adapter makes of a batch, the data adapter of a
distributed dataset, the passes Keras begins over a dataset) and `calls` (a model's own step
computes as one device, its layer calls on a replica's rows). A Keras upgrade checks this package.
Checked on Keras 3.15.1 with TensorFlow 2.21.0 (`make test`) and on Keras 3.12.4 with TensorFlow
2.19.1 (`make test-compat`).
"""

from kmirror import versions

versions.check()  # before the internals this package touches

from kmirror._core.keras_hooks.call_state import settle  # noqa: E402
from kmirror._core.keras_hooks.calls import replica, splitting  # noqa: E402
from kmirror._core.keras_hooks.explaining import Explanation  # noqa: E402
from kmirror._core.keras_hooks.explaining import recording as explaining  # noqa: E402
from kmirror._core.keras_hooks.model_state import (  # noqa: E402
    calls_with_training,
    compile_arguments,
    compile_call,
    compiled_loss,
    compiled_metric_list,
    compiled_metrics,
    from_adding_metric_module,
    keep_saving_cache,
    keras_model_name,
    loss_tracker,
    masks_of,
    metric_function,
    per_row_keras_function,
    print_msg,
    resolve_auto_jit_compile,
    resume_at_epoch,
    resumed_epoch,
    rowwise_step,
    with_masks,
)
from kmirror._core.keras_hooks.optimizers import (  # noqa: E402
    accumulation,
    building,
    reindex,
    release,
    train_locally,
)
from kmirror._core.keras_hooks.overrides import (  # noqa: E402
    CheckpointOverrides,
    ModelOverrides,
    TensorBoardOverrides,
    checkpoints_written_by,
    methods_replaced,
    saves_as_keras,
    train_writer,
)
from kmirror._core.keras_hooks.own_thread import (  # noqa: E402
    OwnStep,
    current_step,
    in_function,
    inside_layer_call,
)
from kmirror._core.keras_hooks.provenance import Provenance  # noqa: E402
from kmirror._core.keras_hooks.reading import (  # noqa: E402
    batch_order,
    batches_spec,
    class_weighted,
    distributed_input,
    first_batch,
    passes_begun_before,
    py_dataset_batches,
    resumed_input,
    validation_split,
)
from kmirror._core.keras_hooks.replica import (  # noqa: E402
    compute_loss,
    current,
    install,
)
from kmirror._core.keras_hooks.rows import Rows  # noqa: E402
from kmirror._core.keras_hooks.storage import forget_traces, storage, store  # noqa: E402
from kmirror._core.keras_hooks.symbolic import (  # noqa: E402
    build_compiled,
    symbolic_build,
    symbolic_evaluation,
)
from kmirror._core.keras_hooks.writes import moving_statistics, recording, seed_states  # noqa: E402
from kmirror._core.tf_hooks import never_converted  # noqa: E402

never_converted(__name__)  # the functions this package puts in Keras' place

__all__ = [
    "ModelOverrides",
    "CheckpointOverrides",
    "TensorBoardOverrides",
    "checkpoints_written_by",
    "methods_replaced",
    "saves_as_keras",
    "train_writer",
    "Rows",
    "Explanation",
    "explaining",
    "OwnStep",
    "Provenance",
    "splitting",
    "current_step",
    "in_function",
    "inside_layer_call",
    "settle",
    "current",
    "replica",
    "install",
    "compute_loss",
    "batch_order",
    "batches_spec",
    "class_weighted",
    "distributed_input",
    "first_batch",
    "passes_begun_before",
    "py_dataset_batches",
    "validation_split",
    "resumed_input",
    "accumulation",
    "building",
    "train_locally",
    "release",
    "reindex",
    "storage",
    "store",
    "forget_traces",
    "recording",
    "seed_states",
    "moving_statistics",
    "calls_with_training",
    "compile_arguments",
    "compile_call",
    "compiled_loss",
    "compiled_metric_list",
    "compiled_metrics",
    "from_adding_metric_module",
    "keep_saving_cache",
    "loss_tracker",
    "masks_of",
    "metric_function",
    "keras_model_name",
    "per_row_keras_function",
    "rowwise_step",
    "print_msg",
    "resolve_auto_jit_compile",
    "resume_at_epoch",
    "resumed_epoch",
    "symbolic_build",
    "build_compiled",
    "symbolic_evaluation",
    "with_masks",
]
