"""Watching the processes of a local job: their output streamed with a rank prefix, the others
stopped as soon as one fails, everything killed at the timeout; the job's exit code is the worst.

A process's `TF_CPP_MIN_LOG_LEVEL` is applied to its output: TensorFlow 2.21 writes
its start-up lines (`cudart_stub`, `oneDNN custom operations`, `cuInit`) through Abseil before
reading the variable, so every process printed them whatever it asked for. The stream drops
Abseil's log lines below the level asked (`I`nfo below 1, `W`arning below 2, `E`rror below 3),
and Abseil's note that such lines go to standard error (a warning).

Example:

```python
code = supervisor.run([[sys.executable, "train.py"]] * 2, environments, timeout=600,
                      output=sys.stdout)
```
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from typing import TextIO

__all__ = ["run", "stream", "shown", "supervise", "say", "passing_sigterm_on", "GRACE_SECONDS"]
__all__ += ["EXIT_PREEMPTED"]

#: Seconds the other processes get to exit after one failed, before they are killed.
GRACE_SECONDS = 10.0

#: The exit code of a process stopped by `SIGTERM` after its job's backup
#: (`_core.callbacks.preemption`): the others are on their way out too, and are not signalled.
EXIT_PREEMPTED = 75

#: An Abseil log line: its severity (I, W, E or F), then the time, the thread and the source line.
_ABSL_LINE = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^ :]+:\d+\] ")
_ABSL_NOTE = "WARNING: All log messages before absl::InitializeLog() is called are written to"
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}

#: Set when the launcher received SIGTERM (`passing_sigterm_on`): the job is not started again.
terminated = threading.Event()


def run(commands: list, environments: list, timeout, output: TextIO) -> int:
    """Starts a process per command (each in its environment, its own session), streams their
    output and supervises them until they end; returns the job's exit code."""
    processes = [
        subprocess.Popen(
            command,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        for command, environment in zip(commands, environments)
    ]
    lock = threading.Lock()
    streams = [
        threading.Thread(
            target=stream,
            args=(p, f"[{rank}] ", output, lock, _log_level(environment)),
            daemon=True,
        )
        for rank, (p, environment) in enumerate(zip(processes, environments))
    ]
    for thread in streams:
        thread.start()
    try:
        code = supervise(processes, timeout, output, lock)
    finally:  # Ctrl-C too: no process outlives the launcher
        _stop(processes, grace=2.0)
    for thread in streams:
        thread.join(timeout=5)
    return code


def _log_level(environment) -> int:
    """The `TF_CPP_MIN_LOG_LEVEL` a process was started with (0: every line)."""
    value = (environment if environment is not None else os.environ).get("TF_CPP_MIN_LOG_LEVEL")
    return int(value) if value and value.isdigit() else 0


def shown(line: str, level: int) -> bool:
    """Whether `line` of a process asking for TensorFlow's log level `level` is shown."""
    if level >= 2 and line.startswith(_ABSL_NOTE):
        return False
    found = _ABSL_LINE.match(line)
    return found is None or _SEVERITY[found.group(1)] >= level


def stream(
    process: subprocess.Popen, prefix: str, output: TextIO, lock: threading.Lock, level: int = 0
) -> None:
    for line in process.stdout:
        if not shown(line, level):
            continue
        with lock:
            output.write(prefix + line)
            output.flush()


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def supervise(processes, timeout, output, lock) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    failed, stop_at, forwarded = None, None, False
    while True:
        codes = [p.poll() for p in processes]
        if failed is None:
            failed = next(((rank, c) for rank, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None and any(c is None for c in codes):
                # Preempted processes all stop at the same step: the others follow by themselves.
                preempted = failed[1] == EXIT_PREEMPTED
                stop_at = time.monotonic() + (GRACE_SECONDS if preempted else 0.0)
                ending = "waiting for the others" if preempted else "stopping the other ranks"
                code = _exit_code(failed[1])
                say(output, f"rank {failed[0]} exited with code {code}; {ending}", lock)
        if stop_at is not None and time.monotonic() >= stop_at:
            _stop(processes)
            stop_at = None
        if terminated.is_set() and not forwarded:
            say(output, "SIGTERM: passing it on to every process", lock)
            _signal(processes, signal.SIGTERM)
            forwarded = True
        if all(c is not None for c in codes):
            return _exit_code(failed[1]) if failed else 0
        if deadline is not None and time.monotonic() > deadline:
            say(output, f"timeout: the job ran longer than {timeout:g} s; killing it", lock)
            _stop(processes, grace=0)
            return 124
        time.sleep(0.05)


def _stop(processes, grace: float = GRACE_SECONDS) -> None:
    """SIGTERM to every running process group, then SIGKILL to those still there after `grace`."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        running = _signal(processes, sig)
        end = time.monotonic() + wait
        while time.monotonic() < end and any(p.poll() is None for p in running):
            time.sleep(0.05)


def _signal(processes, sig) -> list:
    """Sends `sig` to the process group of every running process; returns those."""
    running = [p for p in processes if p.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
    return running


@contextlib.contextmanager
def passing_sigterm_on():
    """Within (in the main thread): a SIGTERM to the launcher is passed on to every process of
    the job (`terminated` is set), which back up and exit if they train with a backup."""
    terminated.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def say(output: TextIO, message: str, lock: threading.Lock | None = None) -> None:
    """Prints the launcher's `message` to `output`."""
    with lock or contextlib.nullcontext():
        output.write(f"kmirror.launch: {message}\n")
        output.flush()
