"""What a backup folder holds: where training stood (`Position`), and the newest intact backup in
it (`latest`), as `BackupAndRestore` writes them: a weights file, the values of the state the
steps reached that no weights file holds (`write_reached`), and `backup.json` naming them with
their checksums (and, with `double_checkpoint`, the previous ones)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kmirror._core.files import atomic_path, digest

__all__ = ["Position", "Backup", "INDEX", "latest", "files", "write_reached", "read_reached"]

#: The file naming the backup, in the backup folder.
INDEX = "backup.json"


class Position(NamedTuple):
    """Where training stands: `step` batches of epoch `epoch` (0-based) are trained."""

    epoch: int
    step: int


class Backup(NamedTuple):
    """A backup found in the folder: its position, its weights file, the state of Python's
    `random` module the resumed epoch draws its batch order from, and the file of the state the
    steps reached that no weights file holds (None: there was none)."""

    position: Position
    weights: Path
    python_random: list[int]
    reached: Path | None = None


def latest(folder: Path, double_checkpoint: bool) -> Backup | None:
    """The newest intact backup in `folder` (the previous one when the latest is corrupt and
    `double_checkpoint` kept it); None when there is none."""
    index = folder / INDEX
    if not index.exists():
        return None
    try:
        state = json.loads(index.read_text())
    except (OSError, ValueError) as error:
        what = f"{index} cannot be read ({error})"
        raise ValueError(_corrupt(folder, what, double_checkpoint)) from None
    entries = [state, *([state["previous"]] if state.get("previous") else [])]
    for number, entry in enumerate(entries):
        broken = _broken(folder, entry)
        if broken is None:
            reached = folder / entry["reached"] if entry.get("reached") else None
            position = Position(entry["epoch"], entry["step"])
            return Backup(position, folder / entry["weights"], entry["python_random"], reached)
        more = number + 1 < len(entries)
        warnings.warn(
            f"kmirror: the backup {broken} is missing or corrupt"
            + ("; resuming from the previous backup." if more else "."),
            stacklevel=3,
        )
    what = f"{broken.name} is missing or corrupt"
    raise ValueError(_corrupt(folder, what, double_checkpoint))


def _broken(folder: Path, entry: dict) -> Path | None:
    """The first of a backup's files (its weights, the state its steps reached) that is missing
    or does not hold what its index says; None when all are intact."""
    named = [(entry["weights"], entry["sha256"])]
    if entry.get("reached"):
        named.append((entry["reached"], entry["reached_sha256"]))
    for name, sha256 in named:
        if not _intact(folder / name, sha256):
            return folder / name
    return None


def _intact(file: Path, sha256: str) -> bool:
    return file.exists() and digest(file) == sha256


def _corrupt(folder: Path, what: str, double_checkpoint: bool) -> str:
    fallback = ", or pass double_checkpoint=True to keep a previous backup to fall back to"
    fallback = "" if double_checkpoint else fallback
    return (
        f"kmirror.callbacks.BackupAndRestore: the backup in {folder} cannot be "
        f"resumed: {what}. Delete the folder to train from the start{fallback}."
    )


def files(folder: Path) -> list[Path]:
    """The backups' files in `folder`: weights, and the state the steps reached."""
    return [*folder.glob("*.weights.h5"), *folder.glob("*.reached.npz")]


def write_reached(folder: Path, name: str, values: list[np.ndarray]) -> dict:
    """Writes `values` (the state the steps reached, in order) as `name.reached.npz`; its
    entry in `backup.json`."""
    path = folder / f"{name}.reached.npz"
    with atomic_path(path) as partial, open(partial, "wb") as f:
        np.savez(f, **{f"state{i}": value for i, value in enumerate(values)})
    return {"reached": path.name, "reached_sha256": digest(path)}


def read_reached(path: Path) -> list[np.ndarray]:
    with np.load(path) as values:
        return [values[k] for k in sorted(values, key=lambda k: int(k.removeprefix("state")))]
