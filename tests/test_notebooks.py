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


def test_the_notebooks_are_there():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "reward_prototyping", "async_vs_sync", "environments"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_holds_no_library_code(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert not cell.outputs, f"{path.name}: commit notebooks without outputs"
        tree = ast.parse(cell.source)
        envs = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                and any(ast.unparse(b) == "minirl.Env" for b in n.bases)]  # user-side envs, like user rewards
        for node in ast.walk(tree):
            assert not isinstance(node, ast.ClassDef) or node in envs, f"{path.name}: a class belongs in the package"
            if isinstance(node, ast.FunctionDef):  # user-side helpers only: rewards, env methods and one-liners
                limit = 6 if any(node in e.body for e in envs) else 4
                assert len(node.body) <= limit, f"{path.name}: function {node.name} is library code; move it to minirl"


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
    if path.stem == "environments":
        html = "".join(o.get("data", {}).get("text/html", "") for c in nb.cells if c.cell_type == "code"
                       for o in c.outputs)
        assert "held-out accuracy (mean episode reward, greedy)" in text and "turns per episode" in text
        assert "title='sampled token" in html and "title='env token" in html  # the coloured loss-mask view
        assert (tmp_path / "runs" / "environments-small" / "dashboard.png").exists()
    print(f"{path.name}: {took:.1f} s")
