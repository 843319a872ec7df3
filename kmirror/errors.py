"""kmirror's own errors (bad input raises ValueError or TypeError, as Keras does)."""

from __future__ import annotations

__all__ = ["PeerLost", "reason"]


class PeerLost(RuntimeError):
    """Another process of a multi-process job stopped, so this one cannot go on.

    Relaunch every process; with `kmirror.callbacks.BackupAndRestore` training resumes from the
    last completed epoch.
    """


_TELLING = ("connection", "collective", "timed out", "unavailable", "reset", "closed", "shut down")


def reason(error: BaseException) -> str:
    """The line of a low-level (TensorFlow, gRPC, Gloo) error message that says what happened."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = [line for line in lines if any(word in line.lower() for word in _TELLING)]
    return (telling or lines or [type(error).__name__])[0][:300]
