"""kmirror's own errors (bad input raises ValueError or TypeError, as Keras does)."""

from __future__ import annotations

__all__ = ["PeerLost"]


class PeerLost(RuntimeError):
    """Another process of a multi-process job stopped, so this one cannot go on.

    Relaunch every process; with `kmirror.callbacks.BackupAndRestore` training resumes from the
    last completed epoch.
    """
