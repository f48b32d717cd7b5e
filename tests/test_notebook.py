"""The Colab notebook runs end to end (CPU, tiny settings injected after its parameters)."""
from __future__ import annotations

import json
import os

import nbformat
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "experiments", "colab_tpu.ipynb")


def _inject(nb, values: dict):
    """Papermill-style: a cell assigning `values` right after the `parameters` cell."""
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    source = "\n".join(f"{k} = {v!r}" for k, v in values.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(index + 1, cell)
    return nb


def test_notebook_has_a_parameters_cell_and_a_placeholder_repo_url():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    assert 'REPO_URL = "https://github.com/<org>/cpt_jax"' in params[0].source
    assert "PLACEHOLDER" in params[0].source


@pytest.mark.slow
def test_notebook_executes_with_tiny_settings(tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    workdir = str(tmp_path / "run")
    nb = _inject(nbformat.read(NOTEBOOK, as_version=4), {
        "INSTALL": False, "DATASET": "digits", "MODEL": "mlp", "NUM_STEPS": 16,
        "BATCH_SIZE": 32, "NUM_CYCLES": 2, "LEARNING_RATE": 0.05, "EVAL_EVERY": 8,
        "CHECKPOINT_EVERY": 8, "WORKDIR": workdir, "PROGRESS": False})
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", REPO)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.join(REPO,
                                                                                  "experiments")}})
    client.execute()  # raises CellExecutionError on any failing cell
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 16 and summary["num_compiles"] == 1
    assert summary["dataset"] == "digits"
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[:2] == ["16", "8"]
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "training on 1 device(s)" in outputs and "final_test_accuracy" in outputs
    # The install cell pins the runtime's own jax/jaxlib instead of replacing them.
    import importlib.metadata as md
    assert f"jax=={md.version('jax')}" in outputs and f"jaxlib=={md.version('jaxlib')}" in outputs
    images = [o for c in nb.cells for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 2  # bits.png and curves.png displayed
