"""Every tutorial notebook runs top to bottom, as a reader runs it, and is stored unexecuted."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        "store notebooks with their outputs stripped"
    )
    client = NotebookClient(
        notebook,
        timeout=180,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "Traceback" not in outputs
    if path.name == "01_quickstart.ipynb":
        assert "every reducer's logged loss equals the single-device loss" in outputs
        images = [
            o
            for c in notebook.cells
            for o in c.get("outputs", [])
            if "data" in o and "image/png" in o["data"]
        ]
        assert images, "the loss curves are drawn"
