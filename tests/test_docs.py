"""The documentation site builds without a warning, and its API reference covers the public API."""

import os
import re
import subprocess
import sys
from pathlib import Path

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
    for name in (
        "kmirror.wrap",
        "kmirror.MirroredModel",
        "kmirror.reducers.Horovod",
        "kmirror.callbacks.ChiefCheckpoint",
        "kmirror.cluster.connect",
    ):
        assert name in api, name


def test_every_documented_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    listed = set(re.findall(r":\s*([\w-]+\.md)", nav))
    assert pages == listed
