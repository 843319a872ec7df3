"""Starting N local processes: for the horovod reducer, for users, notebooks and tests.

    python -m kmirror.launch -n 2 train.py --epochs 3      # or: kmirror-launch -n 2 train.py ...
    python -m kmirror.launch --workers 2 train.py          # multi-worker: TF_CONFIG, reducer="ring"

starts `train.py` twice with what the processes need to form a job: for Horovod a rendezvous
server on loopback and ranks in the environment; for multi-worker training (`--workers N`, or
`--mode ring`) a `TF_CONFIG` per worker naming free loopback ports. It streams every line of their
output prefixed with its rank,
stops the others as soon as one fails, and exits with the worst exit code. `run(fn, n=2)` does the
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
import contextlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["launch", "run", "main"]

MODES = ("horovod", "ring")
#: Seconds the other processes get to exit after one failed, before they are killed.
GRACE_SECONDS = 10.0


def launch(
    command: Sequence[str],
    n: int = 2,
    *,
    mode: str = "horovod",
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    output: TextIO | None = None,
    port: int | None = None,
) -> int:
    """Runs `command` in `n` local processes that form one job; returns the worst exit code.

    Example:

    ```python
    code = kmirror.launch.launch([sys.executable, "train.py"], n=2, timeout=600)
    ```

    Args:
        command: the program and its arguments, e.g. `[sys.executable, "train.py"]`.
        n: how many processes (ranks).
        mode: "horovod" (a Horovod job over Gloo on loopback) or "ring" (TensorFlow workers,
            each with a `TF_CONFIG`; the script calls `kmirror.cluster.connect()`).
        timeout: seconds after which every process is killed (None: no limit).
        env: extra environment variables for every process.
        output: where the prefixed output goes (default: standard output).
        port: the loopback port of Horovod's rendezvous server, or of the first worker (the
            others take the next ones); default: free ports chosen now. A port in use is an
            error that names it.

    Returns:
        0 if every process succeeded; else the exit code of the first that failed (a process
        killed by signal S counts as 128 + S), or 124 on timeout.
    """
    _check(n, mode)
    output = output or sys.stdout
    with _job_environment(n, mode, port) as rank_envs:
        processes = []
        for rank_env in rank_envs:
            process = subprocess.Popen(
                list(command),
                env={**os.environ, **_python_path(), **(env or {}), **rank_env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                start_new_session=True,
            )
            processes.append(process)
        lock = threading.Lock()
        streams = [
            threading.Thread(target=_stream, args=(p, f"[{rank}] ", output, lock), daemon=True)
            for rank, p in enumerate(processes)
        ]
        for stream in streams:
            stream.start()
        code = _supervise(processes, timeout, output, lock)
        for stream in streams:
            stream.join(timeout=5)
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
        description="Start N local processes that train together (one per device).",
    )
    parser.add_argument("-n", "--np", dest="n", type=int, help="how many processes")
    parser.add_argument("--workers", type=int, help="how many multi-worker processes (--mode ring)")
    parser.add_argument("--mode", choices=MODES, default=None, help="default: horovod")
    parser.add_argument("--timeout", type=float, default=None, help="seconds; then kill all")
    parser.add_argument(
        "--port", type=int, default=None, help="rendezvous / first worker port (default: free)"
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
    if options.n is None:
        parser.error("give the number of processes with -n N (or --workers N)")
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
        )
    except (ValueError, OSError) as error:
        parser.error(str(error))


# -- the job's environment ------------------------------------------------------------------------
def _check(n: int, mode: str) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"the number of processes must be a whole number >= 1; got {n!r}.")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}.")


@contextlib.contextmanager
def _job_environment(n: int, mode: str, port: int | None) -> Iterator[list[dict[str, str]]]:
    if port is not None and (not isinstance(port, int) or not 1 <= port <= 65536 - n):
        raise ValueError(f"port must be a whole number from 1 to {65536 - n}; got {port!r}.")
    if mode == "ring":
        yield _tf_config_environment(n, port)
        return
    with _horovod_environment(n, port) as envs:
        yield envs


def _tf_config_environment(n: int, port: int | None = None) -> list[dict[str, str]]:
    """A TF_CONFIG per worker, naming a loopback port for each (free ones unless given)."""
    if port is None:
        ports = _free_ports(n)
    else:
        ports = list(range(port, port + n))
        for p in ports:
            _check_free(p)
    workers = [f"127.0.0.1:{p}" for p in ports]
    return [
        {
            "TF_CONFIG": json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
            )
        }
        for index in range(n)
    ]


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 right now (held open together, so all differ)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _check_free(port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise OSError(
                f"kmirror.launch: port {port} on 127.0.0.1 is in use by another program; pass "
                "another port (--port), or none to let the launcher pick free ports."
            ) from None


@contextlib.contextmanager
def _horovod_environment(n: int, port: int | None) -> Iterator[list[dict[str, str]]]:
    """A Gloo rendezvous server on loopback (a free port unless given) and each rank's Horovod
    variables."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    if port is not None:
        _check_free(port)
    server = RendezvousHTTPServer(("127.0.0.1", port or 0), RendezvousHandler, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        slots = get_host_assignments(parse_hosts(f"localhost:{n}"), n)
        server.init(slots)
        common = {
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server.server_address[1]),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": "lo",
        }
        yield [{**common, **create_slot_env_vars(slot)} for slot in slots]
    finally:
        server.shutdown()
        server.server_close()


def _python_path() -> dict[str, str]:
    """Children import what this process can (the caller's modules, for `run`)."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys([os.getcwd(), *paths]))}


# -- supervising --------------------------------------------------------------------------------
def _stream(process: subprocess.Popen, prefix: str, output: TextIO, lock: threading.Lock) -> None:
    for line in process.stdout:
        with lock:
            output.write(prefix + line)
            output.flush()


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _supervise(processes, timeout, output, lock) -> int:
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


# -- the child side of run() --------------------------------------------------------------------
def _rank() -> int:
    if "HOROVOD_RANK" in os.environ:
        return int(os.environ["HOROVOD_RANK"])
    task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task") or {}
    return int(task.get("index", 0))


def _call(call: Path, mode: str | None, simulate: int | None) -> int:
    import cloudpickle

    if simulate:
        from kmirror import devices

        devices.simulate(simulate)
    if mode == "ring":
        from kmirror import cluster

        cluster.connect()
    fn, args, kwargs = pickle.loads(call.read_bytes())
    result = fn(*args, **kwargs)
    call.with_name(f"result-{_rank()}.pkl").write_bytes(cloudpickle.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
