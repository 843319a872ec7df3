"""Starting the N processes of a job: for the horovod reducer, for users, notebooks and tests.

    python -m kmirror.launch -n 2 train.py --epochs 3      # or: kmirror-launch -n 2 train.py ...
    python -m kmirror.launch --workers 2 train.py          # multi-worker: TF_CONFIG, reducer="ring"
    python -m kmirror.launch -n 2 --max-restarts 3 train.py   # started again when a process fails
    python -m kmirror.launch --hosts node1:2,node2:2 train.py  # on several hosts (launching.hosts)

starts `train.py` twice with what the processes need to form a job: for Horovod a rendezvous
server on loopback and ranks in the environment; for multi-worker training (`--workers N`, or
`--mode ring`) a `TF_CONFIG` per worker naming free loopback ports. It streams every line of their
output prefixed with its rank, stops the others as soon as one fails, and exits with the worst
exit code; with `--max-restarts K` it then starts the whole job again, up to K times, leaving out
the hosts that cannot be reached if `--min-np` allows fewer processes. With `--hosts` a Horovod
job is handed to `horovodrun -H`, and a ring job starts its workers on their hosts
(docs/cluster.md). A `SIGTERM` to the launcher is passed on to every process
(`_core.callbacks.preemption`), and the job is not started again. `run(fn, n=2)` does the
same for a Python function and returns each rank's result. Every launch can be bounded by a
timeout, after which all processes are killed.

Example:

```python
import kmirror

def rank_and_size():
    import horovod.tensorflow as hvd
    hvd.init()
    return hvd.rank(), hvd.size()

print(kmirror.launch.run(rank_and_size, n=2, timeout=120))   # [(0, 2), (1, 2)]
```
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from kmirror._core.launching import hosts as hosts_lib
from kmirror._core.launching import supervisor

__all__ = ["launch", "run", "main"]

MODES = ("horovod", "ring")


def launch(
    command: Sequence[str],
    n: int | None = None,
    *,
    mode: str = "horovod",
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    output: TextIO | None = None,
    port: int | None = None,
    max_restarts: int = 0,
    hosts: str | None = None,
    min_np: int | None = None,
) -> int:
    """Runs `command` in `n` processes that form one job; returns the worst exit code, e.g.
    `kmirror.launch.launch([sys.executable, "train.py"], n=2, timeout=600)`.

    Args:
        command: the program and its arguments, e.g. `[sys.executable, "train.py"]`.
        n: how many processes (ranks); default 2, or every slot of `hosts`.
        mode: "horovod" (a Horovod job over Gloo on loopback) or "ring" (TensorFlow workers,
            each with a `TF_CONFIG`; the script calls `kmirror.cluster.connect()`).
        timeout: seconds after which every process is killed (None: no limit).
        env: extra environment variables for every process.
        output: where the prefixed output goes (default: standard output).
        port: the port of Horovod's rendezvous server, or of the first worker (the others take
            the next ones); default: free ports chosen now. A port in use is an error.
        max_restarts: when a process fails, the whole job is stopped and started again, up to
            this many times (with `kmirror.callbacks.BackupAndRestore` it resumes from the
            newest backup). The timeout bounds all the attempts together.
        hosts: where the processes run, `"host1:2,host2:2"` (default: this machine).
        min_np: with `hosts`, a restart leaves out the hosts `ssh` cannot reach, as long as this
            many processes remain (default `n`: all of them).

    Returns:
        0 if every process succeeded; else the exit code of the first that failed in the last
        attempt (a process killed by signal S counts as 128 + S), or 124 on timeout.
    """
    placed = hosts_lib.parse(hosts) if hosts is not None else None
    n = n if n is not None else sum(s for _, s in placed) if placed else 2
    _check(n, mode)
    min_np = n if min_np is None else min_np
    for name, value, low in (("max_restarts", max_restarts, 0), ("min_np", min_np, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value:
            raise ValueError(f"{name} must be a whole number >= {low}; got {value!r}.")
    if placed is not None:
        hosts_lib.placement(placed, n)  # the processes fit
        if port is not None and mode == "horovod":
            raise ValueError("--port is for jobs on this machine: horovodrun picks its own.")
    output = output or sys.stdout
    deadline = None if timeout is None else time.monotonic() + timeout
    with supervisor.passing_sigterm_on():
        for attempt in range(max_restarts + 1):
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            code = hosts_lib.start(list(command), n, mode, left, env, output, port, placed)
            if code in (0, 124) or attempt == max_restarts or supervisor.terminated.is_set():
                return code
            if placed is not None:
                placed, n = hosts_lib.still_reachable(placed, n, min_np, output)
                if placed is None:
                    return code
            supervisor.say(
                output,
                f"the job failed with exit code {code}; starting it again with {n} processes "
                f"(restart {attempt + 1} of {max_restarts})",
            )
    return code


def run(
    fn: Callable[..., Any],
    n: int = 2,
    *,
    mode: str = "horovod",
    timeout: float | None = 600,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    simulate: int | None = None,
) -> list[Any]:
    """Calls `fn(*args, **kwargs)` in `n` processes that form one job; returns each rank's result.

    For notebooks and tests. `fn` and its results travel by cloudpickle; `fn` runs in a fresh
    process, so it must import what it uses. In "ring" mode the process has already joined its
    cluster (`kmirror.cluster.connect()`) when `fn` starts; pass `simulate=n` to give each process
    n simulated CPU devices first.

    Example:

    ```python
    def train():
        import kmirror, keras
        model = kmirror.wrap(build_model(), reducer="horovod")
        model.fit(x, y, batch_size=64, epochs=2, verbose=0)
        return model.get_weights()

    weights_per_rank = kmirror.launch.run(train, n=2)
    ```

    Raises:
        RuntimeError: if a process failed or the timeout passed (their output is shown above).
    """
    import cloudpickle

    with tempfile.TemporaryDirectory(prefix="kmirror-run-") as folder:
        call = Path(folder, "call.pkl")
        call.write_bytes(cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))))
        command = [sys.executable, "-m", "kmirror.launch", "--call", str(call), "--mode", mode]
        if simulate:
            command += ["--simulate", str(simulate)]
        code = launch(command, n, mode=mode, timeout=timeout, env=env)
        if code != 0:
            reason = "timed out" if code == 124 else f"failed with exit code {code}"
            raise RuntimeError(
                f"kmirror.launch.run: the job of {n} processes {reason}; its output is above."
            )
        return [pickle.loads(Path(folder, f"result-{rank}.pkl").read_bytes()) for rank in range(n)]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kmirror.launch -n N [--timeout S] script.py [args...]`."""
    parser = argparse.ArgumentParser(
        prog="python -m kmirror.launch",
        description="Start N processes that train together (one per device).",
    )
    parser.add_argument("-n", "--np", dest="n", type=int, help="how many processes")
    parser.add_argument("--workers", type=int, help="how many multi-worker processes (--mode ring)")
    parser.add_argument("--mode", choices=MODES, default=None, help="default: horovod")
    parser.add_argument("--timeout", type=float, default=None, help="seconds; then kill all")
    parser.add_argument(
        "--port", type=int, default=None, help="rendezvous / first worker port (default: free)"
    )
    parser.add_argument("--max-restarts", type=int, default=0, help="restarts after a failure")
    parser.add_argument("-H", "--hosts", help="host1:2,host2:2 (default: this machine)")
    parser.add_argument(
        "--min-np", type=int, help="a restart leaves out unreachable hosts down to this many"
    )
    parser.add_argument("--call", help=argparse.SUPPRESS)
    parser.add_argument("--simulate", type=int, help=argparse.SUPPRESS)
    parser.add_argument("program", nargs=argparse.REMAINDER, help="script.py [args...]")
    options = parser.parse_args(argv)
    if options.call:
        return _call(Path(options.call), options.mode, options.simulate)
    if options.workers is not None:
        if options.n is not None or options.mode == "horovod":
            parser.error(
                "--workers N starts multi-worker processes; do not combine it with -n / "
                "--mode horovod"
            )
        options.n, options.mode = options.workers, "ring"
    if options.n is None and options.hosts is None:
        parser.error("give the number of processes with -n N (or --workers N, or --hosts)")
    if not options.program:
        parser.error("give the script to run, e.g. python -m kmirror.launch -n 2 train.py")
    program = list(options.program)
    command = [sys.executable, *program] if program[0].endswith(".py") else program
    try:
        return launch(
            command,
            options.n,
            mode=options.mode or "horovod",
            timeout=options.timeout,
            port=options.port,
            max_restarts=options.max_restarts,
            hosts=options.hosts,
            min_np=options.min_np,
        )
    except (ValueError, OSError) as error:
        parser.error(str(error))


# -- the job's environment ------------------------------------------------------------------------
def _check(n: int, mode: str) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"the number of processes must be a whole number >= 1; got {n!r}.")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}.")


# -- the child side of run() --------------------------------------------------------------------
def _call(call: Path, mode: str | None, simulate: int | None) -> int:
    import cloudpickle

    from kmirror import cluster

    if simulate:
        from kmirror import devices

        devices.simulate(simulate)
    if mode == "ring":
        cluster.connect()
    fn, args, kwargs = pickle.loads(call.read_bytes())
    result = fn(*args, **kwargs)
    call.with_name(f"result-{cluster.process()[0]}.pkl").write_bytes(cloudpickle.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
