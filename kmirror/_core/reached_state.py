"""The state a traced step writes that kmirror did not mirror: found in the step's graph as it is
traced, mirrored, and the step traced again before it ever runs.

kmirror mirrors the state it finds on the model (`mirroring.state`): its layers' variables, its
optimizers' (and those an optimizer holds), its metrics', the variables it holds. A program may
keep state elsewhere: a seed generator on an object that is not a layer, raw `tf.Variable`s an
optimizer tracks, a module's variable. Written by every replica, such a variable would be
written once per replica (a seed generator advancing, and drawing anew, for each), where one
device writes it once. So while one of kmirror's replicas is traced, every op writing a variable
is checked as it is made (`tf_hooks.graphs.watch_ops`): one whose variable the step captured from
outside and is not a copy of a distributed variable is recorded (`_written`). When the step's
trace returns (`check`, on the thread that traced it), `Unmirrored` is raised, before anything
ran; `retrying` then mirrors those variables (`Mirror.adopt_written`) and calls the step again,
which traces it again. This holds for a process of one replica too, so that every process
takes the chief's value of what was found, and a backup holds it: on a ring worker of one device
its variables are distributed all the same; on a strategy whose are not (a Horovod rank's
`OneDeviceStrategy`), a variable kmirror mirrors is one made in the reducer's scope
(`reducers.scoped.made_in_scope`), and a write to any other is recorded. An eager step makes no
graph: before it first runs on several replicas it is traced once for this look alone, never run
(`looked_at`).

No weights file holds such state, so `Kept` holds what was mirrored, in the order found: a
backup writes its values, and a relaunch gives them back to it as its steps find it again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from kmirror._core import python_draws, replicas
from kmirror._core.tf_hooks import graphs
from kmirror.reducers import scoped

__all__ = ["Unmirrored", "Kept", "install", "check", "looked_at", "retrying"]

_lock = threading.Lock()
_written: dict = {}  # id(handle) -> the handle of each unmirrored variable a replica wrote
_installed: list = []


class Unmirrored(Exception):
    """A traced step writes variables kmirror did not mirror (their handles)."""

    def __init__(self, handles: list) -> None:
        super().__init__(f"{len(handles)} variable(s) written by the step are not mirrored")
        self.handles = handles


def install() -> None:
    """Checks every variable write made while one of kmirror's replicas is traced."""
    with _lock:
        if not _installed:
            graphs.watch_ops(_check_op)
            _installed.append(True)


def _check_op(op_type: str, inputs, attrs) -> None:
    if not inputs or not graphs.variable_write(op_type) or not replicas.in_replica():
        return
    handle = graphs.captured_handle(inputs[0])
    if handle is None:
        return
    if replicas.distributes_variables():
        mirrored = graphs.distributed(handle)
    else:  # every variable is plain: kmirror's are those made in its scope
        mirrored = scoped.made_in_scope(handle)
    if not mirrored:
        with _lock:
            _written[id(handle)] = handle


def check() -> None:
    """Raises `Unmirrored` if the replicas traced since the last check wrote variables kmirror
    did not mirror."""
    handles = _taken()
    if handles and not tf.executing_eagerly():
        raise Unmirrored(handles)


def _taken() -> list:
    with _lock:
        handles = list(_written.values())
        _written.clear()
    return handles


def looked_at(step: Callable, data, adopt: Callable[[list], None]) -> bool:
    """Before an eager step (`run_eagerly=True`) first runs on several replicas of this process:
    an eager step makes no graph whose ops could be checked, so `step` is traced once on `data`,
    never run, and what that trace writes unmirrored is mirrored (`adopt`), traced again until
    nothing is found. Returns False where the step cannot be traced (it reads a tensor's value in
    Python): its writes are then not looked at."""
    adopted = set()
    step = tf.autograph.experimental.do_not_convert(step)  # as Keras runs its steps
    while True:
        try:
            with python_draws.unchanged():  # looked at, never run
                tf.function(step, autograph=False).get_concrete_function(data)
        except Exception:  # noqa: BLE001 - any failure to trace: the eager step runs as it is
            _taken()
            return False
        handles = _taken()
        if not handles:
            return True
        if adopted & {id(h) for h in handles}:
            raise RuntimeError("kmirror: a variable it mirrored is written unmirrored")
        adopted |= {id(h) for h in handles}
        adopt(handles)


def retrying(function: Callable, adopt: Callable[[list], None]) -> Callable:
    """`function` (a step function Keras or kmirror calls with its batches) that, where its trace
    finds unmirrored variables it writes, has `adopt` mirror them and calls it again (the same
    batches: nothing ran)."""

    def call(*args, **kwargs):
        adopted = set()
        while True:
            drawn = python_draws.states()
            try:
                return function(*args, **kwargs)
            except python_draws.TracedAgain:
                continue  # from where its first trace left Python's and NumPy's generators
            except Unmirrored as found:
                python_draws.restore(drawn)  # traced again: what it drew is drawn again
                if adopted & {id(h) for h in found.handles}:
                    message = "kmirror: a variable it mirrored is written unmirrored"
                    raise RuntimeError(message) from None
                adopted |= {id(h) for h in found.handles}
                adopt(found.handles)

    return call


class Kept:
    """The state a model's steps reached, mirrored (`Mirror.adopt_written`), in the order found;
    and a backup's values of it, given to each as a relaunched step finds it again."""

    def __init__(self) -> None:
        self._found: list = []
        self._pending: list[np.ndarray] = []

    def variables(self) -> list:
        return list(self._found)

    def values(self) -> list[np.ndarray]:
        return [np.asarray(v.numpy()) for v in self._found]

    def found(self, variables: list) -> None:
        """`variables` were mirrored now: each takes the backup's value at its place, if any."""
        for variable in variables:
            self._found.append(variable)
            place = len(self._found) - 1
            if place < len(self._pending):
                _assign(variable, self._pending[place], place)

    def restore(self, values: list[np.ndarray]) -> None:
        """A backup's values: given now to the state found already, the rest as it is found."""
        self._pending = list(values)
        for place, variable in enumerate(self._found[: len(values)]):
            _assign(variable, values[place], place)


def _assign(variable, value: np.ndarray, place: int) -> None:
    dtype = np.dtype(tf.as_dtype(variable.dtype).as_numpy_dtype)
    if tuple(variable.shape) != value.shape or dtype != value.dtype:
        raise ValueError(
            f"kmirror.callbacks.BackupAndRestore: the backup holds state the step reaches "
            f"(number {place + 1}, {value.dtype}{list(value.shape)}) that this program's step "
            f"holds as {dtype}{list(variable.shape)}: the backup was written by another "
            "program. Delete the backup folder to train from the start."
        )
    variable.assign(value)
