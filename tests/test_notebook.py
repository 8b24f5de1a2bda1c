"""notebooks/01_quickstart.ipynb runs headless top to bottom (its cells carry the assertions)."""
from __future__ import annotations

import os
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "01_quickstart.ipynb"


def test_quickstart_notebook_runs(trained_dir, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    ray_tmp = Path("/tmp") / f"hlray-nb-{os.getpid()}"
    monkeypatch.setenv("HYBRIDLAB_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("HYBRIDLAB_NOTEBOOK_MODEL", str(trained_dir))
    monkeypatch.setenv("HYBRIDLAB_NOTEBOOK_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert (tmp_path / "run" / "summary.json").is_file() and (tmp_path / "run" / "telemetry.jsonl").is_file()
