"""scripts/gpu_check.sh in its CPU-twin mode: the same code as on a GPU (gloo for NCCL), so the script is known to
work before a GPU machine is lent for a few minutes."""
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_gpu_check_cpu_twin_passes_and_writes_json(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-twin", "--out", str(tmp_path),
                        "--only", "env,collective"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["env"]["ok"] and res["env"]["device"] == "cpu"
    assert res["collective"] == {**res["collective"], "ok": True, "backend": "gloo", "equal": True}


def test_gpu_check_reports_a_failing_section(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-twin", "--out", str(tmp_path),
                        "--only", "env,nosuchsection"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "FAILED nosuchsection" in p.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text())["env"]["ok"]
