"""What a traced step does where: which layer calls run on each replica's rows, which run on the
whole batch and why, and which reductions over the rows became sums over the replicas.

`recording()` collects it while a step is traced (`MirroredModel.explain`); outside it nothing is
kept. Every replica traces the same step, each on its own thread: the report is the first
replica's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = [
    "Explanation",
    "recording",
    "split",
    "mapped",
    "mapped_whole",
    "whole",
    "summed",
    "attempt",
    "unrecorded",
]


@dataclass
class Explanation:
    """What one replica's traced step does where (`MirroredModel.explain`).

    Attributes:
        split: the layer calls computed on each replica's rows of the batch, as
            `"name (Class)"`, in the order they ran (a call inside them is theirs), and the
            functions an own step maps over them, as `"function (tf.vectorized_map)"`.
        whole: `(layer, why)` for each call computed on the whole batch by every replica (and
            each mapped function run over every row, as `"function (tf.vectorized_map)"`).
        sums: the reductions over the rows made sums over the replicas, by the layer whose
            call made them (`{"name (Class)": count}`): each is one collective per step
            (BatchNormalization makes two per call in training: the mean and the variance).
    """

    split: list = field(default_factory=list)
    whole: list = field(default_factory=list)
    sums: dict = field(default_factory=dict)

    @property
    def collectives(self) -> int:
        """The sums over the replicas the step's layers make, per step (the gradients' own
        reduction not counted)."""
        return sum(self.sums.values())

    def __str__(self) -> str:
        lines = [f"calls on each replica's rows: {len(self.split)}"]
        lines += [f"  {name}" for name in self.split]
        lines.append(f"calls on the whole batch, on every replica: {len(self.whole)}")
        lines += [f"  {name}: {why}" for name, why in self.whole]
        lines.append(f"sums over the replicas per step: {self.collectives}")
        lines += [f"  {name}: {count}" for name, count in self.sums.items()]
        return "\n".join(lines)


_lock = threading.Lock()
_state: dict = {}  # "threads": thread id -> its Explanation, in the order they first recorded


@contextlib.contextmanager
def recording() -> Iterator[Explanation]:
    """Within this block the calls traced are recorded; the first replica's are given."""
    explanation = Explanation()
    with _lock:
        _state["threads"] = {}
    try:
        yield explanation
    finally:
        with _lock:
            threads = _state.pop("threads")
        first = next(iter(threads.values()), Explanation())
        explanation.split, explanation.whole, explanation.sums = (
            first.split,
            first.whole,
            first.sums,
        )


def _mine() -> Explanation | None:
    with _lock:
        threads = _state.get("threads")
        if threads is None:
            return None
        return threads.setdefault(threading.get_ident(), Explanation())


def _named(layer) -> str:
    return f"{layer.name} ({type(layer).__name__})"


def split(layer) -> None:
    """`layer`'s call runs on the replica's rows."""
    if (mine := _mine()) is not None:
        mine.split.append(_named(layer))


def mapped(function: str) -> None:
    """A function the step maps over the batch's rows (`tf.vectorized_map`) runs on the
    replica's rows."""
    if (mine := _mine()) is not None:
        mine.split.append(f"{function} (tf.vectorized_map)")


def mapped_whole(function: str, why: str) -> None:
    """A function the step maps over the batch's rows runs on every row on every replica."""
    if (mine := _mine()) is not None:
        mine.whole.append((f"{function} (tf.vectorized_map)", why))


def whole(layer, why: str) -> None:
    """`layer`'s call runs on the whole batch on every replica, because of `why`."""
    if (mine := _mine()) is not None:
        mine.whole.append((_named(layer), why))


def summed(layer) -> None:
    """A reduction in `layer`'s call became a sum over the replicas."""
    if (mine := _mine()) is not None:
        name = _named(layer)
        mine.sums[name] = mine.sums.get(name, 0) + 1


@contextlib.contextmanager
def attempt() -> Iterator[None]:
    """A call tried on the replica's rows: what it recorded is dropped where it raises (it runs
    again on the whole batch, and the graph of the attempt is left unused)."""
    with _kept_back(always=False):
        yield


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """What is traced within this block is not the step's (a function traced to be looked at,
    never run): nothing it records is kept."""
    with _kept_back(always=True):
        yield


@contextlib.contextmanager
def _kept_back(always: bool) -> Iterator[None]:
    """What the block records is dropped when it ends (`always`) or where it raises."""
    mine = _mine()
    before = None if mine is None else (len(mine.split), len(mine.whole), dict(mine.sums))
    try:
        yield
    except BaseException:
        _restore(mine, before)
        raise
    if always:
        _restore(mine, before)


def _restore(mine: Explanation | None, before: tuple | None) -> None:
    if mine is not None:
        del mine.split[before[0] :], mine.whole[before[1] :]
        mine.sums = before[2]
