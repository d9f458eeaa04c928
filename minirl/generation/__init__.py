"""Generation: prompts in, groups of G completions out, every token tagged with its behaviour logprob (temperature
applied: the distribution actually sampled from) and the policy version that produced it.

  hf.py          `HFGenerator`: transformers `generate`, on the trainer's own model (synchronous loop) or a copy
  fast_decode.py its static decoding path (Config.hf_decode 'static'): a static KV cache, a CUDA-graph step
  slots.py       that path's cache slots and their continuous refill (a finished sample's slot takes the next)
  hf_process.py  `ProcGenerator`: an `HFGenerator` in a process of its own (the asynchronous CPU pipeline)
  vllm.py        `VLLMGenerator`: vLLM `AsyncLLM` in a thread of its own (the only module importing vllm)
  engine_thread.py  that thread: its event loop, calls from other threads, shutdown
  judge_server.py the vLLM server of a `judge(serve=...)` reward (registered with minirl.rewards.llm_judge)
  vllm_server.py `ServerGenerator`: vLLM OpenAI-compatible servers over HTTP, started by minirl
                 (server_proc.py; server_auth.py guards them) or by you; server_api.py: the requests
  swaps.py       exact per-token versions across in-place adapter swaps (vLLM `inflight` policy)
  base.py        what the loop generators share: the loop thread, the per-request seed, the served-adapters table
  factory.py     `make_generator`, `pick_backend`: the generator and transport a run gets
  episodes.py    the episode runner: G multi-turn episodes per row, token-exact; chat.py: a template's turn deltas
  envs.py        `Env`, `EnvStep`, tools (schemas from type hints); tasks.py: the built-in multi-turn tasks

Every generator meets `minirl.types.Generator` (the members callers use); those on a loop of their own meet
`AsyncGenerator`.
"""
from minirl.generation import judge_server  # noqa: F401 - lets judge(serve=...) start its server
from minirl.generation.factory import make_generator, pick_backend, split_devices, vllm_available
from minirl.types import AsyncGenerator, Generator

__all__ = ["Generator", "AsyncGenerator", "make_generator", "pick_backend", "split_devices", "vllm_available"]
