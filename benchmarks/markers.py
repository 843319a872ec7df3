"""The generated parts of the docs: text between `<!-- name -->` and `<!-- /name -->` markers.

`make bench` (benchmarks/report.py) and `make soak` (scripts/soak.py) write what they measured
there; tests/test_docs.py checks that every such part is what benchmarks/results.json gives, so
no figure in the docs outlives the run it came from.

    text = markers.fill(text, "results", body)     # replaces what the markers hold
    markers.held(text, "results")                   # what they hold, or None
"""

from __future__ import annotations

import re

__all__ = ["fill", "held", "names"]


def _pattern(name: str) -> re.Pattern:
    return re.compile(f"<!-- {re.escape(name)} -->(.*?)<!-- /{re.escape(name)} -->", re.DOTALL)


def fill(text: str, name: str, content: str) -> str:
    """`text` with every `name` marker pair holding `content` (on lines of its own when the
    markers are; inline otherwise)."""

    def replaced(match: re.Match) -> str:
        inner = f"\n{content}\n" if match.group(1).startswith("\n") else content
        return f"<!-- {name} -->{inner}<!-- /{name} -->"

    return _pattern(name).sub(replaced, text)


def held(text: str, name: str) -> str | None:
    """What the first `name` marker pair of `text` holds (stripped), or None."""
    found = _pattern(name).search(text)
    return None if found is None else found.group(1).strip()


def names(text: str) -> list[str]:
    """The names of the marker pairs in `text`, in order."""
    return [m.group(1) for m in re.finditer(r"<!-- ([\w-]+) -->", text)]
