"""scripts/gpu_check.sh in its CPU-twin mode: the same code as on a GPU (gloo for NCCL), so the script is known to
work before a GPU machine is lent for a few minutes."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


MISSING = ("vllm", "bitsandbytes", "datasets", "gguf")  # what the GPU image lacks


def test_gpu_check_cpu_twin_without_the_images_missing_packages(tmp_path):
    """The twin with vllm, bitsandbytes, datasets and gguf unimportable (a sitecustomize puts None in sys.modules:
    `import` fails and `find_spec` says None, in every process the script starts): each section that needs one
    says `skipped: <package> not installed`, every other section passes."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(f"import sys\nfor m in {MISSING!r}:\n    sys.modules[m] = None\n")
    env = {**os.environ, "PYTHONPATH": str(block), "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-twin", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=400, env=env)
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert not any(res["env"]["packages"][m] for m in ("vllm", "bitsandbytes", "gguf"))
    assert {k: v.get("skipped") for k, v in res.items() if "skipped" in v} == {
        "vllm": "vllm not installed", "qlora": "bitsandbytes not installed", "embedded": "gguf not installed"}
    assert all(v["ok"] for v in res.values()) and res["placement"]["line"].startswith("minirl: placement:")
    for run in (res["train"]["plain"], res["train"]["checkpointing"]):
        assert run["steps"] == 3 and run["adapter_finite"] and run["losses"]
    assert res["ipc"]["receiver_copy_equals_trainer"] and res["collective"]["equal"]
    assert res["collective"]["killed_peer"].startswith("SyncTimeout after")  # minirl's open_group, its gloo twin
    gen = res["generation"]  # the loop vs the static path on the tiny model, the CPU twin of the GPU figures
    assert gen["fast"]["decode"]["decode"] == "static" and gen["baseline"]["decode"] == {"decode": "loop"}
    assert gen["fast"]["tokens"] > 0 and gen["fast"]["tokens_per_s"] > 0 and gen["baseline"]["tokens_per_s"] > 0
    long = gen["long"]  # the long length (GPU: 256 tokens), the static path also in a quarter of the slots
    assert gen["max_tokens"] == 8 and long["max_tokens"] == 16 and long["baseline"]["tokens_per_s"] > 0
    assert long["fast_refill"]["decode"]["slots"] == 16 and long["fast_refill"]["decode"]["refills"] == 48
    assert long["fast"]["decode"]["refills"] == 0 and "fast_vs_baseline" in long


def test_gpu_check_reports_a_failing_section(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-twin", "--out", str(tmp_path),
                        "--only", "env,nosuchsection"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHON": sys.executable})
    assert p.returncode == 1 and "FAILED nosuchsection" in p.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text())["env"]["ok"]


def test_a_section_past_its_time_bound_is_stopped_and_the_others_run(tmp_path):
    """Each section has its own time bound: one that hangs (injected: it waits forever) is recorded as failed at
    its bound, and the next section still runs."""
    code = f"""
import importlib.util, sys, threading
spec = importlib.util.spec_from_file_location("gpu_check", {str(ROOT / "scripts" / "gpu_check.py")!r})
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
m.BOUNDS["placement"] = 1
m.placement = lambda dev: threading.Event().wait()
sys.argv = ["gpu_check.py", "--cpu-twin", "--out", {str(tmp_path)!r}, "--only", "placement,env"]
sys.exit(m.main())
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert p.returncode == 1 and "FAILED placement" in p.stdout, p.stdout + p.stderr
    assert "ran past its bound of 2 s" in res["placement"]["error"] and res["env"]["ok"]  # the twin: 2 x BOUNDS


def test_env_fails_naming_the_module_where_minirl_cannot_be_imported(tmp_path):
    """The image may lack a package `import minirl` needs (ipywidgets, injected: a sitecustomize puts None in
    sys.modules): the first section says which one and where the wheels come from, before the others fail on it."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text("import sys\nsys.modules['ipywidgets'] = None\n")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-twin", "--out", str(tmp_path / "out"),
                        "--only", "env"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(block), "PYTHON": sys.executable})
    env = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["env"]
    assert p.returncode == 1 and not env["ok"], p.stdout + p.stderr
    assert "no module 'ipywidgets'" in env["error"] and "gpu_wheels.sh" in env["error"]
