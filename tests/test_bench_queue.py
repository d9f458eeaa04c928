"""scripts/bench_settings_queue.py keeps what each run of a setting was made on: the benchmark rewrites a setting's
learning.json with its runs only, and each earlier seed's provenance (commit, machine, time) must survive that."""
import importlib.util
import json
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_settings_queue.py"


def _queue():
    spec = importlib.util.spec_from_file_location("bench_settings_queue", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_seeds_provenance_survives_the_next_run(tmp_path, monkeypatch):
    q = _queue()
    real_run = subprocess.run

    def fake_run(cmd, **kw):
        if cmd[:2] == ["git", "rev-parse"]:
            return real_run(["echo", "abc1234"], capture_output=True, text=True)
        seed = int(cmd[-1].split("seeds=(")[1].split(",")[0])  # the benchmark: its learning.json, runs only
        dest = tmp_path / "work" / "gspo-k1" / "learning.json"
        runs = json.loads(dest.read_text())["runs"] if dest.exists() else {}
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps({"config": {}, "runs": {**runs, f"s{seed}_k1": {"after": 0.5}}}))
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(q.subprocess, "run", fake_run)
    record = tmp_path / "record"
    for seed in (0, 1, 2):
        q.run_item(tmp_path / "work", tmp_path / "D", seed, "gspo-k1", record)
    saved = json.loads((record / "gspo-k1.json").read_text())
    assert sorted(saved["runs"]) == ["s0_k1", "s1_k1", "s2_k1"]
    assert sorted(saved["provenance"]) == ["s0", "s1", "s2"]
    assert all(p["commit"] == "abc1234" and "cores" in p["machine"] for p in saved["provenance"].values())
