"""`minirl bench trl` (issue 43): minirl's side takes the rows in the given order and saves at the given steps; one
evaluator scores peft adapters whichever toolkit saved them; the harness interleaves seeds and resumes. No TRL
here: a fake TRL side writes peft adapters the way TRL's GRPOTrainer does (`model.save_pretrained`)."""
import json
from pathlib import Path

import pytest

from minirl import reward
from minirl.benchmarks.trl import task_rows, trl_spec
from minirl.benchmarks.trl_bench import bench_trl, evaluate_adapters, run_minirl, summarize

SMALL = dict(prompts_per_step=2, group_size=2, max_tokens=4, lora_rank=8, lora_alpha=16)
SEEN: list[str] = []


@reward
def record_completion(prompt, completion, **_):
    """Records what the evaluator generated (reward_workers=0: in this process)."""
    SEEN.append(completion)
    return 0.0


def peft_adapter(model: str, folder: Path, seed: int, random_b: bool = True, targets="all-linear", r: int = 8):
    """A peft adapter folder as TRL saves one: peft's own LoRA on the model, `save_pretrained`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    m = get_peft_model(m, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, task_type="CAUSAL_LM",
                                     init_lora_weights=not random_b))
    if random_b:
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 1.0)
    m.save_pretrained(folder)
    return folder


def test_a_peft_adapter_saved_outside_minirl_is_what_minirls_evaluator_scores(tiny_model, tmp_path):
    held = task_rows(0)[1][:6]
    zero = peft_adapter(tiny_model, tmp_path / "zero", 0, random_b=False)  # B = 0: the base model's outputs
    moved = peft_adapter(tiny_model, tmp_path / "moved", 1)
    SEEN.clear()
    accs = evaluate_adapters(tiny_model, held, [zero, moved, zero], 6, 8, 16, backend="hf",
                             rewards=["record_completion"], reward_workers=0)
    assert accs == [0.0, 0.0, 0.0] and len(SEEN) == 18
    assert SEEN[:6] == SEEN[12:]  # loading the zero adapter again gives the base model's completions back
    assert SEEN[6:12] != SEEN[:6]  # the moved adapter was loaded: its completions differ


@pytest.mark.parametrize("fault,match", [(dict(targets=["q_proj", "v_proj"]), "not this model's LoRA"),
                                         (dict(r=4), "LoRA r 4 / alpha 8, but the evaluator runs r 8 / alpha 16")])
def test_an_adapter_that_does_not_fit_the_evaluator_is_refused_not_half_loaded(tiny_model, tmp_path, fault, match):
    bad = peft_adapter(tiny_model, tmp_path / "bad", 0, **fault)
    with pytest.raises(ValueError, match=match):
        evaluate_adapters(tiny_model, task_rows(0)[1][:2], [bad], 4, 8, 16, backend="hf", reward_workers=0)


def test_minirls_side_takes_the_rows_in_the_given_order_and_saves_at_the_given_steps(tiny_model, tmp_path):
    spec = trl_spec(tiny_model, 3, 3, [0, 2, 3], tmp_path / "m", lr=1e-2, **SMALL)
    spec["minirl"] = dict(backend="hf")
    rec = run_minirl(spec)
    assert rec["prompt_ids"] == [[0, 1], [2, 3], [4, 5]]  # rows 0..5 of the spec, in order (no shuffle)
    assert len(rec["step_s"]) == 3 and rec["peak_rss_mb"] > 0
    assert sorted(p.name for p in (tmp_path / "m" / "adapters").iterdir()) == ["step-0", "step-2", "step-3"]


def test_the_harness_interleaves_seeds_scores_every_saved_adapter_and_resumes(tiny_model, tmp_path):
    calls = []

    def fake(side):
        def train(spec):  # writes adapters the way TRL's script does, at the spec's steps
            calls.append((side, spec["seed"]))
            for st in spec["save_steps"]:
                peft_adapter(spec["model"], Path(spec["out"]) / "adapters" / f"step-{st}", st, random_b=st > 0)
            return {"step_s": [1.5] * spec["steps"], "peak_rss_mb": 100.0}
        return train
    kw = dict(steps=2, save_every=1, eval_size=4, model=tiny_model, settings=SMALL, target=0.0,
              eval_overrides=dict(backend="hf", reward_workers=0))
    res = bench_trl(tmp_path, seeds=(0, 1), sides={"trl": fake("trl"), "minirl": fake("minirl")}, **kw)
    assert calls == [("trl", 0), ("minirl", 0), ("trl", 1), ("minirl", 1)]
    assert set(res["runs"]) == {"trl_s0", "minirl_s0", "trl_s1", "minirl_s1"}
    assert all(set(r["accuracy"]) == {"0", "1", "2"} for r in res["runs"].values())
    assert res["summary"]["trl"]["accuracy"]["2"]["n"] == 2 and res["summary"]["minirl"]["step_s"]["mean"] == 1.5
    assert json.loads((tmp_path / "trl.json").read_text())["summary"] == res["summary"]

    def refuse(spec):
        raise AssertionError(f"run again: {spec['out']}")
    again = bench_trl(tmp_path, seeds=(0, 1), sides={"trl": refuse, "minirl": refuse}, **kw)
    assert again["runs"] == res["runs"]  # the runs in trl.json are kept: nothing runs again
    changed = dict(kw, eval_size=3)
    with pytest.raises(AssertionError, match="run again"):  # another config: the old runs do not count
        bench_trl(tmp_path, seeds=(0,), sides={"trl": refuse, "minirl": refuse}, **changed)
    ablation = bench_trl(tmp_path / "ablation", seeds=(0, 1), trl_from=tmp_path / "trl.json",
                         minirl_overrides=dict(train_zero_adv=True), sides={"trl": refuse, "minirl": fake("minirl")}, **kw)
    assert calls[-2:] == [("minirl", 0), ("minirl", 1)]  # TRL's runs came from the first trl.json: minirl alone ran
    assert {k: {**r, "from": None} for k, r in ablation["runs"].items() if k.startswith("trl")} \
        == {k: {**r, "from": None} for k, r in res["runs"].items() if k.startswith("trl")}
    assert ablation["runs"]["trl_s0"]["from"] == str(tmp_path / "trl.json") and "from" not in ablation["runs"]["minirl_s0"]
    with pytest.raises(ValueError, match="its TRL runs were made with other settings"):
        bench_trl(tmp_path / "other", seeds=(0,), trl_from=tmp_path / "trl.json", sides={"trl": refuse, "minirl": refuse},
                  **dict(kw, steps=3))
    with pytest.raises(ValueError, match="did you mean 'train_zero_adv'"):  # before anything runs
        bench_trl(tmp_path / "typo", seeds=(0,), minirl_overrides=dict(train_zero_advs=True),
                  sides={"trl": refuse, "minirl": refuse}, **kw)


def test_the_summary_gives_mean_spread_and_seconds_to_trls_final_accuracy():
    def run(side, seed, accs, step_s):
        return {"side": side, "seed": seed, "accuracy": dict(zip(["0", "2", "4"], accs)), "step_s": step_s,
                "peak_rss_mb": 10.0 * (seed + 1)}
    res = {"config": {"save_steps": [0, 2, 4]}, "runs": {
        "trl_s0": run("trl", 0, [0.2, 0.4, 0.6], [10.0] * 4), "trl_s1": run("trl", 1, [0.2, 0.5, 0.8], [10.0] * 4),
        "minirl_s0": run("minirl", 0, [0.2, 0.7, 0.7], [4.0] * 4),
        "minirl_s1": run("minirl", 1, [0.2, 0.5, 0.6], [6.0] * 4)}}
    s = summarize(res, None)
    assert s["target"] == pytest.approx(0.7)  # TRL's mean accuracy at the last saved step
    assert s["summary"]["minirl"]["accuracy"]["2"]["mean"] == pytest.approx(0.6)
    assert s["summary"]["minirl"]["accuracy"]["2"]["sd"] == pytest.approx(0.1414, abs=1e-3)
    assert s["summary"]["minirl"]["train_s_to_target"] == {"mean_s": 8.0, "reached": 1, "n": 2}  # seed 0 at step 2
    assert s["summary"]["trl"]["train_s_to_target"] == {"mean_s": 40.0, "reached": 1, "n": 2}  # seed 1 at step 4
    assert s["summary"]["trl"]["peak_rss_mb"]["max"] == 20.0 and s["summary"]["trl"]["step_s"]["mean"] == 10.0


def test_an_unknown_task_is_named_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'sub': choose from addition, demo"):
        bench_trl(tmp_path, task="sub")
