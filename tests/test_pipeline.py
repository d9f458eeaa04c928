"""The asynchronous pipeline on a tiny model (transformers backend): exactness at K=0, bounds, accounting."""
import multiprocessing
import os
import threading
import time

import pytest
import torch
from conftest import TOY_ROWS
from safetensors.torch import load_file

from minirl import Run
from minirl.core.metrics import read_log


def _run(cfg, **kw):
    r = Run(cfg.replace(**kw), data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:48])
    s = r.run()
    return r, s


def test_k0_is_on_policy_and_repeats_bit_for_bit(toy_cfg, tmp_path):
    """K = 0 through the pipeline is the synchronous loop: every token sampled by the policy it trains (staleness
    0), and the same seed gives the same run, evaluation between steps included (the next step's generation waits
    for it)."""
    base = toy_cfg.replace(steps=4, max_async_steps=0, group_size=8, eval_every=2)
    r1, s1 = _run(base, out_dir=str(tmp_path / "a"))
    r2, s2 = _run(base, out_dir=str(tmp_path / "b"))
    keys = ("reward/mean", "loss", "length/mean", "entropy", "grad_norm")
    assert [[h.get(k) for k in keys] for h in r1.history] == [[h.get(k) for k in keys] for h in r2.history]
    assert sum("loss" in h for h in r1.history) >= 2  # real updates happened
    assert all(h["staleness/max"] == 0 for h in r1.history)
    a = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert s1["accounting"] == {"generated": 16, "trained": 16, "dropped_stale": 0, "unused": 0}
    assert s1["placement"]["train_device"] == "cpu" and s1["placement"]["max_async_steps"] == 0


@pytest.mark.parametrize("K", [1, 2])
def test_async_run_respects_staleness_bound_and_accounts_every_group(toy_cfg, K):
    r, s = _run(toy_cfg.replace(steps=6, max_async_steps=K))
    assert s["steps"] == 6
    for h in r.history:
        assert h["staleness/max"] <= K
    acc = s["accounting"]
    assert acc["generated"] == acc["trained"] + acc["dropped_stale"] + acc["unused"] == 6 * toy_cfg.prompts_per_step
    ev = read_log(toy_cfg.out_dir + "/metrics.jsonl")
    sides = {e["side"] for e in ev if e["event"] == "timeline"}
    assert sides == {"gen", "train"}


def test_max_staleness_drops_and_counts(toy_cfg):
    r, s = _run(toy_cfg.replace(steps=5, max_async_steps=2, max_staleness=0))
    acc = s["accounting"]
    dropped = sum(h["staleness/dropped_groups"] for h in r.history)
    assert dropped == acc["dropped_stale"]
    assert acc["generated"] == acc["trained"] + acc["dropped_stale"] + acc["unused"]
    for h in r.history:
        if h.get("train/tokens"):
            assert h["staleness/max"] == 0


def test_stop_in_the_middle_leaves_no_thread_behind(toy_cfg):
    before = set(threading.enumerate())
    run = Run(toy_cfg.replace(steps=200, max_async_steps=1), data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:44])
    run.start()
    deadline = time.monotonic() + 600  # only bounds a hang (a loaded 2-core machine once needed > 120 s)
    while len(run.history) < 2:
        assert time.monotonic() < deadline and run.running, "the run never got 2 steps in"
        time.sleep(0.05)

    def ours():
        return [th for th in set(threading.enumerate()) - before if th.is_alive() and th.name.startswith("minirl")]
    assert ours()  # the control: the run's threads are there while it runs
    run.stop(timeout=30)
    assert not run.running
    for th in ours():
        th.join(30)  # a thread that ends does so now; one that never does is left below
    assert not ours(), ours()
    procs = [p for p in multiprocessing.active_children() if p.name.startswith("minirl")]
    assert not procs, procs  # the generator process is gone too
    assert 2 <= run.summary["steps"] < 200


def test_step_time_leaves_out_the_evaluation_between_steps(toy_cfg, monkeypatch):
    """time/step_s is the step's own time: an evaluation after step 1 (made to take 1000 s of the run's clock here,
    a fake clock that jumps) is logged with its own seconds and not counted into step 2's time (it was, so time to
    accuracy counted evaluations)."""
    import types

    import minirl.run.loop as R
    real, skew = R.evaluate, [0.0]

    def slow(*a, **k):
        skew[0] += 1000.0  # stands for a long evaluation
        return real(*a, **k)
    monkeypatch.setattr(R, "evaluate", slow)
    monkeypatch.setattr(R, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + skew[0]))
    r, _ = _run(toy_cfg.replace(steps=4, eval_every=2, checkpoint_every=0))
    evals = [x for x in read_log(r.out / "metrics.jsonl") if x.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4] and all(e["seconds"] >= 1000 for e in evals)
    assert all(h["time/step_s"] < 1000 for h in r.history)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 cores to split")
def test_a_split_run_gives_the_process_back_its_threads_and_cores(toy_cfg):
    """A K = 1 run on the 1 + 1 split pins the trainer's thread to its core and sets torch's thread count; the next
    run in the process (a notebook's, the benchmarks' next variant) must start from what was there before."""
    threads, cores = torch.get_num_threads(), os.sched_getaffinity(0)
    c0, c1 = sorted(cores)[:2]
    seen = []
    cfg = toy_cfg.replace(steps=2, max_async_steps=1, gen_devices=str(c0), train_devices=str(c1))
    run = Run(cfg, data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:44])
    run.on_step.append(lambda rec: seen.append((torch.get_num_threads(), os.sched_getaffinity(0))))
    run.run()
    assert seen and all(s == (1, {c1}) for s in seen)  # the split was in force while it trained
    assert (torch.get_num_threads(), os.sched_getaffinity(0)) == (threads, cores)
