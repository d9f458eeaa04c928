"""`bench pipeline` on a tiny model: interleaved rounds, the best synchronous loop as the baseline, the JSON's
fields; and `bench learning`'s time to accuracy."""
import json
from pathlib import Path

import pytest
from conftest import TOY_ROWS


def test_pipeline_bench_interleaves_and_compares_with_the_synchronous_loop(tmp_path, monkeypatch):
    """The orchestration (rounds, order, summary) with each run's figures faked: sync 10 s a step, K=1 8 s."""
    from minirl.benchmarks import pipeline as P
    seen = []

    def fake_one(cfg, warmup):
        seen.append(cfg)
        step = 10.0 if cfg.max_async_steps == 0 else 8.0
        gen, train = (6.0, 4.0) if cfg.max_async_steps == 0 else (7.5, 5.0)  # each side's seconds in a step
        return {"step_s": step + len(seen) * 0.01, "step_s_mean": step + len(seen) * 0.01, "gen_busy": 0.5,
                "train_busy": 0.5, "length_mean": 5.0, "gen_s_mean": gen, "train_s_mean": train}
    monkeypatch.setattr(P, "_one", fake_one)
    res = P.bench_pipeline(tmp_path / "b", workloads=("demo", "judge"), variants=("sync", "k1"), rounds=2, steps=3)
    assert res["order"] == ["demo/sync/r0", "demo/k1/r0", "demo/k1/r1", "demo/sync/r1",
                            "judge/sync/r0", "judge/k1/r0", "judge/k1/r1", "judge/sync/r1"]  # rotated per round
    assert [c.max_async_steps for c in seen[:4]] == [0, 1, 1, 0] and all(c.seed == 0 for c in seen)
    assert seen[4].rewards == ["minirl.benchmarks.pipeline:judged_correct"]
    w = res["workloads"][0]
    assert w["best_async"] == "k1" and w["step_s_by_round"]["sync"] == [10.01, 10.04]
    assert res["speedup"] == w["best_sync_step_s"] / w["async_step_s"] > 1
    # the bound: K = 1's slower side (generation, 7.5 s) against the synchronous step (10.025 s on average)
    assert w["phase_s"]["k1"] == {"gen": 7.5, "train": 5.0} and w["slower_side_s"] == 7.5
    assert w["overlap_ceiling"] == pytest.approx(10.025 / 7.5)
    on_disk = json.loads((tmp_path / "b" / "pipeline.json").read_text())
    assert on_disk["settings"]["rounds"] == 2 and on_disk["speedup"] == res["speedup"]


def test_long_tail_compares_the_fastest_synchronous_setup_of_either_generator(tmp_path, monkeypatch):
    """The baseline is the best synchronous setup, whichever generator gives it: here vLLM's (faked: transformers
    sync 30 s a step, vLLM sync 20 s, K=1 transformers 25 s, K=1 vLLM 16 s) -> speedup 20 / 16, not 30 / 16."""
    from minirl.benchmarks import pipeline as P
    seen = []
    times = {("hf", 0): 30.0, ("vllm", 0): 20.0, ("hf", 1): 25.0, ("vllm", 1): 16.0}

    def fake_one(cfg, warmup):
        seen.append(cfg)
        backend = "vllm" if cfg.backend == "vllm" else "hf"
        t = times[backend, cfg.max_async_steps]
        return {"step_s": t + 100, "step_s_mean": t, "gen_busy": 0.9, "train_busy": 0.4, "length_mean": 40.0}
    monkeypatch.setattr(P, "_one", fake_one)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    res = P.bench_pipeline(tmp_path / "b", workloads=("long-tail",), rounds=2, steps=3)
    assert {(c.backend, c.max_async_steps) for c in seen} == {("auto", 0), ("auto", 1), ("vllm", 0), ("vllm", 1)}
    assert all(c.max_tokens == 160 and c.prompts_per_step == 4 for c in seen)
    w = res["workloads"][0]
    assert (w["best_sync"], w["best_async"]) == ("sync_vllm", "k1_vllm")
    assert w["best_sync_step_s"] == 20.0 and w["speedup"] == res["speedup"] == 20.0 / 16.0  # means, not medians

    # a run recorded before step_s_mean existed: summarize() takes it from the run's own log, after warm-up
    import json as J
    res = J.loads((tmp_path / "b" / "pipeline.json").read_text())
    run = res["runs"]["long-tail/sync_vllm/r0"]
    del run["step_s_mean"]
    log = tmp_path / "log"
    log.mkdir()
    (log / "metrics.jsonl").write_text("".join(J.dumps({"event": "step", "time/step_s": x, "time/gen_s": x / 2,
                                                           "time/train_s": x / 4}) + "\n"
                                               for x in (99.0, 4.0, 0.5, 9.5, 0.8)))
    run["config"]["out_dir"] = str(log)
    for r in res["runs"].values():  # the others: logs that agree with what was recorded
        if r is not run:
            d = tmp_path / r["config"]["out_dir"].replace("/", "_")
            d.mkdir()
            d.joinpath("metrics.jsonl").write_text("".join(J.dumps({"event": "step", "time/step_s": x}) + "\n"
                                                           for x in [r["step_s_mean"]] * 4))
            r["config"]["out_dir"] = str(d)
    (tmp_path / "b" / "pipeline.json").write_text(J.dumps(res))
    again = P.summarize(tmp_path / "b")  # that round: mean(4.0, 0.5, 9.5) = 4.67 (warm-up and the drain step
    assert again["workloads"][0]["step_s_by_round"]["sync_vllm"] == [14 / 3, 20.0]  # left out); the other's 20
    assert again["best_sync_step_s"] == (14 / 3 + 20.0) / 2 and again["best_sync"] == "sync_vllm"
    assert res["runs"]["long-tail/sync/r0"].get("gen_s_mean") is None  # the faked runs logged no sides:
    assert "overlap_ceiling" not in again["workloads"][0]  # no bound is claimed from half the runs
    assert J.loads((tmp_path / "b" / "pipeline.json").read_text())["runs"]["long-tail/sync_vllm/r0"][
        "gen_s_mean"] == 14 / 6  # but the run whose log has them gets its sides' steady-state means


def test_the_steady_state_mean_leaves_out_warm_up_and_the_drain_step():
    from minirl.benchmarks.pipeline import _steady_mean
    assert _steady_mean([70.0, 25.0, 37.0, 29.0, 0.9], warmup=1) == (25.0 + 37.0 + 29.0) / 3
    assert _steady_mean([70.0, 25.0], warmup=1) == 25.0  # too short to leave one out


def test_an_interrupted_pipeline_bench_resumes_with_the_runs_it_recorded(tmp_path, monkeypatch):
    from minirl.benchmarks import pipeline as P
    seen = []

    def fake_one(cfg, warmup):
        seen.append(Path(cfg.out_dir).name)
        if len(seen) == 3:
            raise KeyboardInterrupt  # the machine stops mid-benchmark
        return {"step_s": 1.0, "step_s_mean": 1.0, "gen_busy": 0.5, "train_busy": 0.5, "length_mean": 5.0}
    monkeypatch.setattr(P, "_one", fake_one)
    kw = dict(workloads=("demo",), variants=("sync", "k1"), rounds=2, steps=3)
    with pytest.raises(KeyboardInterrupt):
        P.bench_pipeline(tmp_path / "b", **kw)
    assert seen == ["pipeline_demo_sync_r0", "pipeline_demo_k1_r0", "pipeline_demo_k1_r1"]
    res = P.bench_pipeline(tmp_path / "b", **kw)  # again: the two recorded runs are not repeated
    assert seen[3:] == ["pipeline_demo_k1_r1", "pipeline_demo_sync_r1"] and len(res["runs"]) == 4
    P.bench_pipeline(tmp_path / "b", **{**kw, "steps": 4})  # another config: every run again
    assert len(seen) == 9


def test_one_pipeline_run_reports_its_figures(tiny_model, tmp_path):
    """A real (tiny) synchronous run through the benchmark's measurement."""
    from minirl import Config
    from minirl.benchmarks.pipeline import _one
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TOY_ROWS))
    cfg = Config(model=tiny_model, backend="hf", data=str(data), rewards=["yes_reward"], steps=3, prompts_per_step=2,
                 group_size=4, max_tokens=6, lora_rank=8, eval_size=0, out_dir=str(tmp_path / "run"), max_async_steps=0)
    r = _one(cfg, warmup=1)
    assert r["step_s"] > 0 and 0 < r["gen_busy"] < 1 and 0 < r["train_busy"] < 1
    assert 0 < r["length_mean"] <= 6 and r["max_staleness"] == 0 and r["backend"] == "hf"
    assert 0 < r["gen_s_mean"] < r["step_s_mean"] and 0 < r["train_s_mean"] < r["step_s_mean"]  # sync: one at a time


def test_time_to_target_counts_training_seconds_until_the_first_evaluation_at_target():
    from minirl.benchmarks.learning import _time_to
    curve = [[0, 0.4], [5, 0.6], [10, 0.72], [15, 0.69], [20, 0.8]]
    step_s = [2.0] * 20
    assert _time_to(curve, step_s, 0.7) == 20.0   # the 10 steps before the eval at step 10
    assert _time_to(curve, step_s, 0.9) is None
    assert _time_to(curve, step_s, 0.3) == 0.0


def _learning_json(path, runs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": {}, "runs": runs}))
    return path


def _k0(curve, step_s=(2.0, 4.0, 3.0)):
    return {"after": curve[-1][1], "gain": curve[-1][1] - curve[0][1], "curve": curve, "step_s": list(step_s)}


def test_presets_compare_on_the_evaluations_every_run_has_and_pair_by_seed(tmp_path):
    from minirl.benchmarks.learning import compare_presets
    every5 = [[0, 0.4], [5, 0.9], [10, 0.6], [15, 0.9], [20, 0.7]]  # its steps 5 and 15 are not in the other's curve
    a = [_learning_json(tmp_path / "a" / "s0.json", {"s0_k0": _k0(every5), "s0_k1": _k0([[0, 0.0], [20, 0.0]])}),
         _learning_json(tmp_path / "a" / "s1.json", {"s1_k0": _k0([[0, 0.4], [10, 0.5], [20, 0.6]])})]
    b = [_learning_json(tmp_path / "b.json", {"s0_k0": _k0([[0, 0.4], [10, 0.7], [20, 0.9]], (1.0, 5.0, 9.0)),
                                             "s2_k0": _k0([[0, 0.3], [10, 0.3], [20, 0.3]])})]
    r = compare_presets({"a": a, "b": b})
    assert r["common_eval_steps"] == [10, 20]
    ra, rb = r["settings"]["a"], r["settings"]["b"]
    assert ra["seeds"] == ["0", "1"] and rb["seeds"] == ["0", "2"]  # the K = 1 run is not a preset's
    assert ra["after"]["mean"] == pytest.approx(0.65) and ra["gain"]["mean"] == pytest.approx(0.25)
    assert ra["curve_mean"]["mean"] == pytest.approx((0.65 + 0.55) / 2)  # steps 10 and 20 only
    assert rb["median_step_s"]["mean"] == pytest.approx((5.0 + 3.0) / 2)
    assert rb["after_minus_a"] == {"mean": pytest.approx(0.2), "se": None, "n": 1}  # seed 0 only: both have it
    assert rb["curve_mean_minus_a"]["mean"] == pytest.approx(0.8 - 0.65)
    assert "after_minus_a" not in ra


def test_presets_compare_time_to_accuracy_in_training_seconds(tmp_path):
    from minirl.benchmarks.learning import compare_presets
    # a: evaluations at 0, 10, 20 training seconds; b: at 0, 5, 30 (a slow second step). The horizon is the shortest
    # run's 20 s; each evaluation's accuracy holds until the next.
    a = [_learning_json(tmp_path / "a.json", {"s0_k0": _k0([[0, 0.4], [1, 0.6], [2, 0.8]], (10.0, 10.0)),
                                             "s1_k0": _k0([[0, 0.1], [2, 0.2]], (10.0, 10.0))})]
    b = [_learning_json(tmp_path / "b.json", {"s0_k0": _k0([[0, 0.4], [1, 0.7], [2, 0.7]], (5.0, 25.0))})]
    r = compare_presets({"a": a, "b": b}, target=0.7)
    ra, rb = r["settings"]["a"], r["settings"]["b"]
    assert r["horizon_s"] == 20.0 and r["target"] == 0.7
    assert ra["s_to_target"] == {"mean": 20.0, "se": None, "n": 1, "reached": 1, "seeds": 2}  # seed 1 never did
    assert rb["s_to_target"]["mean"] == 5.0 and ra["train_s"]["mean"] == 20.0 and rb["train_s"]["mean"] == 30.0
    assert ra["acc_over_time"]["mean"] == pytest.approx(((10 * 0.4 + 10 * 0.6) / 20 + 0.1) / 2)
    assert rb["acc_over_time"]["mean"] == pytest.approx((5 * 0.4 + 15 * 0.7) / 20)
    assert rb["acc_over_time_minus_a"] == {"mean": pytest.approx(0.625 - 0.5), "se": None, "n": 1}  # seed 0 only
    # by steps b is behind at the end (0.7 against 0.8); by seconds it is ahead
    assert rb["after_minus_a"]["mean"] == pytest.approx(-0.1)


def test_presets_benchmark_runs_each_preset_per_seed_in_rotating_order(tmp_path, monkeypatch):
    from minirl.benchmarks import learning
    calls = []

    def fake(out, seeds, ks, eval_size, eval_every, loss_type, **kw):
        calls.append((seeds[0], loss_type, eval_size, eval_every, kw))
        _learning_json(Path(out) / "learning.json", {f"s{seeds[0]}_k0": _k0([[0, 0.1], [5, 0.5]])})
    monkeypatch.setattr(learning, "bench_learning", fake)
    r = learning.bench_presets(tmp_path, presets=("grpo", "gspo"), seeds=(3, 4), eval_size=16, eval_every=5,
                               data="rows.jsonl")
    assert [(s, p) for s, p, *_ in calls] == [(3, "grpo"), (3, "gspo"), (4, "gspo"), (4, "grpo")]
    assert all(c[2:] == (16, 5, {"data": "rows.jsonl"}) for c in calls)
    assert json.loads((tmp_path / "presets.json").read_text()) == r and set(r["settings"]) == {"grpo", "gspo"}
    with pytest.raises(ValueError, match="unknown preset 'ppo'"):
        learning.bench_presets(tmp_path, presets=("ppo",))


def test_bench_learning_runs_your_task_given_as_config_fields(tmp_path, monkeypatch, capsys):
    """`minirl bench learning --presets ... --minirl-overrides data=...,max_tokens=...`: every setting's runs get
    the fields, over the demo's and beside the setting's own."""
    from minirl.benchmarks import learning
    from minirl.cli import main
    calls = []

    def fake(out, seeds, ks, eval_size, eval_every, **kw):
        calls.append((Path(out).name, kw))
        _learning_json(Path(out) / "learning.json", {f"s{seeds[0]}_k{ks[0]}": _k0([[0, 0.1], [5, 0.5]])})
    monkeypatch.setattr(learning, "bench_learning", fake)
    assert main(["bench", "learning", "--out", str(tmp_path), "--presets", "dapo,rloo", "--seeds", "0",
                 "--minirl-overrides", "data=rows.jsonl,max_tokens=32"]) == 0
    yours = {"data": "rows.jsonl", "max_tokens": 32}
    assert calls == [("dapo", {"loss_type": "dapo", **yours}),
                     ("rloo", {"loss_type": "dapo", "advantage_estimator": "rloo", **yours})]


def test_presets_benchmark_takes_settings_with_their_k_and_fields_and_compares_k1_runs(tmp_path, monkeypatch):
    from minirl.benchmarks import learning
    calls = []

    def fake(out, seeds, ks, eval_size, eval_every, **kw):
        calls.append((Path(out).name, ks, kw))
        curve = [[0, 0.1], [5, 0.5 if ks == (1,) else 0.3]]
        _learning_json(Path(out) / "learning.json", {f"s{seeds[0]}_k{ks[0]}": _k0(curve)})
    monkeypatch.setattr(learning, "bench_learning", fake)
    presets = ("dapo", "gspo-k1", "gspo-epochs2", "rloo", "dapo-entropy", "dapo-top-entropy")
    r = learning.bench_presets(tmp_path, presets=presets, seeds=(0,), eval_size=16, eval_every=5)
    assert calls == [("dapo", (0,), {"loss_type": "dapo"}), ("gspo-k1", (1,), {"loss_type": "gspo"}),
                     ("gspo-epochs2", (0,), {"loss_type": "gspo", "ppo_epochs": 2}),
                     ("rloo", (0,), {"loss_type": "dapo", "advantage_estimator": "rloo"}),
                     ("dapo-entropy", (0,), {"loss_type": "dapo", "entropy_coef": 0.01}),
                     ("dapo-top-entropy", (0,), {"loss_type": "dapo", "top_entropy_quantile": 0.2})]
    assert r["settings"]["gspo-k1"]["seeds"] == ["0"]  # its K = 1 run is the setting's run
    assert r["settings"]["gspo-k1"]["after_minus_dapo"]["mean"] == pytest.approx(0.2)
    assert r["settings"]["rloo"]["after_minus_dapo"]["mean"] == pytest.approx(0.0)
