"""How the processes of a local job find each other: for Horovod, a Gloo rendezvous server on
loopback and each rank's variables; for multi-worker training, a `TF_CONFIG` per worker naming free
loopback ports. Everything binds to 127.0.0.1 only.

Example:

```python
with rendezvous.job_environment(2, "ring", port=None) as environments:
    ...   # one dict of environment variables per process
```
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["job_environment", "tf_config_environment", "python_path"]


@contextlib.contextmanager
def job_environment(
    n: int, mode: str, port: int | None, hosts: list[str] | None = None
) -> Iterator[list[dict[str, str]]]:
    """Each process's environment variables; `hosts`: where each ring worker runs (default:
    127.0.0.1)."""
    if port is not None and (not isinstance(port, int) or not 1 <= port <= 65536 - n):
        raise ValueError(f"port must be a whole number from 1 to {65536 - n}; got {port!r}.")
    if mode == "ring":
        yield tf_config_environment(n, port, hosts)
        return
    with _horovod_environment(n, port) as envs:
        yield envs


def tf_config_environment(
    n: int, port: int | None = None, hosts: list[str] | None = None
) -> list[dict[str, str]]:
    """A TF_CONFIG per worker, naming its host (default 127.0.0.1) and a port: free ones on this
    machine unless given."""
    if port is None:
        ports = _free_ports(n)
    else:
        ports = list(range(port, port + n))
        for p in ports:
            _check_free(p)
    workers = [f"{host}:{p}" for host, p in zip(hosts or ["127.0.0.1"] * n, ports)]
    return [
        {
            "TF_CONFIG": json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
            )
        }
        for index in range(n)
    ]


#: The lowest port chosen: above the ports services commonly use and those Ray gives its workers
#: (10002 to 19999 by default).
_LOWEST = 20000


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now, chosen below the kernel's ephemeral range where it
    leaves room: the workers bind them seconds later, and no other process's bind to port 0 or
    outgoing connection takes a port from below that range in the meantime."""
    ephemeral = _ephemeral_start()
    if ephemeral - _LOWEST < 100 * n:
        return _kernel_ports(n)
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in random.sample(range(_LOWEST, ephemeral), 50 * n):
            try:
                stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                return ports
    return _kernel_ports(n)


def _ephemeral_start() -> int:
    """The first port of the range the kernel binds port 0 and outgoing connections to (Linux's
    setting; elsewhere the range IANA reserves for them, from 49152)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _kernel_ports(n: int) -> list[int]:
    """n distinct ports the kernel picks as free (held open together, so all differ)."""
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


def python_path() -> dict[str, str]:
    """Children import what this process can (the caller's modules, for `run`)."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys([os.getcwd(), *paths]))}
