"""The documentation site builds without a warning, and its API reference covers the public API."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import kmirror

ROOT = Path(__file__).parent.parent


def test_docs_build_strictly(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in kmirror.__all__:
        assert f'id="kmirror.{name}"' in api, f"kmirror.{name} is missing from the API reference"
    for plot in ("overhead", "allreduce", "fusion", "compression", "scaling"):
        assert (tmp_path / "site" / "img" / "benchmarks" / f"{plot}.png").exists(), plot


def public_examples() -> dict[str, str]:
    """The first python example of every public name's docstring, read as mkdocstrings reads it."""
    import griffe

    package = griffe.load("kmirror", search_paths=[str(ROOT)])
    examples = {}
    for name in kmirror.__all__:
        docstring = package[name].docstring
        found = re.search(r"```python\n(.*?)```", docstring.value if docstring else "", re.DOTALL)
        examples[name] = textwrap.dedent(found.group(1)) if found else ""
    return examples


def test_every_public_name_has_a_runnable_example(tmp_path):
    """Each public name's docstring example runs as written, in order, in one fresh process."""
    examples = public_examples()
    assert all(examples.values()), [name for name, code in examples.items() if not code]
    script = "\n".join(
        f"print('--- kmirror.{name}', flush=True)\n{code}" for name, code in examples.items()
    )
    (tmp_path / "examples.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "examples.py"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in kmirror.__all__:
        assert f"--- kmirror.{name}" in done.stdout
    assert "[(0, 2), (1, 2)]" in done.stdout  # kmirror.launch.run's two ranks
    assert (tmp_path / "best.keras").exists() and (tmp_path / "trained.keras").exists()


def test_every_documented_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    listed = set(re.findall(r":\s*([\w-]+\.md)", nav))
    assert pages == listed
