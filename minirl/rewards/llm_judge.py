"""A model-graded reward: `judge(template, parse=...)` asks a language model to grade each completion and reads a
number from its reply. In `rewards` as `judge(...)` in Python, or as the string `judge(template='...', url='...')`
in a config (literal values, as every reward's `name(key=value)`; `parse` then a built-in's name or
'module:function').

- The question is `template` with `{prompt}`, `{completion}` and any dataset column filled in (a message list:
  its contents, one per line), sent as one user message, greedy (temperature 0), at most `max_tokens`.
- The model: exactly one of `url` (an OpenAI-compatible base URL, as the OpenAI client takes it, e.g.
  'https://api.openai.com/v1'; the key is read from the environment variable `api_key_env` at each call, never
  stored; a URL off this machine needs it set), `serve` (a model folder, Hub id or the embedded model's name:
  minirl starts one vLLM server for it on 127.0.0.1 with a random key, once per process, before the reward
  workers, and stops it at exit: `minirl.generation.judge_server`), or `local` (the same names; transformers in
  the process that scores, loaded once per process: with `reward_workers: 0`, one copy; the memory plan counts
  each copy, `training.plan_judge`).
- `parse`: 'score' (the last number in the reply), 'yes_no' (1.0 for yes, 0.0 for no, the first of them), or a
  callable `reply -> float | None`.
- A group's questions go out together, at most `concurrency` at a time, each bounded by `timeout_s`; a reply is
  cached in the process by (backend, model, question), the question being the filled template (so by prompt,
  completion and template), and never asked again. `reward_timeout_s` bounds the whole group's call: give it
  room (several `timeout_s` when a group needs more than `concurrency` questions).
- Nothing becomes 0.0 silently: a reply `parse` cannot read (None, or it raised) fails its sample with the
  reply's first line (`UnreadableReply`); a timeout, an error status or no connection fails it naming the URL and
  the fix (`JudgeError`); each is a recorded reward failure, in `minirl.check`, the samples and `reward/failures`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hashlib
import inspect
import ipaddress
import os
import re
import string
import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minirl.rewards.registry import BoundReward, import_ref, reward

CACHE_SIZE = 1 << 16  # replies kept per process
BACKENDS = ("url", "serve", "local")


class UnreadableReply(Exception):
    """A reply the parser could not read; its message holds the reply's first line."""


class JudgeError(Exception):
    """No reply: a timeout, an error status, no connection; its message names the URL and the fix."""


class ProcessState:
    """What one process keeps: the reply cache, the local models, the base URLs' model names, and (in the process
    that imported minirl.generation) how to start a vLLM server. Pickled empty: a reward worker gets its own."""

    def __init__(self) -> None:
        self.cache: OrderedDict = OrderedDict()
        self.local: dict[str, tuple[Any, Any]] = {}
        self.models: dict[str, str] = {}
        self.lock = threading.Lock()
        self.starter: Callable[[str], tuple[str, str]] | None = None
        self.resolve: Callable[[str], str] = str

    def __reduce__(self):
        return ProcessState, ()


STATE = ProcessState()


def set_server_starter(start: Callable[[str], tuple[str, str]], resolve: Callable[[str], str]) -> None:
    """`start(model) -> (base URL, API key)` for `serve=`, and `resolve(model) -> folder or Hub id` for `serve=` and
    `local=` (the embedded model's name: its folder), in the trainer (set by minirl.generation.judge_server)."""
    STATE.starter, STATE.resolve = start, resolve


def last_number(reply: str) -> float | None:
    """The last number written in `reply` ('Score: 7/10' -> 10.0, 'I give it 4.5' -> 4.5); None if none."""
    found = re.findall(r"[-+]?\d+(?:\.\d+)?", reply)
    return float(found[-1]) if found else None


def yes_no(reply: str) -> float | None:
    """1.0 if the first 'yes' or 'no' word in `reply` is yes, 0.0 if no; None if neither appears."""
    m = re.search(r"\b(yes|no)\b", reply, re.I)
    return None if m is None else float(m.group(1).lower() == "yes")


PARSERS: dict[str, Callable[[str], float | None]] = {"score": last_number, "yes_no": yes_no}


def parser(parse: str | Callable) -> Callable[[str], float | None]:
    if callable(parse):
        return parse
    if parse in PARSERS:
        return PARSERS[parse]
    if isinstance(parse, str) and ":" in parse:
        return import_ref(parse, "judge parser", "module:function")[1]
    raise ValueError(f"judge: parse={parse!r} is neither {sorted(PARSERS)} nor a callable reply -> float | None "
                     "(or a 'module:function' path to one)")


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def served_env(model: str) -> tuple[str, str]:
    """The environment variables holding the URL and key of the server minirl started for `serve=model`: the
    reward workers inherit them."""
    h = hashlib.sha1(model.encode()).hexdigest()[:12].upper()
    return f"MINIRL_JUDGE_URL_{h}", f"MINIRL_JUDGE_KEY_{h}"


def check_params(template: str | None, parse: Any, url: str | None, serve: str | None, local: str | None,
                 api_key_env: str, max_tokens: int, timeout_s: float, concurrency: int) -> None:
    """One line for arguments that cannot work, before anything starts."""
    if not isinstance(template, str) or not template:
        raise ValueError("judge: give template=, the question with {prompt} and {completion} (and any column)")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"judge: template cannot be filled ({e}); write a literal brace as {{{{ or }}}}") from None
    if "completion" not in fields:
        raise ValueError("judge: template has no {completion}: the judge would never see what it grades")
    given = [k for k, v in (("url", url), ("serve", serve), ("local", local)) if v]
    if len(given) != 1:
        raise ValueError(f"judge: give exactly one of url= (an OpenAI-compatible server), serve= (a model minirl "
                         f"serves with vLLM) or local= (a transformers model in process); got {given or 'none'}")
    if url and not urlsplit(url).scheme.startswith("http"):
        raise ValueError(f"judge: url={url!r} is not an http(s) base URL, e.g. 'http://127.0.0.1:8000/v1'")
    if url and not is_loopback(url) and not os.environ.get(api_key_env):
        raise ValueError(f"judge: url={url} is off this machine and ${api_key_env} is not set: export the key "
                         f"there (or name its variable with api_key_env=)")
    parser(parse)
    if max_tokens < 1 or not timeout_s > 0 or concurrency < 1:
        raise ValueError(f"judge: max_tokens ({max_tokens}) and concurrency ({concurrency}) must be >= 1, "
                         f"timeout_s ({timeout_s}) > 0")


def text_of(x: str | Sequence[dict]) -> str:
    return x if isinstance(x, str) else "\n".join(str(m.get("content", "")) for m in x)


def fill(template: str, prompt: Any, completion: Any, columns: dict) -> str:
    try:
        return template.format_map({**columns, "prompt": text_of(prompt), "completion": text_of(completion)})
    except KeyError as e:
        raise ValueError(f"judge: template field {e} is neither prompt, completion nor a column of the data "
                         f"(columns: {sorted(columns)})") from None


def first_line(reply: str) -> str:
    return next((ln.strip() for ln in reply.splitlines() if ln.strip()), "")[:120]


def verdict(reply: str | Exception, read: Callable, parse: Any) -> float | Exception:
    """The score of one reply, or the sample's failure (an exception as the entry: `worker_main.number`); a
    failure's message starts with the reply, which a table cut short still shows."""
    if isinstance(reply, Exception):
        return reply
    how = parse if isinstance(parse, str) else getattr(parse, "__name__", "parser")
    try:
        value = read(reply)
    except Exception as e:  # noqa: BLE001 - the parser's error is this sample's failure
        return UnreadableReply(f"first line: {first_line(reply)!r}: parse={how} raised {type(e).__name__} on the reply")
    if value is None:
        return UnreadableReply(f"first line: {first_line(reply)!r}: parse={how} cannot read the reply")
    return value


@reward(name="judge", batched=True)
def judge_reward(prompts: Sequence, completions: Sequence, *, template: str | None = None,
                 parse: str | Callable = "score", url: str | None = None, model: str | None = None,
                 api_key_env: str = "OPENAI_API_KEY", serve: str | None = None, local: str | None = None,
                 max_tokens: int = 64, timeout_s: float = 60.0, concurrency: int = 8, **columns: Any) -> list:
    """The judge's score of each completion (module docstring); `judge(...)` builds it for `rewards`."""
    check_params(template, parse, url, serve, local, api_key_env, max_tokens, timeout_s, concurrency)
    each = {k: v for k, v in columns.items() if isinstance(v, list) and len(v) == len(completions)}
    questions = [fill(template, p, c, {k: v[i] for k, v in each.items()})
                 for i, (p, c) in enumerate(zip(prompts, completions))]
    where = f"local:{local}" if local else url.rstrip("/") if url else endpoint(serve)[0]

    def ask(qs: list[str]) -> list:
        if local:
            return local_replies(local, qs, max_tokens, concurrency)
        key = os.environ.get(api_key_env) if url else endpoint(serve)[1]
        return in_a_loop(lambda: http_replies(where, key, model or serve, qs, max_tokens, timeout_s, concurrency,
                                              api_key_env if url else None))
    keys = [(where, model, max_tokens, q) for q in questions]
    replies = {k: STATE.cache[k] for k in keys if k in STATE.cache}
    todo = list(dict.fromkeys(k for k in keys if k not in replies))
    for k, r in zip(todo, ask([k[3] for k in todo]) if todo else []):
        replies[k] = r
        if not isinstance(r, Exception):
            STATE.cache[k] = r
            if len(STATE.cache) > CACHE_SIZE:
                STATE.cache.popitem(last=False)
    read = parser(parse)
    return [verdict(replies[k], read, parse) for k in keys]


def endpoint(serve: str) -> tuple[str, str]:
    """(base URL, key) of the vLLM server minirl started for `serve`: from the environment (set where it was
    started: the trainer, for its workers), else started now (in a process that can)."""
    url_var, key_var = served_env(serve)
    if url_var not in os.environ:
        if STATE.starter is None:
            raise RuntimeError(f"judge: no server was started for serve={serve!r} (minirl starts it in the trainer, "
                               "before the reward workers); score through a Scorer or a Run")
        start_server(serve)
    return os.environ[url_var], os.environ[key_var]


def start_server(serve: str) -> None:
    url_var, key_var = served_env(serve)
    with STATE.lock:
        if url_var not in os.environ:
            base, key = STATE.starter(serve)
            os.environ[key_var], os.environ[url_var] = key, base + "/v1"


def in_a_loop(make: Callable) -> Any:
    """Run the coroutine `make()` gives to its end: here, or on a thread of its own where this thread already runs
    an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with cf.ThreadPoolExecutor(1) as ex:
        return ex.submit(lambda: asyncio.run(make())).result()


async def http_replies(base: str, key: str | None, model: str | None, questions: list[str], max_tokens: int,
                       timeout_s: float, concurrency: int, key_var: str | None) -> list[str | Exception]:
    """Each question's reply text from POST {base}/chat/completions, at most `concurrency` at once, each bounded
    by `timeout_s`; a failed request gives its JudgeError instead."""
    import httpx
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(headers=headers, trust_env=not is_loopback(base), timeout=None) as client:
        try:
            name = model or await asyncio.wait_for(first_model(client, base), timeout_s)
        except Exception as e:  # noqa: BLE001 - every question fails with the same reason
            return [failed(e, f"{base}/models", timeout_s, key_var)] * len(questions)

        async def one(q: str) -> str | Exception:
            body = dict(model=name, messages=[{"role": "user", "content": q}], temperature=0.0, max_tokens=max_tokens)
            async with gate:
                try:
                    r = await asyncio.wait_for(request(client, f"{base}/chat/completions", body), timeout_s)
                    return str(r["choices"][0]["message"]["content"] or "")
                except Exception as e:  # noqa: BLE001 - this question's failure, named
                    return failed(e, f"{base}/chat/completions", timeout_s, key_var)
        return list(await asyncio.gather(*(one(q) for q in questions)))


async def first_model(client, base: str) -> str:
    if base not in STATE.models:
        data = (await request(client, f"{base}/models", None))["data"]
        STATE.models[base] = data[0]["id"]
    return STATE.models[base]


class Status(Exception):
    def __init__(self, code: int, text: str):
        super().__init__(f"answered {code}: {' '.join(text.split())[:200]}")
        self.code = code


async def request(client, url: str, body: dict | None) -> dict:
    """POST `body` (GET without one); an error status raises Status."""
    r = await (client.post(url, json=body) if body is not None else client.get(url))
    if r.status_code >= 400:
        raise Status(r.status_code, r.text)
    return r.json()


def failed(e: Exception, where: str, timeout_s: float, key_var: str | None) -> JudgeError:
    """The JudgeError for a request to `where` that raised `e`: what happened and the fix, never the key."""
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return JudgeError(f"no reply from {where} within timeout_s={timeout_s:g} s: raise timeout_s (and "
                          "reward_timeout_s), or lower concurrency if the server is overloaded")
    if isinstance(e, Status):
        fix = ("check the key in $" + key_var if key_var else "check the key") if e.code in (401, 403) else \
            "check url (the base URL, ending in /v1) and model" if e.code == 404 else "see the server's log"
        return JudgeError(f"{where} {e}; {fix}")
    if type(e).__module__.startswith("httpx"):
        return JudgeError(f"cannot reach {where} ({type(e).__name__}: {e}); is the server running there?")
    return JudgeError(f"{where} gave an answer that is not an OpenAI chat completion ({type(e).__name__}: {e})")


def local_replies(path: str, questions: list[str], max_tokens: int, batch: int) -> list[str]:
    """Greedy replies of the transformers model at `path`, `batch` questions at a time (left-padded)."""
    with STATE.lock:
        if path not in STATE.local:
            tok = AutoTokenizer.from_pretrained(path, padding_side="left")
            tok.pad_token = tok.pad_token or tok.eos_token
            STATE.local[path] = tok, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok, lm = STATE.local[path]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             if tok.chat_template else q for q in questions]
    out: list[str] = []
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i:i + batch], return_tensors="pt", padding=True, add_special_tokens=not tok.chat_template)
            ids = lm.generate(**enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            out += tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def judge(template: str, parse: str | Callable = "score", *, url: str | None = None, model: str | None = None,
          api_key_env: str = "OPENAI_API_KEY", serve: str | None = None, local: str | None = None,
          max_tokens: int = 64, timeout_s: float = 60.0, concurrency: int = 8, name: str = "judge") -> BoundReward:
    """A model-graded reward for `rewards` (module docstring), named `name` (`reward/<name>` in the metrics: give
    each judge of a run its own), e.g. `judge("Is this answer to {prompt} correct? {completion} Say yes or no.",
    "yes_no", url="http://127.0.0.1:8000/v1")`. The key itself is never part of it: only `api_key_env`."""
    params = dict(template=template, parse=parse, url=url, model=model, api_key_env=api_key_env, serve=serve,
                  local=local, max_tokens=max_tokens, timeout_s=timeout_s, concurrency=concurrency)
    check_params(template, parse, url, serve, local, api_key_env, max_tokens, timeout_s, concurrency)
    resolve_models(params)
    return BoundReward(judge_reward, params, name)


def resolve_models(params: dict) -> None:
    """`serve` and `local` as a folder or Hub id ('smollm2-135m-instruct': the embedded model's folder), in place."""
    for k in ("serve", "local"):
        if params.get(k):
            params[k] = STATE.resolve(params[k])


def judge_params(fn: Callable) -> dict | None:
    """A judge reward's fixed arguments (from `judge(...)` or the string 'judge(...)'); None for other rewards."""
    return fn.params if isinstance(fn, BoundReward) and fn.fn is judge_reward else None


def start_judges(rewards: Sequence[tuple[str, Callable]]) -> None:
    """Before the reward workers start (`Scorer.pool`): check each judge's arguments (one line, naming the
    reward) and start the vLLM servers of those with `serve=`, here, so the workers inherit their URL and key."""
    for name, fn in rewards:
        params = judge_params(fn)
        if params is None:
            continue
        defaults = inspect.signature(judge_reward).parameters
        p = {k: params.get(k, defaults[k].default) for k in inspect.signature(check_params).parameters}
        try:
            check_params(**p)
        except ValueError as e:
            raise ValueError(f"reward {name!r}: {e}") from None
        resolve_models(params)
        p.update({k: params[k] for k in ("serve", "local") if params.get(k)})
        if p["serve"] and served_env(p["serve"])[0] not in os.environ:
            if STATE.starter is None:
                raise RuntimeError(f"reward {name!r}: serve= needs minirl.generation (import minirl)")
            start_server(p["serve"])
