"""Every notebook runs top to bottom (small settings: MINIRL_NB_SMALL=1, a tiny random model, a few steps),
and holds no library code: only imports of minirl, configuration, calls and user-side reward functions."""
import ast
import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_are_there():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "reward_prototyping", "async_vs_sync"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_holds_no_library_code(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert not cell.outputs, f"{path.name}: commit notebooks without outputs"
        tree = ast.parse(cell.source)
        for node in ast.walk(tree):
            assert not isinstance(node, ast.ClassDef), f"{path.name}: a class belongs in the package"
            if isinstance(node, ast.FunctionDef):  # user-side helpers only: rewards and one-liners
                assert len(node.body) <= 4, f"{path.name}: function {node.name} is library code; move it to minirl"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_top_to_bottom_in_small_mode(path, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIRL_NB_SMALL", "1")
    monkeypatch.setenv("MINIRL_NB_BACKEND", "hf")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(path.parent.parent), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(path, as_version=4)
    t0 = time.time()
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    took = time.time() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
                     for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    if path.stem == "quickstart":
        assert "held-out accuracy" in text and "adapter_model.safetensors" in text
        assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)  # render() displays
        assert (tmp_path / "runs" / "quickstart-small" / "dashboard.png").exists()
    if path.stem == "reward_prototyping":
        assert "re-scored" in text and "zero-variance" in text
    if path.stem == "async_vs_sync":
        assert "one-step-off (K=1)" in text
    print(f"{path.name}: {took:.1f} s")
