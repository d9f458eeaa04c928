"""Issue 54 item 3: the memory plan counts a reward model (`reward_model(path=..., device=...)` in `rewards`,
`training.plan_reward`): each copy (one per reward worker; `reward_workers: 0` one) on the device it names, from its
config.json alone; one that does not fit stops the run before anything loads. GPUs faked as
tests/test_plan_placement.py fakes them; the folders hold a config.json and no weights."""
import json

import pytest
from test_plan_placement import _box

import minirl
from minirl import Config
from minirl.config import ConfigError
from minirl.run.placement import Devices, place
from minirl.run.plan import check_run_plan, plan_run
from minirl.training.plan import HEADROOM, GiB
from minirl.training.shapes.synthetic import shape_config

# qwen2.5-0.5b as a one-label classifier, bf16 (b = 2): vocab 151936, hidden 896, 24 layers, intermediate 4864,
# 14 heads of 64, 2 KV heads, tied, q/k/v biases. Its weights: 24 x (the 7 linears 896 x (896 + 2 x 128 + 896) +
# 4864 x 896 x 3 = 14,909,440, the biases 896 + 2 x 128 = 1152, the two norms 1792) + the embedding 151936 x 896
# + the final norm 896 + the score head 896 x 1 (no lm_head) = 494,033,664 parameters, 988,067,328 bytes.
RM_PARAMS, RM_WEIGHTS = 494_033_664, 988_067_328
# A batch of 4 rows of 256 prompt + 256 completion tokens = 2048 tokens, each the KV cache's 2 x 24 x 2 x 64 x 2
# = 12288 bytes and one layer's intermediates 2 x (4 x 896 + 3 x 896 + 3 x 4864) = 41728: 110,624,768 bytes.
RM_BATCH = 2048 * (12288 + 41728)


def _folders(tmp_path):
    """The policy's folder and the reward model's (its config.json a sequence classifier's)."""
    pol, rm = tmp_path / "pol", tmp_path / "rm"
    for d in (pol, rm):
        d.mkdir(exist_ok=True)
    (pol / "config.json").write_text(json.dumps(shape_config("qwen2.5-0.5b")))
    (rm / "config.json").write_text(json.dumps({**shape_config("qwen2.5-0.5b"), "id2label": {"0": "score"},
                                                "architectures": ["Qwen2ForSequenceClassification"]}))
    return str(pol), str(rm)


def _cfg(tmp_path, device="cuda:0", **fields):
    pol, rm = _folders(tmp_path)
    return Config(model=pol, backend="hf", max_tokens=256, out_dir=str(tmp_path / "run"),
                  rewards=[f"reward_model(path={rm!r}, device={device!r}, batch_size=4)"], **fields)


def test_the_plan_counts_each_workers_copy_on_the_reward_models_device(tmp_path):
    """Two reward workers: two copies on cuda:0, each its weights, a batch and its process's CUDA context; with
    `reward_workers: 0` one copy, in the run's process, whose context on the trainer's GPU is counted already. The
    parameters by hand are the classifier's own (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**shape_config("qwen2.5-0.5b"),
                                                                                     num_labels=1))
    assert sum(p.numel() for p in model.parameters()) == RM_PARAMS == RM_WEIGHTS // 2
    devices = Devices.fake(1, 80)
    cfg = _cfg(tmp_path, reward_workers=2)
    gpu = plan_run(cfg, devices, place(cfg, devices)).devices[0]
    copy = RM_WEIGHTS + RM_BATCH + GiB  # CUDA_CONTEXT_GB = 1
    assert gpu.train["reward model"] == gpu.generate["reward model"] == pytest.approx(2 * copy / GiB)
    assert gpu.role == "trainer + transformers generator + reward model"
    assert "2 copies (one per reward worker, reward_workers: 2)" in gpu.table()
    one = _cfg(tmp_path, reward_workers=0)
    gpu = plan_run(one, devices, place(one, devices)).devices[0]
    assert gpu.train["reward model"] == pytest.approx((RM_WEIGHTS + RM_BATCH) / GiB)
    cpu = _cfg(tmp_path, device="cpu", reward_workers=3)  # a GPU run's reward model on the CPU: a plan of its own
    p = plan_run(cpu, devices, place(cpu, devices))
    assert "reward model" not in p.devices[0].train and p.devices[-1].device == "cpu"
    assert p.devices[-1].role == "reward model"
    assert p.devices[-1].train == {"reward model": pytest.approx(3 * (RM_WEIGHTS + RM_BATCH) / GiB)}


def test_a_reward_model_that_does_not_fit_stops_the_run_before_anything_loads(tmp_path, monkeypatch):
    """A GPU with room for the run and one copy in its process, not for a worker's copy (with its own CUDA context;
    not even with the trainer in 4-bit, 0.49 GiB less): the run stops at its plan with one line naming the reward
    model and the ways out (the folders hold no weights: a run past the plan would fail loading them, with another
    message); `reward_workers: 0` fits."""
    alone = plan_run(_cfg(tmp_path).replace(rewards=["arithmetic_correct"]), Devices.fake(1, 80),
                     place(_cfg(tmp_path), Devices.fake(1, 80))).devices[0]
    gb = (alone.peak_gb + 1.2) * GiB / 1e9 / HEADROOM  # 1.2 GiB spare: a copy in the run's process (1.03 GiB),
    cfg = _cfg(tmp_path, reward_workers=1, token_budget=alone.token_budget)  # not in a worker (2.03)
    _box(monkeypatch, 1, gb)
    with pytest.raises(ConfigError, match=r"^the memory plan does not fit: .* on cuda:0 \(trainer \+ transformers "
                                          r"generator \+ reward model\).*the reward model takes 2\.0 GiB of it.*"
                                          r"set reward_workers: 0") as e:
        minirl.Run(cfg).setup()
    assert "\n" not in str(e.value)
    one = cfg.replace(reward_workers=0)
    assert check_run_plan(one, Devices.fake(1, gb), place(one, Devices.fake(1, gb))).fits
    vllm, small = _cfg(tmp_path, reward_workers=2).replace(backend="vllm"), Devices.fake(1, 8, vllm=True)
    with pytest.raises(ConfigError, match=r"^the memory plan does not fit on cuda:0 .*gives the vLLM engine 0\.0 GB.*; "
                                          r"the reward model takes 4\.0 GiB of the GPU .*set reward_workers: 0"):
        check_run_plan(vllm, small, place(vllm, small))  # an engine beside them gets no share: the same ways out


def test_a_reward_model_on_a_device_the_machine_lacks_is_one_line_even_on_cpu(tmp_path):
    cfg = _cfg(tmp_path, device="cuda:1")
    with pytest.raises(ConfigError, match=r"^a reward model is placed on 'cuda:1', which this machine does not "
                                          r"have \(1 GPUs\): give reward_model\(...\) device='cpu' or one of "
                                          r"cuda:0..cuda:0$"):
        check_run_plan(cfg, Devices.fake(1, 80), place(cfg, Devices.fake(1, 80)))
    with pytest.raises(ConfigError, match=r"^a reward model is placed on 'cuda:1'.*\(0 GPUs\)"):
        check_run_plan(cfg, Devices(0), place(cfg, 0))  # a CPU run warns for its own plan, not for this
    gone = cfg.replace(rewards=["reward_model(path='./no-such-rm')"])
    with pytest.raises(ConfigError, match=r"the reward model folder './no-such-rm' does not exist"):
        check_run_plan(gone, Devices(0), place(gone, 0))


def test_the_engines_auto_share_leaves_the_reward_models_copies_room(tmp_path, monkeypatch):
    """vLLM's 'auto' share beside the trainer is sized from the memory free when the engine starts, before the
    reward model loads (at its first call): its copies are kept out of the share. 80 GB, 64 GB free: without them
    (64 - 1.07 context - 6.4 headroom) / 80 = 0.707 -> 0.70; with two copies, 2 x 2.02 GiB = 4.34 GB less: 0.65."""
    import torch

    from minirl.training.plan import resolve_engine_share
    from minirl.training.plan_reward import reward_gb_on
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 * 10**9, 80 * 10**9))
    cfg = _cfg(tmp_path, reward_workers=2).replace(backend="vllm")
    rm = reward_gb_on(cfg, "cuda")  # the trainer's device as the factory has it: 'cuda' is cuda:0
    assert rm == pytest.approx(2 * (RM_WEIGHTS + RM_BATCH + GiB) / GiB)
    assert resolve_engine_share(cfg, "cuda:0", "0", True) == 0.70
    assert resolve_engine_share(cfg, "cuda:0", "0", True, rm) == 0.65
    assert reward_gb_on(cfg.replace(rewards=["arithmetic_correct"]), "cuda:0") == 0.0
