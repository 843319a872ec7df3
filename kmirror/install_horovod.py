"""Builds and installs Horovod 0.28.1 (TensorFlow and Gloo) into the running Python environment,
against the TensorFlow already there: what `reducer="horovod"` needs.

    python -m kmirror.install_horovod

Horovod 0.28.1 ships only as source and, as published, does not compile against TensorFlow 2.18
or newer: `horovod/tensorflow/xla_mpi_ops.cc` includes XLA headers that TensorFlow's wheel no
longer ships. Those ops only serve XLA-compiled GPU graphs, so the build leaves that one file out.
The source comes from the package registry; the wheel built is cached in
`$KMIRROR_CACHE/horovod/` (default `~/.cache/kmirror`), keyed by the TensorFlow version, the
machine and the GPU operations, so that a second install takes seconds. It needs a C++ compiler.

GPU machines: set `HOROVOD_GPU_OPERATIONS=NCCL` (and, if needed, `HOROVOD_NCCL_HOME`,
`HOROVOD_CUDA_HOME`) first; the flags become part of the cache key.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["VERSION", "install", "main"]

VERSION = "0.28.1"
#: What Horovod's runtime imports (it is installed without resolving its dependencies, so that
#: the TensorFlow in the environment stays as it is).
RUNTIME = ["cloudpickle", "psutil", "pyyaml", "packaging", "cffi"]
_FLAGS = {
    "HOROVOD_WITH_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_PYTORCH": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_MPI": "1",
}


def installed(python: str = sys.executable) -> bool:
    """Whether `python` imports a Horovod built with Gloo."""
    check = "import horovod.tensorflow as h; assert h.gloo_built()"
    return subprocess.run([python, "-c", check], capture_output=True).returncode == 0


def install(python: str = sys.executable) -> Path | None:
    """Installs Horovod into `python`'s environment; the wheel installed (None: it was there)."""
    if installed(python):
        return None
    env = {**os.environ, **_FLAGS}
    tf_version = _run([python, "-c", "import tensorflow as tf; print(tf.__version__)"], env).strip()
    gpu = env.get("HOROVOD_GPU_OPERATIONS", "none")
    key = f"tf{tf_version}-{platform.machine()}-gpu{gpu}"
    cache = Path(os.environ.get("KMIRROR_CACHE", Path.home() / ".cache" / "kmirror"))
    cache = cache / "horovod" / key
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("horovod-*.whl"))
    if not wheels:
        print(f"building horovod {VERSION} against tensorflow {tf_version} (a few minutes)")
        _build(python, env, cache)
        wheels = sorted(cache.glob("horovod-*.whl"))
    _run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheels[0])], env)
    _run([python, "-m", "pip", "install", "-q", *RUNTIME], env)
    if not installed(python):
        raise RuntimeError(f"horovod {VERSION} was installed without Gloo; see the build output")
    return wheels[0]


def _build(python: str, env: dict, cache: Path) -> None:
    with tempfile.TemporaryDirectory() as build:
        pip = [python, "-m", "pip"]
        source = f"horovod=={VERSION}"
        _run(
            [*pip, "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", build, source], env
        )
        with tarfile.open(Path(build) / f"horovod-{VERSION}.tar.gz") as archive:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(build, **safe)
        src = Path(build) / f"horovod-{VERSION}"
        # Leave out the XLA ops: their headers are not in TensorFlow's wheel.
        cmake = src / "horovod" / "tensorflow" / "CMakeLists.txt"
        lines = cmake.read_text().splitlines(keepends=True)
        cmake.write_text("".join(line for line in lines if "xla_mpi_ops.cc" not in line))
        # cmake and the compiler must see the environment's TensorFlow: no build isolation.
        _run([*pip, "install", "-q", "cmake<4", "setuptools", "wheel"], env)
        scripts = str(Path(python).parent)
        build_env = {
            **env,
            "PATH": scripts + os.pathsep + env.get("PATH", ""),
            "MAKEFLAGS": f"-j{os.cpu_count() or 1}",
        }
        wheel = [*pip, "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(cache)]
        _run([*wheel, str(src)], build_env, log=Path(build) / "build.log")


def _run(command: list[str], env: dict, log: Path | None = None) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        raise RuntimeError(f"{' '.join(command)} failed:\n{tail}")
    return done.stdout


def main() -> int:
    try:
        wheel = install()
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    if wheel is None:
        print(f"horovod {VERSION} already installed in {sys.prefix}")
    else:
        print(f"horovod {VERSION} installed from {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
