"""What a backup folder holds: where training stood (`Position`), and the newest intact backup in
it (`latest`), as `BackupAndRestore` writes them: a weights file, and `backup.json` naming it
with its checksum (and, with `double_checkpoint`, the previous one)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import NamedTuple

from kmirror._core.files import digest

__all__ = ["Position", "Backup", "INDEX", "latest"]

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
        weights = folder / entry["weights"]
        reached = folder / entry["reached"] if entry.get("reached") else None
        if _intact(weights, entry["sha256"]) and (
            reached is None or _intact(reached, entry["reached_sha256"])
        ):
            position = Position(entry["epoch"], entry["step"])
            return Backup(position, weights, entry["python_random"], reached)
        more = number + 1 < len(entries)
        warnings.warn(
            f"kmirror: the backup {weights} is missing or corrupt"
            + ("; resuming from the previous backup." if more else "."),
            stacklevel=3,
        )
    what = f"{entries[-1]['weights']} is missing or corrupt"
    raise ValueError(_corrupt(folder, what, double_checkpoint))


def _intact(file: Path, sha256: str) -> bool:
    return file.exists() and digest(file) == sha256


def _corrupt(folder: Path, what: str, double_checkpoint: bool) -> str:
    fallback = ", or pass double_checkpoint=True to keep a previous backup to fall back to"
    fallback = "" if double_checkpoint else fallback
    return (
        f"kmirror.callbacks.BackupAndRestore: the backup in {folder} cannot be "
        f"resumed: {what}. Delete the folder to train from the start{fallback}."
    )
