"""The notebooks run headless top to bottom on the tiny model (their cells carry the
assertions); 03_device_mapping runs in a real browser in test_lab_browser.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("ray_address")  # the kernels attach to the run's shared Ray cluster

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def run_notebook(name: str, model: Path, tmp_path: Path, monkeypatch) -> list[dict]:
    """Execute notebook ``name`` in a fresh kernel with the fast settings; returns its outputs."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("HYBRIDLAB_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("HYBRIDLAB_NOTEBOOK_MODEL", str(model))
    monkeypatch.setenv("HYBRIDLAB_NOTEBOOK_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("RAY_TMPDIR", str(Path("/tmp") / f"hlray-nb-{os.getpid()}"))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, "\n".join(e.get("ename", "") + ": " + e.get("evalue", "") for e in errors)
    return outputs


def test_quickstart_notebook_runs(trained_dir, tmp_path, monkeypatch):
    run_notebook("01_quickstart.ipynb", trained_dir, tmp_path, monkeypatch)
    assert (tmp_path / "run" / "summary.json").is_file() and (tmp_path / "run" / "telemetry.jsonl").is_file()


@pytest.mark.parametrize("name", ["02_dataflow_step_by_step.ipynb", "04_resharding_explained.ipynb",
                                  "05_live_algorithm_switch.ipynb"])
def test_teaching_notebook_runs(name, trained_dir, tmp_path, monkeypatch):
    run_notebook(name, trained_dir, tmp_path, monkeypatch)  # its cells assert what they show


@pytest.fixture(scope="module")
def calc_warm_dir(tiny_dir, hybridlab_home):
    """tiny after 150 SFT steps on the calc task's tool-use conversations (about 35 s): it calls
    the tool, though it rarely copies every digit yet (the preset's warm start goes on to 5% of
    held-out conversations)."""
    from hybridlab import sft
    from hybridlab.agents.tools import load_tools
    from hybridlab.atomic import built_once
    from hybridlab.evaluate import load_hf
    from hybridlab.tasks import get_task
    from hybridlab.tasks.calc import TOOL

    out = hybridlab_home / "fixtures" / "tiny-calc-tools"

    def train() -> None:
        model, tok = load_hf(tiny_dir)
        schemas = [tool.schema for tool in load_tools(TOOL).values()]
        sft.train(model, tok, get_task("calc"), sft.SFTConfig(steps=150, warmup_steps=20, batch_size=32, chat=True,
                                                              tools=schemas), progress=False)
        sft.save_checkpoint(model, tok, out)

    return built_once(out, train)


def test_agents_notebook_runs(calc_warm_dir, tmp_path, monkeypatch):
    run_notebook("06_agents_and_tools.ipynb", calc_warm_dir, tmp_path, monkeypatch)  # its cells assert


def test_tinker_notebook_runs(trained_dir, tmp_path, monkeypatch):
    run_notebook("07_tinker_api.ipynb", trained_dir, tmp_path, monkeypatch)  # its cells assert
    assert len(list((tmp_path / "run" / "tinker" / "dashboards").glob("*/telemetry.jsonl"))) == 1


def test_notebooks_are_committed_without_outputs():
    import nbformat

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"
