"""Writing files so that a crash mid-write never leaves a partial file behind."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path"]

_SUFFIXES = (".weights.h5", ".weights.json", ".keras", ".h5", ".json")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path beside `path`; when the block ends without error, the file written
    there replaces `path` in one step (a rename), so readers see the old file or the new one.

    The temporary name keeps the suffix (`.keras`, `.weights.h5`), which Keras' savers require.
    """
    path = Path(path)
    suffix = next((s for s in _SUFFIXES if path.name.endswith(s)), path.suffix)
    stem = path.name[: len(path.name) - len(suffix)] if suffix else path.name
    temporary = path.with_name(f".{stem}.partial-{os.getpid()}{suffix}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield str(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
