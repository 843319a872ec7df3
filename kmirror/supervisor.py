"""Watching the processes of a local job: their output streamed with a rank prefix, the others
stopped as soon as one fails, everything killed at the timeout; the job's exit code is the worst.

Example:

```python
code = supervisor.run([[sys.executable, "train.py"]] * 2, environments, timeout=600,
                      output=sys.stdout)
```
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import TextIO

__all__ = ["run", "stream", "supervise", "GRACE_SECONDS"]

#: Seconds the other processes get to exit after one failed, before they are killed.
GRACE_SECONDS = 10.0


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
        threading.Thread(target=stream, args=(p, f"[{rank}] ", output, lock), daemon=True)
        for rank, p in enumerate(processes)
    ]
    for thread in streams:
        thread.start()
    code = supervise(processes, timeout, output, lock)
    for thread in streams:
        thread.join(timeout=5)
    return code


def stream(process: subprocess.Popen, prefix: str, output: TextIO, lock: threading.Lock) -> None:
    for line in process.stdout:
        with lock:
            output.write(prefix + line)
            output.flush()


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def supervise(processes, timeout, output, lock) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    failed = None
    while True:
        codes = [p.poll() for p in processes]
        if failed is None:
            failed = next(((rank, c) for rank, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None and any(c is None for c in codes):
                _say(
                    output,
                    lock,
                    f"rank {failed[0]} exited with code {_exit_code(failed[1])}; "
                    "stopping the other ranks",
                )
                _stop(processes)
        if all(c is not None for c in codes):
            return _exit_code(failed[1]) if failed else 0
        if deadline is not None and time.monotonic() > deadline:
            _say(output, lock, f"timeout: the job ran longer than {timeout:g} s; killing it")
            _stop(processes, grace=0)
            return 124
        time.sleep(0.05)


def _stop(processes, grace: float = GRACE_SECONDS) -> None:
    """SIGTERM to every running process group, then SIGKILL to those still there after `grace`."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        running = [p for p in processes if p.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        end = time.monotonic() + wait
        while time.monotonic() < end and any(p.poll() is None for p in running):
            time.sleep(0.05)


def _say(output: TextIO, lock: threading.Lock, message: str) -> None:
    with lock:
        output.write(f"kmirror.launch: {message}\n")
        output.flush()
