"""The members `Reducer` had before the job's part moved to `kmirror.reducers.Job`: still there,
with a DeprecationWarning.

`Reducer.num_processes`, `process_index`, `is_chief`, `broadcast`, `gather_counts`,
`agree_on_seed` and `failures` are now `reducer.job.<name>`. Reading one from a reducer warns and
answers from its job. A subclass that still overrides one is warned once, when it is defined, and
its override keeps being used: its job calls it (`honouring_overrides`).
"""

from __future__ import annotations

import warnings

from kmirror.reducers.job import Job

__all__ = ["FORMER", "FormerMembers", "honouring_overrides"]

FORMER = (
    "num_processes",
    "process_index",
    "is_chief",
    "broadcast",
    "gather_counts",
    "agree_on_seed",
    "failures",
)


def _moved(name: str) -> str:
    return (
        f"Reducer.{name} moved to the reducer's job: use reducer.job.{name} "
        "(kmirror.reducers.Job); the old name will be removed."
    )


class FormerMembers:
    """The former members, each answering from the reducer's own job with a warning."""

    def _own_job(self) -> Job:
        raise NotImplementedError

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        overridden = [name for name in FORMER if name in vars(cls)]
        if overridden:
            warnings.warn(
                f"{cls.__name__} overrides {', '.join(overridden)}, which moved from "
                "kmirror.reducers.Reducer to kmirror.reducers.Job; override the reducer's "
                "make_job() to return a Job subclass instead. The overrides are still used.",
                DeprecationWarning,
                stacklevel=2,
            )

    @property
    def num_processes(self) -> int:
        warnings.warn(_moved("num_processes"), DeprecationWarning, stacklevel=2)
        return self._own_job().num_processes

    @property
    def process_index(self) -> int:
        warnings.warn(_moved("process_index"), DeprecationWarning, stacklevel=2)
        return self._own_job().process_index

    @property
    def is_chief(self) -> bool:
        warnings.warn(_moved("is_chief"), DeprecationWarning, stacklevel=2)
        return self._own_job().is_chief

    def broadcast(self, variables: list) -> None:
        warnings.warn(_moved("broadcast"), DeprecationWarning, stacklevel=2)
        return self._own_job().broadcast(variables)

    def gather_counts(self, count: int) -> list[int]:
        warnings.warn(_moved("gather_counts"), DeprecationWarning, stacklevel=2)
        return self._own_job().gather_counts(count)

    def agree_on_seed(self) -> None:
        warnings.warn(_moved("agree_on_seed"), DeprecationWarning, stacklevel=2)
        return self._own_job().agree_on_seed()

    def failures(self):
        warnings.warn(_moved("failures"), DeprecationWarning, stacklevel=2)
        return self._own_job().failures()


def honouring_overrides(reducer: FormerMembers, job: Job) -> Job:
    """`job`, or, where `reducer`'s class still overrides former members, a job that calls those
    overrides and `job` for the rest."""
    kind = type(reducer)
    overridden = {n for n in FORMER if getattr(kind, n) is not getattr(FormerMembers, n)}
    return _Overridden(reducer, job, overridden) if overridden else job


class _Overridden(Job):
    def __init__(self, reducer: FormerMembers, job: Job, overridden: set[str]) -> None:
        self._reducer, self._job, self._overridden = reducer, job, overridden

    def _source(self, name: str):
        return self._reducer if name in self._overridden else self._job

    @property
    def num_processes(self) -> int:
        return self._source("num_processes").num_processes

    @property
    def process_index(self) -> int:
        return self._source("process_index").process_index

    @property
    def is_chief(self) -> bool:
        if "is_chief" in self._overridden:
            return self._reducer.is_chief
        return self.process_index == 0

    def broadcast(self, variables: list) -> None:
        return self._source("broadcast").broadcast(variables)

    def gather_counts(self, count: int) -> list[int]:
        return self._source("gather_counts").gather_counts(count)

    def agree_on_seed(self) -> None:
        return self._source("agree_on_seed").agree_on_seed()

    def failures(self):
        return self._source("failures").failures()
