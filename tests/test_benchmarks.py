"""The benchmarks' side-by-side comparisons: tokens compared token by token, rounds interleaved with the order
alternating, and every JSON carrying seeds, rounds, order and settings. The engine benchmarks run at tiny sizes
on one engine (a run's: `run_parts`); a different seed on one side must show as a drop in the identical
fraction."""
import json
import os
import tempfile
from pathlib import Path

import pytest

from minirl.benchmarks.compare import identical_fraction, interleaved
from minirl.generation.factory import vllm_available

HAS_VLLM = vllm_available()
ENGINE_RUNS = pytest.mark.skipif(
    os.environ.get("MINIRL_FULL_TESTS") != "1",
    reason="the benchmarks on a real engine take minutes (an engine start, verification checks): "
           "MINIRL_FULL_TESTS=1 runs them; the default suite checks the comparisons' logic above")


def test_identical_fraction_compares_tokens_not_counts():
    a = [(1, 2, 3), (4, 5)]
    assert identical_fraction(a, list(a)) == 1.0
    assert identical_fraction(a, [(1, 2, 9), (4, 5)]) == 0.5  # the same token counts, one token differs
    assert identical_fraction(a, [(4, 5), (1, 2, 3)]) == 0.0  # the same sequences, not in the same places
    assert identical_fraction(a, a[:1]) == 0.5


def test_interleaved_alternates_which_side_goes_first_and_records_it():
    calls, hooks = [], []
    sides = {"a": lambda: calls.append("a") or [(1, 2)], "b": lambda: calls.append("b") or [(1, 3)]}
    res = interleaved(sides, 3, each_round=lambda r: hooks.append(r), each_side=lambda k: hooks.append(k))
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert res["order"] == [["a", "b"], ["b", "a"], ["a", "b"]] and res["rounds"] == 3
    assert hooks == [0, "a", "b", 1, "b", "a", 2, "a", "b"]
    assert res["identical_fraction"] == 0.0 and res["tokens"] == {"a": 6, "b": 6}


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from minirl.benchmarks.generation import run_parts
    trainer, gen, sync = run_parts(str(tmp_path_factory.mktemp("parts")), lora_rank=8)
    yield trainer, gen, sync
    sync.close()
    gen.close()


def _carries_the_record(c: dict, sides: set, rounds: int):
    assert set(c["seeds"]) == sides and c["rounds"] == rounds and len(c["order"]) == rounds
    assert [set(o) for o in c["order"]] == [sides] * rounds and c["order"][0] != c["order"][1]
    assert {"n", "max_tokens", "prompts", "temperature"} <= set(c["settings"])
    assert 0.0 <= c["identical_fraction"] <= 1.0 and len(c["identical_fraction_rounds"]) == rounds


@pytest.mark.vllm
@ENGINE_RUNS
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_generation_benchmark_writes_every_comparison_with_its_record(parts, tmp_path):
    from minirl.benchmarks.generation import bench_generation
    bench_generation(str(tmp_path), num_prompts=2, n=2, max_tokens=8, rounds=3, demo_rounds=3, servers=False,
                     parts=parts, demo_size=(2, 2, 6))
    res = json.loads((tmp_path / "generation.json").read_text())
    _carries_the_record(res["raw_vs_minirl"], {"raw", "minirl"}, 3)
    _carries_the_record(res["vllm_vs_hf"], {"hf", "vllm"}, 3)
    _carries_the_record(res["hf_merge"], {"merged", "unmerged"}, 3)
    _carries_the_record(res["cpu_lora"], {"vllm_ops", "minirl_ops"}, 3)
    assert res["cpu_lora"]["identical_fraction"] >= 0.75  # one engine, one seed: only rounding may flip a token
    assert all(len(v) == 3 and min(v) > 0 for v in res["cpu_lora"]["check_score_s"].values())
    check = res["check"]  # the probe scored whole vs position by position: the same logprobs, both timed
    assert check["max_diff"] < 2e-3 and all(len(v) == 3 and min(v) > 0 for v in check["score_s"].values())
    assert check["order"][:2] == ["whole", "per_position"] and check["order"][2:4] == ["per_position", "whole"]
    assert res["raw_vs_minirl"]["identical_fraction"] == 1.0  # the same seeds on one engine: the same tokens
    assert len(res["vllm_vs_hf"]["push_ms"]) == 3 and res["hf_merge"]["merge_ms"] > 0
    assert res["vllm_vs_hf"]["settings"]["engine_dtype"] == "float32" and res["settings"]["prefix_caching"]


@pytest.mark.vllm
@ENGINE_RUNS
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_a_different_seed_on_one_side_shows_as_different_tokens(parts):
    from minirl.benchmarks.generation import bench_hf_merge, bench_prompts, bench_raw_vs_minirl, demo_prompts
    from minirl.types import SamplingParams
    trainer, gen, _ = parts
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    prompts = bench_prompts(trainer.tokenizer, 2)
    assert bench_raw_vs_minirl(gen, prompts, 2, params, rounds=3, seeds=(0, 0))["identical_fraction"] == 1.0
    assert bench_raw_vs_minirl(gen, prompts, 2, params, rounds=3, seeds=(0, 1))["identical_fraction"] <= 0.25
    demo = demo_prompts(trainer.tokenizer, 2)
    same = bench_hf_merge(trainer, demo, 2, params, rounds=3, seeds=(0, 0), merge_reps=1)["identical_fraction"]
    other = bench_hf_merge(trainer, demo, 2, params, rounds=3, seeds=(0, 1), merge_reps=1)["identical_fraction"]
    assert same >= 0.75 and other <= 0.25


@pytest.mark.vllm
@ENGINE_RUNS
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_sync_benchmark_times_every_path_with_and_without_the_check(parts, tmp_path):
    from minirl.benchmarks.sync import BLOCKS, CHECKED, bench_sync
    _, gen, _ = parts
    paths = (("files", "continue"), ("ipc", "continue"), ("ipc", "inflight"))  # collective: as ipc, slower
    bench_sync(str(tmp_path), ranks=(8,), rounds=2, per_round=1, gen_rank=8, steps=1, pairs=2, max_tokens=4,
               per_step=2, paths=paths, generator=gen)
    res = json.loads((tmp_path / "sync.json").read_text())
    rows = {(r["transport"], r["inflight"], r["check"]): r for r in res["results"]}
    assert set(rows) == {(t, pol, False) for t, pol in paths} | {(t, pol, True) for t, pol in CHECKED}
    assert all(r["pushes"] == 2 and r["p50_ms"] > 0 for r in rows.values())
    assert all(("check_p50_ms" in r) == r["check"] for r in rows.values())
    (order,) = res["latency_rounds"]
    assert order["rounds"] == 2 and order["order"][0] == order["order"][1][::-1]
    assert res["gen_order"] == [list(BLOCKS), list(BLOCKS)[::-1]] and set(res["gen_identical_fraction"]) == set(BLOCKS)
    assert res["gen_identical_fraction"]["none"] == 1.0 and res["settings"]["engine_dtype"] == "float32"


def test_an_unknown_comparison_is_named_before_anything_loads(tmp_path):
    from minirl.benchmarks.generation import bench_generation
    with pytest.raises(ValueError, match=r"unknown comparisons \['cpu_lra'\]; choose from raw_vs_minirl"):
        bench_generation(str(tmp_path), only=["cpu_lra", "vllm_vs_hf"])
    assert not any(tmp_path.iterdir())


def test_the_generation_benchmark_leaves_no_scratch_folder_in_tmp_also_when_a_comparison_fails(tiny_model, tmp_path,
                                                                                                monkeypatch):
    """The parts' run folder (`minirl-bench-*` in the temp dir) exists while the comparisons run and is gone after,
    whether they end or one raises: the demo's trainer built for real on the tiny model, the comparison faked (its
    figures are the engine tests')."""
    from minirl.benchmarks import generation
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(generation, "DEMO", {**generation.DEMO, "model": tiny_model})
    seen = []

    def fake_merge(trainer, *args, **kwargs):
        seen.append((Path(trainer.cfg.out_dir), sorted(tmp.glob("minirl-bench-*"))))
        if len(seen) == 2:
            raise RuntimeError("a comparison broke")
        return {"fake": 1}
    monkeypatch.setattr(generation, "bench_hf_merge", fake_merge)
    res = generation.bench_generation(str(tmp_path / "out"), only=["hf_merge"], demo_size=(1, 1, 2))
    assert res["hf_merge"] == {"fake": 1} and (tmp_path / "out" / "generation.json").exists()
    with pytest.raises(RuntimeError, match="a comparison broke"):
        generation.bench_generation(str(tmp_path / "out"), only=["hf_merge"], demo_size=(1, 1, 2))
    assert [folders for _, folders in seen] == [[d] for d, _ in seen]  # the trainer's out_dir, made in tmp
    assert all(d.name.startswith("minirl-bench-") for d, _ in seen) and seen[0][0] != seen[1][0]
    assert sorted(tmp.glob("minirl-bench-*")) == []  # both gone
