"""Running a job of several processes for a test: its command under a timeout, its success
checked (its output shown when it failed), and what each rank wrote read back."""

import contextlib
import os
import pickle
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent
JOB_NICENESS = 10


def run(command: list[str], timeout: float, env=None) -> subprocess.CompletedProcess:
    """Runs `command` from the repository's folder with `env` added, within `timeout` seconds.

    The job runs in a session of its own: a signal its processes send to their process group
    (Ray's, a launcher's) never reaches the test run, and at the timeout every process the job
    started is killed, not its first one alone."""
    job = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    # Below the test processes' priority (every process it starts inherits it): a job runs beside
    # the other test process, whose replicas hand their thread over to each other at every
    # collective and would otherwise wait for a core behind the job's processes at each handover.
    os.setpriority(os.PRIO_PGRP, job.pid, JOB_NICENESS)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # what the job left running
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


def rank_results(folder: Path, ranks: int, prefix: str = "rank") -> list:
    """What each rank pickled into `folder`/<prefix><rank>.pkl, in rank order."""
    return [pickle.loads(Path(folder, f"{prefix}{r}.pkl").read_bytes()) for r in range(ranks)]


def results(
    command: list[str], folder: Path, ranks: int, timeout: float, env=None, prefix: str = "rank"
) -> list:
    """Runs the job, asserts it succeeded, and returns each rank's results."""
    done = run(command, timeout, env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return rank_results(folder, ranks, prefix)
