"""Preemption: `SIGTERM` to any process of a job stops every process at the same step, where the
chief backs up, and every process exits with `EXIT_PREEMPTED`; running the job again resumes there.

Clusters announce a preemption with `SIGTERM` and kill the process some seconds later (Kubernetes:
30 s by default; Slurm: `--signal`). During the `fit` of a wrapped model that has a
`kmirror.callbacks.BackupAndRestore`, kmirror catches the signal and notes it. In one process,
training stops before the next step. In a job of several processes, the processes tell each other
whether one of them was signalled (a count through the reducer's job) before a step, every
`KMIRROR_PREEMPTION_CHECK_SECONDS` of training (default 0.5; 0: before every step; the chief
measures how many steps that is and every process follows its count), so they all stop before the
same step, with the same weights. The chief writes a backup of that position, the others wait
until it is written, and every process prints where it stopped and exits with code 75
(`EXIT_PREEMPTED`, "temporary failure" in `sysexits.h`). No step is lost or trained twice: the
relaunch (on any number of processes) resumes at that step.

A signal noted after the last check (the last steps took less than the check interval, or it came
during the last validation) is found when training ends: the processes ask each other once more,
and then, instead of removing the backup, the chief backs up the end of training, and every
process exits with `EXIT_PREEMPTED` as `fit` would have returned. The relaunch resumes at the end,
trains no batch, and runs the script's code after `fit` (saving the model, say): nothing is lost
and nothing trained twice. kmirror exits rather than run that code within the notice, because the
scheduler kills the process some seconds after its `SIGTERM` anyway, possibly halfway through a
file. A signal outside `fit` (during `evaluate`, `predict`, or between two `fit` calls) is left to
the script's handler: there is no training to back up.

The signal can only be caught in the main thread; a `fit` run in another thread leaves `SIGTERM`
as it is.

Example:

```python
backup = kmirror.callbacks.BackupAndRestore("/shared/backup", save_freq=100)
model.fit(x, y, epochs=20, callbacks=[backup])   # SIGTERM: backs up, exits with code 75
```
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import keras

from kmirror._core.callbacks.backup import BackupAndRestore
from kmirror._core.launching.supervisor import EXIT_PREEMPTED
from kmirror.reducers.job import Job

__all__ = ["EXIT_PREEMPTED", "Watch", "watch", "check_seconds"]

#: The most steps between two checks of a job of several processes.
_MOST_STEPS_BETWEEN_CHECKS = 1000


def check_seconds() -> float:
    """Seconds of training between two checks for a signalled process, from
    `KMIRROR_PREEMPTION_CHECK_SECONDS` (default 0.5)."""
    text = os.environ.get("KMIRROR_PREEMPTION_CHECK_SECONDS", "0.5")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(
            f"KMIRROR_PREEMPTION_CHECK_SECONDS must be a number of seconds >= 0; got {text!r}."
        )
    return seconds


def watch(callbacks, job: Job) -> Watch | None:
    """The watch for `fit`'s callbacks: None without a `BackupAndRestore` (nothing to resume)."""
    backup = next((c for c in callbacks or [] if isinstance(c, BackupAndRestore)), None)
    return None if backup is None else Watch(backup, job)


class Watch(keras.callbacks.Callback):
    """Notes `SIGTERM` while one `fit` runs (`catching`) and stops every process before the same
    step, after the chief's backup."""

    def __init__(self, backup: BackupAndRestore, job: Job) -> None:
        super().__init__()
        self._backup, self._job = backup, job
        self._signalled = self._stopping = False
        self._seconds = check_seconds()
        self._calls_left, self._every, self._checked_at = 1, 1, None

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        """Within: `SIGTERM` is noted instead of ending the process. After: the previous
        handler is back, and a signal noted but not acted on is delivered to it."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._note)
        # This watch decides, at the end of training, whether the backup is removed or kept.
        self._backup.end_decided_elsewhere = True
        try:
            yield
        finally:
            self._backup.end_decided_elsewhere = False
            signal.signal(signal.SIGTERM, previous)
            if self._signalled and not self._stopping:
                self._signalled = False
                signal.raise_signal(signal.SIGTERM)

    def _note(self, signum, frame) -> None:
        self._signalled = True

    def on_train_batch_begin(self, batch, logs=None):
        if not self._signalled_anywhere():
            return
        self._stopping = True  # later signals change nothing: the process is on its way out
        position = self._backup.back_up_now()
        self._exit(
            f"training stopped before batch {position.step + 1} of epoch {position.epoch + 1} "
            "on every process, backed up there",
            "to resume there",
        )

    def on_train_end(self, logs=None):
        self._backup.end_decided_elsewhere = False
        if self._stopping:
            return
        if not self._signalled_at_end():
            self._backup.remove()  # a normal end
            return
        self._stopping = True
        position = self._backup.back_up_end()
        self._exit(
            f"training ended (after epoch {position.epoch}) on every process, backed up at its end",
            "to resume there with no batch left and run the script after fit",
        )

    def _exit(self, what: str, relaunch: str) -> None:
        """Every process waits until the chief has written its backup, says so, and exits."""
        if self._job.num_processes > 1:
            self._job.gather_counts(0)
        where = f"in {self._backup.backup_dir}" if self._job.is_chief else "by the chief"
        print(
            f"kmirror: SIGTERM: {what} {where}; exiting with code {EXIT_PREEMPTED}. Run the job "
            f"again {relaunch}.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_PREEMPTED)

    def _signalled_at_end(self) -> bool:
        """Whether a process of the job was signalled during `fit`: asked of every process."""
        if self._job.num_processes == 1:
            return self._signalled
        return any(self._job.gather_counts(int(self._signalled)))

    def _signalled_anywhere(self) -> bool:
        """Whether a process of the job was signalled, asked every `_every` calls: the chief
        sends, with its answer, how many calls make `KMIRROR_PREEMPTION_CHECK_SECONDS`."""
        if self._job.num_processes == 1:
            return self._signalled
        self._calls_left -= 1
        if self._calls_left > 0:
            return False
        mine = int(self._signalled)
        now = time.monotonic()
        if self._job.is_chief and self._checked_at is not None and self._seconds > 0:
            per_call = max(now - self._checked_at, 1e-6) / self._every
            every = min(max(round(self._seconds / per_call), 1), _MOST_STEPS_BETWEEN_CHECKS)
            mine += 2 * (every - 1)
        answers = self._job.gather_counts(mine)
        self._every = self._calls_left = answers[0] // 2 + 1  # the chief's, process 0
        self._checked_at = now
        return any(answer % 2 for answer in answers)
